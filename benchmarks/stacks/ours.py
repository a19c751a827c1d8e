"""ours: nightshift's path — packed rows to a token budget chosen from measured memory under
max_vram_gb, varlen attention (no cross-sample attention), checkpointing off unless --ours-ckpt.

Measured as `nightshift calibrate` measures it, through the same functions (jobs.training.probe:
probe_memory on probe_samples, then time_profiles): one step shape for every profile, the first
window after 30 s of steps, one-off stalls left out of the rate. The bench only watches (energy,
peaks, thirds); `wall_tok_s` keeps the window's plain wall-clock rate beside it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.measure import Window, append_row, peak_gb
from benchmarks.model import vocab_size
from benchmarks.settings import FP8_VARIANTS, BenchSettings
from benchmarks.stacks.common import Job, load_ours
from jobs.contract import GpuEvent
from jobs.training.models.synthetic import CAP, make_samples
from jobs.training.probe import ProbeSettings

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
    rows = run_ours(model, s, s.profiles, vocab_size(job.model), label=label, pool=pool,
                    on_gpu_event=events.append if s.gpu_events else None)
    for prof, row in zip(s.profiles, rows, strict=True):
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


def probe_settings(s: BenchSettings) -> ProbeSettings:
    """The probe's settings from the bench's flags, field for field calibrate's from the night's config
    (`[gpu] max_vram_gb`, `headroom_gb`, `[train] max_seq_length`): tests/benchmarks/test_bench_calibrate.py."""
    return ProbeSettings(max_vram_gb=s.max_vram_gb, min_tokens=CAP, max_tokens=s.max_budget,
                         probe_tokens=s.probe_tokens, headroom_gb=s.headroom_gb)


class _ProfileWindow(Window):
    """The bench's watch on one of calibrate's windows: NVML energy over exactly it, its thirds, and the peak
    memory of the steps up to its end."""

    def end(self) -> None:
        super().end()
        self.peaks = peak_gb()


def run_ours(
    model: Any,
    s: BenchSettings,
    profiles: Sequence[str],
    vocab: int,
    *,
    label: str,
    pool: list[int] | None = None,
    on_gpu_event: Callable[[GpuEvent], None] | None = None,
    first: bool = True,
) -> list[dict[str, Any]]:
    """What `nightshift calibrate` measures, through its own functions (jobs.training.probe): one probe on the
    long profile's rows, one step shape under `--max-vram-gb`, then time_profiles' windows (the first after
    PROCESS_WARMUP_SECONDS of steps unless `first` is False, stalls left out of the rate, `--seconds` each);
    the bench adds energy, peaks and thirds. One row per profile. `--warmup` and `--max-steps` are the
    peers' window; ours is calibrate's (issue 44: the two read 18,620 and 22,567 tok/s on one H200)."""
    import torch

    from jobs.training.probe import (
        PROCESS_WARMUP_SECONDS,
        PROFILE_SEED,
        probe_memory,
        probe_samples,
        profile_samples,
        time_profiles,
    )
    from jobs.training.step import make_optimizer

    opt = make_optimizer(model)
    settings = probe_settings(s)
    torch.cuda.reset_peak_memory_stats()
    first_end: list[float] = []
    probe = probe_memory(model, probe_samples(settings, vocab=vocab, cap=CAP), settings, opt,
                         on_step=lambda *_: first_end.append(time.time()))
    if probe.tokens_per_step is None:
        return [{"stack": "ours", "label": label, "profile": p, "probes": probe.probes,
                 "error": f"not even {CAP} tokens/step fit under {s.max_vram_gb} GB"} for p in profiles]
    budget = s.budget or probe.tokens_per_step
    wins: dict[str, _ProfileWindow] = {}

    def before(i: int, p: str, _rates: Any) -> None:
        torch.cuda.reset_peak_memory_stats()

    def window(p: str) -> _ProfileWindow:
        wins[p] = _ProfileWindow(warmup=0, max_steps=1 << 30, seconds=float("inf"), on_gpu_event=on_gpu_event)
        return wins[p]

    data = {"seed": PROFILE_SEED + s.seed, "prompt_share": s.prompt_share, "pool": pool}
    t_loop = time.perf_counter()
    rates = time_profiles(model, opt, budget, profiles, vocab=vocab, cap=CAP, seconds=s.seconds, before=before,
                          window=window, first_warmup_seconds=PROCESS_WARMUP_SECONDS if first else 0.0, **data)
    loop_s = time.perf_counter() - t_loop
    mem = probe.memory
    rows = []
    for p in profiles:
        r, w = rates[p], wins[p]
        samples = profile_samples(p, budget, vocab=vocab, cap=CAP, **data)
        watched = w.result(samples)  # wall clock, stalls included
        mean = sum(x.n_tokens for x in samples) / len(samples)
        rows.append({
            "stack": "ours",
            "label": label,
            "profile": p,
            "prompt_share": s.prompt_share,
            "batch": f"packed {budget} tok",
            "grad_ckpt": "unsloth" if s.ours_ckpt else "off",
            **watched,
            "real_tok_s": r.tokens_per_second,  # calibrate's figure: the window less its one-off stalls
            "samples_per_hour": r.tokens_per_second * 3600 / mean,
            "wall_tok_s": watched["real_tok_s"],
            "stalls": r.stalls,
            "stall_seconds": r.stall_seconds,
            "method": "calibrate (jobs.training.probe.time_profiles)",
            **getattr(w, "peaks", {}),
            "token_budget": budget,
            "predicted_peak_gb": round(mem.peak_gb(budget), 2),
            "memory_model": {"static_gb": round(mem.static_gb, 2), "mb_per_token": round(mem.mb_per_token, 3)},
            "probes": probe.probes,
            "loop_seconds": round(loop_s, 2),
            "max_vram_gb": s.max_vram_gb,
            "first_step_end": first_end[0] if first_end else None,
        })
    return rows


def profile_steps(model: Any, s: BenchSettings, model_path: Path, prof: str, budget: int, path: Path) -> None:
    """Where the time goes: 3 steps of the budget under torch.profiler (benchmarks.profiling)."""
    from benchmarks import profiling
    from jobs.training.packing import packed_batches
    from jobs.training.step import make_optimizer

    samples = make_samples(prof, budget * 5, vocab=vocab_size(model_path), seed=s.seed + 1)
    batches = list(packed_batches(samples, tokens_per_step=budget))[:4]
    profiling.profile_steps(model, batches, make_optimizer(model), path=path,
                            title=f"profile {prof}, <= {budget} tokens", top=40)
