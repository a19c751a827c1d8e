"""What the workload stacks share: the publications' data shapes, the hard memory cap, timing a
transformers Trainer, ours' probed-budget window, and the rows they write.

Rows carry `workload`, `side` ("publication" or "ours"), `arch` and `flops_per_token_param` (4 for
LoRA: forward 2 + input gradients 2 per frozen weight; 6 for full fine-tuning: + weight gradients 2),
from which the report computes MFU against 790 (measured) and 989 (datasheet) TFLOP/s.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from typing import Any

from benchmarks.measure import Window, append_row, peak_gb
from benchmarks.settings import BenchSettings
from benchmarks.stacks.common import Job
from jobs.data.batching import IGNORE_INDEX, TokenizedSample
from jobs.training.models.synthetic import sample_lengths

LORA_FLOPS, FULL_FLOPS = 4, 6


def fixed_samples(n: int, length: int, *, vocab: int, seed: int = 0) -> list[TokenizedSample]:
    """n samples of exactly `length` random tokens (Exxact: text cut into 512-token blocks)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        ids = [rng.randrange(16, vocab - 16) for _ in range(length)]
        out.append(TokenizedSample(i, ids, list(ids)))
    return out


def profile_samples(profile: str, n: int, *, vocab: int, seed: int = 0, start: int = 0) -> list[TokenizedSample]:
    """Exactly n samples with a length profile's log-normal lengths (alpaca: mean 117, wiki: 861)."""
    rng = random.Random(seed)
    out = []
    for i, length in enumerate(sample_lengths(profile, n, seed=seed)):
        ids = [rng.randrange(16, vocab - 16) for _ in range(length)]
        out.append(TokenizedSample(start + i, ids, list(ids)))
    return out


def hard_cap(cap_gb: float | None) -> float | None:
    """Make `cap_gb` a hard limit of this process's CUDA allocator (an allocation past it is an
    out-of-memory, as on a card of that size). Returns the fraction set."""
    import torch

    if not cap_gb:
        return None
    frac = min(1.0, cap_gb * 1e9 / torch.cuda.get_device_properties(0).total_memory)
    torch.cuda.set_per_process_memory_fraction(frac)
    return round(frac, 4)


def collate(features: Sequence[dict[str, list[int]]], counts: list[tuple[int, int]]) -> dict[str, Any]:
    """Pad to the longest (labels -100 on padding), as the recipes' collators do; counts real tokens."""
    import torch

    longest = max(len(f["input_ids"]) for f in features)
    ids, labels, mask = [], [], []
    for f in features:
        pad = longest - len(f["input_ids"])
        ids.append(list(f["input_ids"]) + [0] * pad)
        labels.append(list(f["labels"]) + [IGNORE_INDEX] * pad)
        mask.append([1] * len(f["input_ids"]) + [0] * pad)
    counts.append((sum(len(f["input_ids"]) for f in features), len(features)))
    return {"input_ids": torch.tensor(ids), "labels": torch.tensor(labels), "attention_mask": torch.tensor(mask)}


def as_dataset(samples: Sequence[TokenizedSample]) -> list[dict[str, list[int]]]:
    return [{"input_ids": x.input_ids, "labels": x.labels} for x in samples]


def trainer_timer(win: Window, counts: list[tuple[int, int]]) -> Any:
    """A TrainerCallback timing each optimizer step into `win` (device synchronised), stopping
    training once the window is complete."""
    import torch
    from transformers import TrainerCallback

    class Timer(TrainerCallback):
        last = 0.0

        def on_train_begin(self, args: Any, state: Any, control: Any, **k: Any) -> None:
            torch.cuda.synchronize()
            self.last = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **k: Any) -> None:
            torch.cuda.synchronize()
            now = time.perf_counter()
            i = state.global_step - 1
            toks, n = counts[i] if i < len(counts) else (0, 0)
            if win.step_done(now - self.last, toks, n):
                control.should_training_stop = True
            self.last = now

    return Timer()


def ours_window(model: Any, samples: Sequence[TokenizedSample], s: BenchSettings, optimizer: Any, *,
                max_vram_gb: float, min_tokens: int, warmup: int | None = None) -> dict[str, Any]:
    """Ours: probe memory, choose the token budget under `max_vram_gb`, then the timed window of packed
    steps over the rest of `samples` (probe steps count as warm-up). Cycles the samples if needed."""
    import torch

    from jobs.training.packing import packed_batches
    from jobs.training.probe import ProbeSettings, probe_memory
    from jobs.training.step import train_step

    win = Window(warmup=(s.warmup if warmup is None else warmup) + 3, max_steps=s.max_steps, seconds=s.seconds)
    torch.cuda.reset_peak_memory_stats()
    settings = ProbeSettings(max_vram_gb=max_vram_gb, min_tokens=min_tokens, max_tokens=s.max_budget,
                             probe_tokens=s.probe_tokens, headroom_gb=s.headroom_gb)
    probe = probe_memory(model, samples, settings, optimizer,
                         on_step=lambda st, b: win.step_done(st.seconds, st.tokens, len(b.sample_ids)))
    if probe.tokens_per_step is None:
        return {"error": f"not even {min_tokens} tokens per step fit under {max_vram_gb:g} GB",
                "probes": probe.probes, "memory_model": probe.memory.model_dump(), **peak_gb()}
    budget = s.budget or probe.tokens_per_step
    torch.cuda.reset_peak_memory_stats()
    done = False
    rounds = 0
    while not done and rounds < 50:
        rounds += 1
        for b in packed_batches(samples, tokens_per_step=budget):
            st = train_step(model, b, optimizer)
            if win.step_done(st.seconds, st.tokens, len(b.sample_ids)):
                done = True
                break
    mem = probe.memory
    return {"batch": f"packed {budget} tok", **win.result(samples), **peak_gb(), "token_budget": budget,
            "predicted_peak_gb": round(mem.peak_gb(budget), 2), "probes": probe.probes,
            "memory_model": {"static_gb": round(mem.static_gb, 2), "mb_per_token": round(mem.mb_per_token, 3)}}


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def write(job: Job, *, workload: str, side: str, label: str, arch: str, flops: int, **row: Any) -> dict[str, Any]:
    full = {"workload": workload, "side": side, "stack": f"{workload}:{side}", "label": label, "arch": arch,
            "flops_per_token_param": flops, **row}
    append_row(job.rows, full)
    return full


def error_row(e: BaseException) -> dict[str, Any]:
    """A peer stack's failure (out of memory under the cap, an API change) is a result, not a crash."""
    import torch

    row = {"error": f"{type(e).__name__}: {e}"[:400], **peak_gb()}
    torch.cuda.empty_cache()
    return row


def sft_window(model: Any, tok: Any, samples: Sequence[TokenizedSample], win: Window, *, batch: int, seed: int,
               peft_config: Any = None, **config: Any) -> dict[str, Any]:
    """TRL's SFTTrainer (with Unsloth's patches where Unsloth is imported, as the publications ran it) over
    pre-tokenised samples until `win` is complete; `peft_config`: the trainer puts the LoRA on (trl_liger);
    returns what the trainer really used (padding_free, optim)."""
    import tempfile

    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    counts: list[tuple[int, int]] = []
    base = dict(
        output_dir=tempfile.mkdtemp(prefix="trl-"), per_device_train_batch_size=batch, gradient_accumulation_steps=1,
        max_steps=win.warmup + win.max_steps + 2, learning_rate=2e-4, lr_scheduler_type="constant", warmup_steps=0,
        logging_steps=10**6, save_strategy="no", report_to="none", bf16=True, seed=seed, dataloader_num_workers=0,
        dataset_num_proc=1, completion_only_loss=False, gradient_checkpointing=False)
    cfg = SFTConfig(**{**base, **config})  # `config` overrides (bf16, optim, max_length, packing, ...)
    trainer = SFTTrainer(model=model, args=cfg, train_dataset=Dataset.from_dict(
        {"input_ids": [x.input_ids for x in samples]}), processing_class=tok, peft_config=peft_config)
    inner = trainer.data_collator

    def counting(features: Any) -> Any:
        b = inner(features)
        ids = b["input_ids"]
        toks = int(b["attention_mask"].sum()) if "attention_mask" in b else int(ids.numel())
        n = int((b["position_ids"] == 0).sum()) if "position_ids" in b else int(ids.shape[0])
        counts.append((toks, n))
        return b

    trainer.data_collator = counting
    trainer.add_callback(trainer_timer(win, counts))
    trainer.train()
    return {"padding_free": getattr(trainer.args, "padding_free", None), "packing": getattr(trainer.args, "packing",
            None), "optim": str(trainer.args.optim), "max_length": getattr(trainer.args, "max_length", None)}


def frozen_base_compute(label: str, model: Any, tok: Any, s: BenchSettings, job: Job, info: dict[str, Any]) -> str:
    """`--compute fp8` (issue 16): ours' frozen base on FP8 tensor cores, through the bench's own setup and
    its numerics check (a numerics row, each projection's errors beside the rows); `info["compute"]` and the
    label say what ran. bf16: the label as it is."""
    info["compute"] = "bf16"
    if s.ours_compute == "bf16":
        return label
    from benchmarks.stacks.ours import fp8_label, setup_fp8

    fp8 = setup_fp8(model, tok, s, job)
    info["fp8"], info["compute"] = fp8, fp8["compute"]
    return fp8_label(label, s, fp8["compute"])
