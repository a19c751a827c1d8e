"""An independent scorer for the chain: greedy decoding from the prompt, as an inference server answers.

It shares nothing with the product's evaluation (jobs/learning/evaluate.py scores the reference reply
under teacher forcing): the base model and the adapter load through transformers + PEFT, the prompt
is the tokenizer's chat template with the generation prompt, the loop below takes the argmax token
by token (the whole sequence recomputed each step: a handful of steps on a tiny model) until the end
of the turn, and the decoded text must equal the answer. So a figure of the chain cannot inherit a
mistake of the code it judges.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

MAX_NEW_TOKENS = 6  # the answers are one or two tokens, then the end of the turn


def load(model: Path, adapter: Path | None, *, device: str = "cpu") -> tuple[Any, Any]:
    import torch

    from jobs.training.backends.peft_env import hide_torchao_peft_refuses

    hide_torchao_peft_refuses()  # as a night does: an older torchao beside Unsloth makes PEFT refuse every LoRA
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    tok = AutoTokenizer.from_pretrained(model)
    net = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).to(device)
    if adapter is not None:
        net = PeftModel.from_pretrained(net, adapter)
    return net.eval(), tok


def greedy_replies(net: Any, tok: Any, prompts: Sequence[str], *, batch: int = 64,
                   max_new_tokens: int = MAX_NEW_TOKENS) -> list[str]:
    """Each user prompt's greedy reply (text up to the end of the turn, stripped)."""
    import torch

    stops = {i for i in (tok.eos_token_id, tok.convert_tokens_to_ids("<|end|>")) if isinstance(i, int) and i >= 0}
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    dev = getattr(net, "device", None) or "cpu"  # a transformers / PEFT model's card (a scripted test net: none)
    out: list[str] = []
    for start in range(0, len(prompts), batch):
        texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
                 for p in prompts[start : start + batch]]
        ids = [tok(t, add_special_tokens=False).input_ids for t in texts]
        replies: list[list[int]] = [[] for _ in ids]
        done = [False] * len(ids)
        for _ in range(max_new_tokens):
            seqs = [i + r for i, r in zip(ids, replies, strict=True)]
            width = max(len(s) for s in seqs)
            x = torch.tensor([[pad] * (width - len(s)) + s for s in seqs], device=dev)  # left padding
            mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in seqs], device=dev)
            pos = (mask.cumsum(-1) - 1).clamp(min=0)
            with torch.no_grad():
                nxt = net(input_ids=x, attention_mask=mask, position_ids=pos).logits[:, -1].argmax(-1).tolist()
            for j, t in enumerate(nxt):
                if done[j]:
                    continue
                if t in stops:
                    done[j] = True
                else:
                    replies[j].append(int(t))
            if all(done):
                break
        out += [tok.decode(r, skip_special_tokens=True).strip() for r in replies]
    return out


def exact_match(model: Path, adapter: Path | None, test_sets: dict[str, list[dict[str, Any]]]) -> dict[str, float]:
    """Share of each set's records whose greedy reply equals the record's answer."""
    net, tok = load(model, adapter)
    return _scores(net, tok, test_sets)


def _scores(net: Any, tok: Any, test_sets: dict[str, list[dict[str, Any]]], batch: int = 64) -> dict[str, float]:
    scores = {}
    for name, records in test_sets.items():
        prompts = [r["messages"][0]["content"] for r in records]
        answers = [r["messages"][1]["content"].strip() for r in records]
        replies = greedy_replies(net, tok, prompts, batch=batch)
        scores[name] = round(sum(a == b for a, b in zip(replies, answers, strict=True)) / len(records), 4)
    return scores


class Scorer:
    """`exact_match` of several adapters (None: the base alone) on one load of the base: each adapter is put
    on beside the others by PEFT and made the active one, so an 8B base is read once, not once per adapter.
    On CUDA the fp32 matmuls run as TF32 while scoring (the setting is put back after)."""

    def __init__(self, model: Path, *, device: str = "cpu", batch: int = 64) -> None:
        self.base, self.tok = load(model, None, device=device)
        self.net: Any = None
        self.count, self.batch, self.cuda = 0, batch, device.startswith("cuda")

    def score(self, adapter: Path | None, test_sets: dict[str, list[dict[str, Any]]]) -> dict[str, float]:
        import torch
        from peft import PeftModel

        tf32 = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = self.cuda
        try:
            if adapter is None:
                if self.net is None:
                    return _scores(self.base, self.tok, test_sets, self.batch)
                with self.net.disable_adapter():
                    return _scores(self.net, self.tok, test_sets, self.batch)
            name = f"a{self.count}"
            self.count += 1
            if self.net is None:
                self.net = PeftModel.from_pretrained(self.base, adapter, adapter_name=name).eval()
            else:
                self.net.load_adapter(adapter, adapter_name=name)
            self.net.set_adapter(name)
            return _scores(self.net, self.tok, test_sets, self.batch)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = tf32
