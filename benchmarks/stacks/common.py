"""What the workers share: the job a worker is given, our loader, the padded-batch loop."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.measure import Window
from benchmarks.settings import BenchSettings
from jobs.data.batching import TokenizedSample, padded_batches


@dataclass(frozen=True)
class Job:
    """One worker's task: a stack, on a model directory, its rows appended to a JSON-lines file."""

    stack: str
    model: Path
    rows: Path
    t_launch: float = 0.0  # time.time() when the parent launched the worker: first steps count from here


def load_ours(
    s: BenchSettings, model_path: Path, *, gc: bool | str, cache: bool, max_seq: int, varlen: bool = True,
    method: str = "qlora",
) -> tuple[Any, Any, dict[str, Any]]:
    """(model, tokenizer, info) through our Unsloth loader; varlen=False for the peer stacks (as shipped);
    method "lora": the base in bf16 (`[train] method = "lora"`)."""
    from jobs.training.backends.unsloth import LoraSpec, load_unsloth

    return load_unsloth(
        model_path,
        lora=LoraSpec(r=s.lora_r, alpha=s.lora_r),
        max_seq_length=max_seq,
        gradient_checkpointing=gc,
        cache_dir=s.state_dir if cache else None,
        cache_base=cache,
        varlen=varlen,
        method=method,
    )


def padded_rows(model: Any, samples: list[TokenizedSample], win: Window, *, pad_id: int, batch_size: int) -> None:
    """Padded batches of `batch_size` samples through our train step until the window is complete."""
    from jobs.training.step import make_optimizer, train_step

    opt = make_optimizer(model)
    for b in padded_batches(samples, batch_size=batch_size, max_tokens_per_batch=10**9, pad_id=pad_id):
        st = train_step(model, b, opt, max_grad_norm=1.0)
        if win.step_done(st.seconds, st.tokens, len(b.sample_ids)):
            break
