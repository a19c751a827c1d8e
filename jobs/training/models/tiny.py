"""Build the embedded default model offline: a tiny random-initialised Llama and a
BPE tokenizer trained on the shipped sample data.

It exercises the exact code path of a real local Hugging Face model directory
(config.json, safetensors, tokenizer.json with a chat template) with nothing
downloaded, so a fresh CPU machine can run a whole night in about a minute.

A model that can learn: LoRA trains the attention and MLP layers, never the output layer, so
the output layer is initialised at a scale where one token can take nearly all the probability
(std 1.5/sqrt(hidden) instead of 0.02). With the usual 0.02 the logits of a 128-wide model stay
within a few units whatever the hidden state, every token's probability is capped near 0.7 % and
no loss falls below ~5.1 nats, so a task learned to 99 % exact match still read as loss 5.16.
With this scale a learned answer's loss falls to ~0.02 and the gate's loss figures mean something.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from jobs.store.files import fsync_tree

# A template whose renderings of a conversation's prefixes are string prefixes of the
# whole: assistant spans can then be found by rendering prefixes (see jobs/render.py).
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]
TINY_LLAMA = {  # ~1.3 M parameters: seconds per epoch of the sample data on 2 CPU cores
    "vocab_size": 2048,
    "hidden_size": 128,
    "intermediate_size": 352,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}
# output layer init: logit of token t = w_t . h with |h| ~ sqrt(hidden) after the final norm; rows of
# norm ~1.5 let an aligned hidden state give one token a logit ~17 against N(0, 1.5) for the rest
OUTPUT_INIT_SCALE = 1.5


TOKENIZER_TEXT_CHARS = 4_000_000
"""The demo tokenizer learns from at most this much of the inbox's text (~160x the shipped inbox): its 2,048-token
vocabulary needs no more, and the build (and a plan's build in a temporary directory) stays seconds long on an
inbox of gigabytes, where reading all of it took minutes and a Ctrl-C waited for the end of it (issue 42)."""

JSON_FILE_MAX_BYTES = 64_000_000  # a `.json` file is parsed whole: larger ones are left to the pull
LINE_MAX_BYTES = 1 << 20  # a longer JSONL line is skipped unread (the pull quarantines it: max_record_bytes)
WORD_MAX_CHARS = 256
"""A longer run of characters without a space is cut into pieces of this length for the tokenizer: BPE training is
quadratic in a word's length (one 200,000-character word took 16 s on the 2-core box, a record holding a 4 MB one
stalled a first night's build for hours); no useful token is longer."""
_LONG_WORD = re.compile(rf"\S{{{WORD_MAX_CHARS}}}")


def texts_for_tokenizer(paths: Iterable[Path], max_chars: int = TOKENIZER_TEXT_CHARS) -> list[str]:
    """String values of the inbox's JSON(L) files, in the order given, up to `max_chars` characters.

    The demo model is built before the first night's pull, from whatever the user dropped in the
    inbox: a line or file that cannot be read (not UTF-8, not JSON, not a file at all) is skipped
    here and quarantined by the pull, like on any other night. Never raises on the files' content.
    """
    out: list[str] = []
    left = max_chars

    def walk(v: object) -> None:  # iterative: a deeply nested record must not exhaust the stack
        nonlocal left
        todo = [v]
        while todo and left > 0:
            x = todo.pop()
            if isinstance(x, str):
                piece = x[:left]
                out.append(_LONG_WORD.sub(r"\g<0> ", piece))
                left -= len(piece)
            elif isinstance(x, dict):
                todo.extend(reversed(list(x.values())))
            elif isinstance(x, list):
                todo.extend(reversed(x))

    def chunks(p: Path) -> Iterator[bytes]:
        if p.suffix == ".jsonl":
            with p.open("rb") as f:  # a line at a time: the file may be larger than memory, a line too
                while line := f.readline(LINE_MAX_BYTES + 1):
                    if len(line) <= LINE_MAX_BYTES or line.endswith(b"\n"):
                        yield line
                        continue
                    while (line := f.readline(LINE_MAX_BYTES)) and not line.endswith(b"\n"):
                        pass
        elif p.suffix == ".json" and p.stat().st_size <= JSON_FILE_MAX_BYTES:
            yield p.read_bytes()

    for p in paths:
        try:
            for chunk in chunks(p):
                if left <= 0:
                    return out
                try:
                    walk(json.loads(chunk.decode("utf-8")))
                except (UnicodeDecodeError, ValueError, RecursionError):
                    continue
        except OSError:
            continue
    return out


def build_tiny_llama(out_dir: Path, corpus_files: Iterable[Path], *, seed: int = 0) -> Path:
    """Write a tiny Llama + tokenizer to out_dir (atomically: temp dir, then rename)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=out_dir.parent))
    try:
        bpe = Tokenizer(models.BPE(unk_token=None))
        bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        bpe.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=TINY_LLAMA["vocab_size"],
            special_tokens=SPECIAL_TOKENS,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        bpe.train_from_iterator(texts_for_tokenizer(sorted(corpus_files)), trainer=trainer)
        tok = PreTrainedTokenizerFast(
            tokenizer_object=bpe,
            bos_token="<|bos|>",
            eos_token="<|eos|>",
            pad_token="<|pad|>",
            additional_special_tokens=["<|end|>", "<|system|>", "<|user|>", "<|assistant|>"],
        )
        tok.chat_template = CHAT_TEMPLATE
        tok.save_pretrained(tmp)

        torch.manual_seed(seed)
        cfg = LlamaConfig(
            **TINY_LLAMA,
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.convert_tokens_to_ids("<|end|>"),
            pad_token_id=tok.pad_token_id,
        )
        model = LlamaForCausalLM(cfg)
        with torch.no_grad():
            model.lm_head.weight.normal_(0.0, OUTPUT_INIT_SCALE / TINY_LLAMA["hidden_size"] ** 0.5)
        model.save_pretrained(tmp)
        fsync_tree(tmp)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.rename(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir
