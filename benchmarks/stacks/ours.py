"""ours: nightshift's path — packed rows to a token budget chosen from measured memory under
max_vram_gb, varlen attention (no cross-sample attention), checkpointing off unless --ours-ckpt.

The budget comes from calibration's probe (jobs.training.probe): its probe steps count as the
window's first warm-up steps, then timed packed steps at the budget.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.measure import Window, append_row, peak_gb
from benchmarks.model import vocab_size
from benchmarks.settings import FP8_VARIANTS, BenchSettings
from benchmarks.stacks.common import Job, load_ours
from jobs.contract import GpuEvent
from jobs.training.models.synthetic import CAP, make_samples

LABEL = "nightshift (packed, varlen, budgeted)"
LORA_LABEL = "nightshift, method lora: bf16 base (packed, varlen, budgeted)"


def run(s: BenchSettings, job: Job) -> None:
    """`ours` trains qlora (the default method); the `ours_lora` stack the same path on a bf16 base."""
    import torch

    from jobs.training.fp8.matmul import STATS

    gc = "unsloth" if s.ours_ckpt else False
    lora = job.stack == "ours_lora"
    model, tok, info = load_ours(s, job.model, gc=gc, cache=s.state_dir is not None, max_seq=s.max_budget,
                                 method="lora" if lora else "qlora")
    fp8 = setup_fp8(model, tok, s, job) if s.ours_compute != "bf16" else None
    compute = "bf16" if fp8 is None else fp8["compute"]
    base = LORA_LABEL if lora else LABEL
    label = base if fp8 is None else fp8_label(base, s, compute)
    events: list[GpuEvent] = []
    pool, tokens = token_pool(tok, s)
    for prof in s.profiles:
        row = run_ours(model, s, prof, vocab_size(job.model), label=label, pool=pool,
                       on_gpu_event=events.append if s.gpu_events else None)
        row["stack"] = job.stack
        first = row.pop("first_step_end", None)
        row.update(
            load_seconds=info["load_seconds"],
            load=info,
            first_step_s=round(first - job.t_launch, 1) if first and prof == s.profiles[0] else None,
            compute=compute,
            variant=s.ours_compute,
            tokens=tokens,
        )
        if fp8 is not None:
            row["fp8"] = {**fp8, "stats": STATS.as_dict()}
        append_row(job.rows, row)
        if s.torch_profile and row.get("token_budget"):
            tag = "" if s.ours_compute == "bf16" else f".{s.ours_compute}"
            profile_steps(model, s, job.model, prof, row["token_budget"], Path(f"{s.torch_profile}{tag}.{prof}.txt"))
        torch.cuda.empty_cache()
    if s.gpu_events and events:
        with open(s.gpu_events, "w") as f:
            for e in events:
                f.write(json.dumps(e.model_dump(mode="json")) + "\n")


def fp8_label(label: str, s: BenchSettings, compute: str) -> str:
    """A row's label with what `--compute` set up: its FP8 variant, or that the check refused it."""
    return label + (FP8_VARIANTS[s.ours_compute].label if compute == "fp8" else ", FP8 refused: bf16")


def setup_fp8(model: Any, tok: Any, s: BenchSettings, job: Job) -> dict[str, Any]:
    """The frozen base to FP8 with the numerics check (issue 16): a "numerics" row (JSON, and the table
    under the main one), every projection's errors in fp8-layers-<variant>.json; returns the outcome."""
    from jobs.training.fp8.enable import CAPTURE_TOKENS, Learnable, enable_fp8
    from jobs.training.fp8.sample_data import data_files, sample_tokens

    ids, source = sample_tokens(tok, data_files(None, []), n=CAPTURE_TOKENS)
    variant = FP8_VARIANTS[s.ours_compute]
    out = enable_fp8(model, device="cuda", tokens=ids, activations=source, unsloth=True,
                     keep_transposed=variant.keep_transposed, storage=variant.storage, source_dir=job.model,
                     learnable=Learnable(steps=s.fp8_learnable_steps) if s.fp8_learnable_steps else None,
                     vocab=vocab_size(job.model))
    info = out.info()
    (job.rows.parent / f"fp8-layers-{s.ours_compute}.json").write_text(
        json.dumps([x.model_dump(mode="json") for x in out.layers], indent=0))
    row = {"stack": "numerics", "compute": s.ours_compute, "outcome": info,
           **(out.numerics.model_dump(mode="json") if out.numerics is not None else {"passed": False,
                                                                                    "reasons": [str(out.error)]})}
    append_row(job.rows, row)
    return info


TOKEN_FILE_TOKENS = 65536  # tokens of `--token-file` the samples are cut from (runs of it, wrapping)


def token_pool(tok: Any, s: BenchSettings) -> tuple[list[int] | None, str]:
    """`--token-file`: the tokens the samples are cut from, and where they came from (a file the model's
    tokenizer does not cover is refused: random ids under its name would mislead)."""
    from jobs.training.fp8.sample_data import RANDOM, sample_tokens

    if s.token_file is None:
        return None, "random token ids"
    ids, where = sample_tokens(tok, [s.token_file], n=TOKEN_FILE_TOKENS)
    if where == RANDOM:
        raise ValueError(f"--token-file {s.token_file}: no records the model's tokenizer covers")
    return ids, where


def run_ours(
    model: Any,
    s: BenchSettings,
    prof: str,
    vocab: int,
    *,
    label: str,
    pool: list[int] | None = None,
    on_gpu_event: Callable[[GpuEvent], None] | None = None,
) -> dict[str, Any]:
    """Probe memory, choose the budget, then the timed window of packed steps: one result row."""
    import torch

    from jobs.training.packing import packed_batches
    from jobs.training.probe import ProbeSettings, probe_memory
    from jobs.training.step import make_optimizer, train_step

    opt = make_optimizer(model)
    samples = make_samples(prof, s.data_tokens * 3, vocab=vocab, seed=s.seed, prompt_share=s.prompt_share, pool=pool)
    win = Window(warmup=s.warmup + 3, max_steps=s.max_steps, seconds=s.seconds, on_gpu_event=on_gpu_event)
    torch.cuda.reset_peak_memory_stats()
    settings = ProbeSettings(max_vram_gb=s.max_vram_gb, min_tokens=CAP, max_tokens=s.max_budget,
                             probe_tokens=s.probe_tokens, headroom_gb=s.headroom_gb)
    probe = probe_memory(model, samples, settings, opt,
                         on_step=lambda st, b: win.step_done(st.seconds, st.tokens, len(b.sample_ids)))
    if probe.tokens_per_step is None:
        return {"error": f"not even {CAP} tokens/step fit under {s.max_vram_gb} GB", "probes": probe.probes}
    budget = s.budget or probe.tokens_per_step
    torch.cuda.reset_peak_memory_stats()
    used = sum(p["tokens"] for p in probe.probes)
    rest, acc = [], 0
    for x in samples:  # the samples after those the probe steps consumed
        acc += x.n_tokens
        if acc > used:
            rest.append(x)
    t_loop = time.perf_counter()
    for b in packed_batches(rest, tokens_per_step=budget):
        st = train_step(model, b, opt)
        if win.step_done(st.seconds, st.tokens, len(b.sample_ids)):
            break
    loop_s = time.perf_counter() - t_loop
    mem = probe.memory
    return {
        "stack": "ours",
        "label": label,
        "profile": prof,
        "prompt_share": s.prompt_share,
        "batch": f"packed {budget} tok",
        "grad_ckpt": "unsloth" if s.ours_ckpt else "off",
        **win.result(samples),
        **peak_gb(),
        "token_budget": budget,
        "predicted_peak_gb": round(mem.peak_gb(budget), 2),
        "memory_model": {"static_gb": round(mem.static_gb, 2), "mb_per_token": round(mem.mb_per_token, 3)},
        "probes": probe.probes,
        "loop_seconds": round(loop_s, 2),
        "max_vram_gb": s.max_vram_gb,
        "first_step_end": win.first_step_end,
    }


def profile_steps(model: Any, s: BenchSettings, model_path: Path, prof: str, budget: int, path: Path) -> None:
    """Where the time goes: 3 steps of the budget under torch.profiler (benchmarks.profiling)."""
    from benchmarks import profiling
    from jobs.training.packing import packed_batches
    from jobs.training.step import make_optimizer

    samples = make_samples(prof, budget * 5, vocab=vocab_size(model_path), seed=s.seed + 1)
    batches = list(packed_batches(samples, tokens_per_step=budget))[:4]
    profiling.profile_steps(model, batches, make_optimizer(model), path=path,
                            title=f"profile {prof}, <= {budget} tokens", top=40)
