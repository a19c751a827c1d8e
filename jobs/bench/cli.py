"""`nightshift bench` / `nightshift calibrate`: QLoRA throughput measured side by side, on this GPU.

    python -m jobs.bench.cli bench --arch llama3.1-8b --out results/      (all stacks, both profiles)
    python -m jobs.bench.cli calibrate --model /path/to/model              (our path only: tok/s)
    python -m jobs.bench.cli faststart --arch llama3.1-8b --state-dir S    (time to first step, night 1 / night 2)
    python -m jobs.bench.cli budget --arch llama3.1-8b                     (plan from calibration, then train)
    python -m jobs.bench.cli moe --arch gpt-oss-small                      (LoRA reaches the experts?)

Stacks (each in its own child process: Unsloth patches transformers at import, and a fresh
process frees every byte of VRAM between stacks):
  baseline   HF transformers + PEFT + bitsandbytes NF4, gradient checkpointing on, batch 4 padded
  unsloth    Unsloth defaults (its offloaded checkpointing), batch 4 padded
  trl        Unsloth + TRL SFTTrainer: padding_free with a large batch, and packing=True
  ours       nightshift: packed rows to a token budget chosen from measured memory under
             max_vram_gb, varlen attention (no cross-sample attention), checkpointing off when it fits

Data: random token ids, lengths log-normal with mean 117 ("alpaca") or 861 ("wiki"), capped at
2048. Each row: warm-up steps, then timed steps (up to --max-steps or --seconds). real tok/s
counts non-padding tokens. MFU = real tok/s x 4 x matmul params / --peak-flops.
Power and energy: NVML (jobs.gpu.GpuSampler) over the timed window.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from jobs.data.batching import TokenizedSample, padded_batches

PROFILES = {"alpaca": 117.0, "wiki": 861.0}  # mean tokens per sample
CAP = 2048
PEAK_BF16 = 790e12  # dense bf16 FLOP/s measured on these H100/H200 machines (ANCHORS.md)
STACKS = ("ours", "baseline", "unsloth", "trl")


# ---- data ---------------------------------------------------------------------------------------


def sample_lengths(profile: str, n: int, *, seed: int = 0, sigma: float = 0.8, cap: int = CAP) -> list[int]:
    """Log-normal lengths (at least 8 tokens, at most `cap`) whose mean after the cap is the profile's."""
    mean = PROFILES[profile]
    rng = random.Random(f"{profile}-{seed}")
    z = [rng.gauss(0.0, 1.0) for _ in range(n)]

    def draw(mu: float) -> list[int]:
        return [max(8, min(cap, round(math.exp(mu + sigma * x)))) for x in z]

    lo, hi = math.log(mean) - 3.0, math.log(mean) + 3.0
    for _ in range(40):  # the capped mean grows with mu: bisect
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(draw(mid)) / n < mean else (lo, mid)
    return draw((lo + hi) / 2)


def make_samples(profile: str, n_tokens: int, *, vocab: int, seed: int = 0) -> list[TokenizedSample]:
    """Enough random-token samples for about `n_tokens` real tokens."""
    rng = random.Random(seed)
    out: list[TokenizedSample] = []
    total, i = 0, 0
    lengths = sample_lengths(profile, max(64, int(3 * n_tokens / PROFILES[profile])), seed=seed)
    while total < n_tokens:
        n = lengths[i % len(lengths)]
        ids = [rng.randrange(16, vocab - 16) for _ in range(n)]
        out.append(TokenizedSample(i, ids, list(ids)))
        total += n
        i += 1
    return out


# ---- measuring ----------------------------------------------------------------------------------


class Window:
    """Timed window: steps after warm-up until max_steps or seconds; NVML energy over exactly it."""

    def __init__(
        self,
        *,
        warmup: int,
        max_steps: int,
        seconds: float,
        hz: float = 10.0,
        on_gpu_event: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.warmup, self.max_steps, self.seconds, self.hz = warmup, max_steps, seconds, hz
        self.on_gpu_event = on_gpu_event
        self.steps = 0
        self.timed: list[tuple[float, int, int]] = []  # (seconds, real tokens, samples)
        self.t_start: float | None = None
        self.sampler: Any = None
        self.gpu: dict[str, Any] | None = None
        self.first_step_end: float | None = None
        self.t_end: float | None = None

    def step_done(self, seconds: float, tokens: int, samples: int) -> bool:
        """Record one step; True when the window is complete."""
        import torch

        self.steps += 1
        if self.first_step_end is None:
            self.first_step_end = time.time()
        if self.steps == self.warmup:
            self._begin(torch)
            return False
        if self.steps > self.warmup:
            self.timed.append((seconds, tokens, samples))
            done = len(self.timed) >= self.max_steps or time.perf_counter() - (self.t_start or 0) >= self.seconds
            if done:
                self._end()
            return done
        return False

    def _begin(self, torch: Any) -> None:
        from jobs.gpu import GpuSampler

        torch.cuda.synchronize()
        self.sampler = GpuSampler(self.on_gpu_event, hz=self.hz)
        if not self.sampler.start():
            self.sampler = None
        self.t_start = time.perf_counter()

    def _end(self) -> None:
        if self.t_end is None:
            self.t_end = time.perf_counter()
        if self.sampler is not None:
            self.gpu = dict(self.sampler.stop() or {})
            self.sampler = None

    def result(self) -> dict[str, Any]:
        if self.sampler is not None:
            self._end()
        step_secs = sum(t for t, _, _ in self.timed)
        secs = (self.t_end - self.t_start) if self.t_end and self.t_start else step_secs  # wall clock
        toks = sum(n for _, n, _ in self.timed)
        samples = sum(s for _, _, s in self.timed)
        r: dict[str, Any] = {
            "timed_steps": len(self.timed),
            "timed_seconds": round(secs, 3),
            "step_seconds_sum": round(step_secs, 3),
            "real_tokens": toks,
            "samples": samples,
            "tokens_per_step": round(toks / max(1, len(self.timed)), 1),
        }
        r["real_tok_s"] = toks / secs if secs else None
        r["samples_per_hour"] = samples / secs * 3600 if secs else None
        g = self.gpu or {}
        r["energy_joules"] = g.get("energy_joules")
        r["mean_power_w"] = g.get("mean_power_watts")
        r["j_per_1k_tok"] = (g["energy_joules"] / toks * 1000) if g.get("energy_joules") and toks else None
        r["gpu_name"] = g.get("name")
        return r


def _peak_gb() -> dict[str, float]:
    import torch

    return {
        "peak_allocated_gb": round(torch.cuda.max_memory_allocated() / 1e9, 2),
        "peak_reserved_gb": round(torch.cuda.max_memory_reserved() / 1e9, 2),
    }


def _append(path: Path, row: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row, default=str) + "\n")
    print("ROW", json.dumps(row, default=str), flush=True)


def _vocab(model_path: Path) -> int:
    cfg = json.loads((model_path / "config.json").read_text())
    return int(cfg.get("vocab_size") or cfg.get("text_config", {}).get("vocab_size"))


# ---- workers (one stack per process) ------------------------------------------------------------


def _padded_rows(model: Any, samples: list[TokenizedSample], win: Window, pad_id: int, batch_size: int) -> None:
    from jobs.training.step import make_optimizer, train_step

    opt = make_optimizer(model)
    for b in padded_batches(samples, batch_size=batch_size, max_tokens_per_batch=10**9, pad_id=pad_id):
        st = train_step(model, b, opt, max_grad_norm=1.0)
        if win.step_done(st.seconds, st.tokens, len(b.sample_ids)):
            break


def worker_baseline(a: argparse.Namespace, model_path: Path, out: Path) -> None:
    """HF transformers + PEFT + bitsandbytes QLoRA, the way the PEFT docs do it."""
    import torch
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM

    from jobs.training.architectures import bnb_config

    t0 = time.time()
    kw: dict[str, Any] = {
        "dtype": torch.bfloat16,
        "device_map": {"": 0},
        "local_files_only": True,
        "attn_implementation": "sdpa",
    }
    if not json.loads((model_path / "config.json").read_text()).get("quantization_config"):
        kw["quantization_config"] = bnb_config()
    model = AutoModelForCausalLM.from_pretrained(str(model_path), **kw)
    model = prepare_model_for_kbit_training(
        model, use_gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False}
    )
    model = get_peft_model(
        model,
        LoraConfig(
            r=a.lora_r,
            lora_alpha=a.lora_r,
            lora_dropout=0.0,
            task_type="CAUSAL_LM",
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        ),
    )
    model.config.use_cache = False
    load_s = time.time() - t0
    for prof in a.profiles:
        samples = make_samples(prof, a.data_tokens, vocab=_vocab(model_path), seed=a.seed)
        torch.cuda.reset_peak_memory_stats()
        win = Window(warmup=a.warmup, max_steps=a.max_steps, seconds=a.seconds)
        _padded_rows(model, samples, win, pad_id=0, batch_size=4)
        _append(
            out,
            {
                "stack": "baseline",
                "label": "HF transformers + PEFT + bitsandbytes",
                "profile": prof,
                "batch": "4 padded",
                "grad_ckpt": "on",
                **win.result(),
                **_peak_gb(),
                "load_seconds": round(load_s, 1),
                "first_step_s": _first(win, a.t_launch),
            },
        )


def _first(win: Window, t_launch: float) -> float | None:
    return round(win.first_step_end - t_launch, 1) if win.first_step_end else None


def _load_ours(
    a: argparse.Namespace, model_path: Path, *, gc: bool | str, cache: bool, max_seq: int, varlen: bool = True
) -> tuple[Any, Any, dict[str, Any]]:
    """varlen=False for the peer stacks: Unsloth exactly as shipped."""
    from jobs.training.unsloth_backend import LoraSpec, load_unsloth

    return load_unsloth(
        model_path,
        lora=LoraSpec(r=a.lora_r, alpha=a.lora_r),
        max_seq_length=max_seq,
        gradient_checkpointing=gc,
        cache_dir=a.state_dir if cache else None,
        cache_base=cache,
        varlen=varlen,
    )


def worker_unsloth(a: argparse.Namespace, model_path: Path, out: Path) -> None:
    """Unsloth's defaults: its offloaded gradient checkpointing, batch 4 padded."""
    import torch

    model, tok, info = _load_ours(a, model_path, gc="unsloth", cache=False, max_seq=CAP, varlen=False)
    for prof in a.profiles:
        samples = make_samples(prof, a.data_tokens, vocab=_vocab(model_path), seed=a.seed)
        torch.cuda.reset_peak_memory_stats()
        win = Window(warmup=a.warmup, max_steps=a.max_steps, seconds=a.seconds)
        _padded_rows(model, samples, win, pad_id=tok.pad_token_id or 0, batch_size=4)
        _append(
            out,
            {
                "stack": "unsloth",
                "label": "Unsloth defaults",
                "profile": prof,
                "batch": "4 padded",
                "grad_ckpt": "unsloth",
                **win.result(),
                **_peak_gb(),
                "load_seconds": info["load_seconds"],
                "first_step_s": _first(win, a.t_launch),
                "trainable_parameters": info["trainable_parameters"],
            },
        )


def worker_trl(a: argparse.Namespace, model_path: Path, out: Path) -> None:
    """Unsloth + TRL SFTTrainer at its best: padding_free with a large batch, and packing=True."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import SFTConfig, SFTTrainer

    big = torch.cuda.get_device_properties(0).total_memory > 100e9
    configs = [  # (name, kwargs, batch per profile, grad ckpt)
        ("padding_free", {"padding_free": True, "max_length": CAP}, {"alpaca": 32, "wiki": 16}, "unsloth"),
        (
            "packing",
            {"packing": True, "max_length": a.trl_pack_length},
            {"alpaca": 4 if big else 2, "wiki": 4 if big else 2},
            False,
        ),
    ]
    model = None
    for name, kw, batches, gc in configs:
        if name not in a.trl_configs:
            continue
        # checkpointing is chosen at load: for_training(use_gradient_checkpointing=False) on a model
        # loaded with "unsloth" kept the offloaded checkpointing (seen: 10 GB for 16k tokens/step)
        del model
        torch.cuda.empty_cache()
        model, tok, info = _load_ours(a, model_path, gc=gc, cache=False, max_seq=a.trl_pack_length, varlen=False)
        for prof in a.profiles:
            samples = make_samples(prof, a.data_tokens * 2, vocab=_vocab(model_path), seed=a.seed)
            ds = Dataset.from_dict({"input_ids": [s.input_ids for s in samples]})
            bs = batches[prof]
            win = Window(warmup=a.warmup, max_steps=a.max_steps, seconds=a.seconds)
            counts: list[tuple[int, int]] = []

            class Timer(TrainerCallback):
                def __init__(self, win: Window, counts: list[tuple[int, int]]) -> None:
                    self.win, self.counts, self.last = win, counts, 0.0

                def on_train_begin(self, args, state, control, **k):
                    torch.cuda.synchronize()
                    self.last = time.perf_counter()

                def on_step_end(self, args, state, control, **k):
                    torch.cuda.synchronize()
                    now = time.perf_counter()
                    i = state.global_step - 1
                    toks, n = self.counts[i] if i < len(self.counts) else (0, 0)
                    if self.win.step_done(now - self.last, toks, n):
                        control.should_training_stop = True
                    self.last = now

            cfg = SFTConfig(
                output_dir=tempfile.mkdtemp(prefix="trl-"),
                per_device_train_batch_size=bs,
                gradient_accumulation_steps=1,
                max_steps=a.warmup + a.max_steps + 2,
                learning_rate=2e-4,
                lr_scheduler_type="constant",
                warmup_steps=0,
                logging_steps=10**6,
                save_strategy="no",
                report_to="none",
                bf16=True,
                optim="adamw_torch_fused",
                seed=a.seed,
                dataloader_num_workers=0,
                dataset_num_proc=1,
                completion_only_loss=False,
                gradient_checkpointing=False,
                **kw,
            )
            try:
                torch.cuda.reset_peak_memory_stats()
                trainer = SFTTrainer(model=model, args=cfg, train_dataset=ds, processing_class=tok)
                inner = trainer.data_collator

                def counting(features, _inner=inner, counts=counts):
                    b = _inner(features)
                    ids = b["input_ids"]
                    toks = int(b["attention_mask"].sum()) if "attention_mask" in b else int(ids.numel())
                    n = int((b["position_ids"] == 0).sum()) if "position_ids" in b else int(ids.shape[0])
                    counts.append((toks, n))
                    return b

                trainer.data_collator = counting
                trainer.add_callback(Timer(win, counts))
                trainer.train()
                row = {**win.result(), **_peak_gb()}
            except Exception as e:  # an OOM or API change in a peer stack is a result, not a crash
                row = {"error": f"{type(e).__name__}: {e}"[:400], **_peak_gb()}
                torch.cuda.empty_cache()
            _append(
                out,
                {
                    "stack": "trl",
                    "label": f"Unsloth + TRL, {name}",
                    "profile": prof,
                    "batch": f"{bs}" + (f" x {kw['max_length']}" if name == "packing" else ""),
                    "grad_ckpt": gc or "off",
                    **row,
                    "load_seconds": info["load_seconds"],
                    "first_step_s": _first(win, a.t_launch),
                },
            )


def probe_and_plan(
    model: Any, samples: list[TokenizedSample], a: argparse.Namespace, opt: Any, win: Window | None = None
) -> tuple[Any, list[dict[str, Any]]]:
    """Probe steps -> memory line -> token budget under max_vram_gb.

    A warm-up step (compiles, autotunes: not a memory sample), then `probe_tokens`, then up to twice
    that, but never more than the first probe's line says fits: probing must respect the limit too.
    """
    import torch

    from jobs.training.packing import (
        MemoryProbe,
        choose_token_budget,
        conservative_memory_model,
        packed_batches,
        second_probe_tokens,
    )
    from jobs.training.step import train_step

    probes: list[MemoryProbe] = []
    seen: list[dict[str, Any]] = []
    it = iter(samples)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    static = float(torch.cuda.memory_reserved())
    for k, want in enumerate((a.probe_tokens // 2, a.probe_tokens, 2 * a.probe_tokens)):
        size = want
        if k == 2:
            size = second_probe_tokens(
                probes[0], static_bytes=static, max_vram_gb=a.max_vram_gb, want=want, headroom_gb=a.headroom_gb
            )
            if size < 1.25 * probes[0].tokens:
                break  # no room for a second size: one probe + static memory
        group: list[TokenizedSample] = []
        n = 0
        for scanned, s in enumerate(it, 1):  # fill to ~size without going over (skip what does not fit)
            if n + s.n_tokens <= size or not group:
                group.append(s)
                n += s.n_tokens
            if n >= 0.9 * size or scanned >= 500:
                break
        b = next(packed_batches(group, tokens_per_step=10**9))
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        st = train_step(model, b, opt)
        peak = torch.cuda.max_memory_reserved()
        if k:
            probes.append(MemoryProbe(b.real_tokens, float(peak)))
        seen.append(
            {"tokens": b.real_tokens, "peak_reserved_gb": round(peak / 1e9, 2), "seconds": round(st.seconds, 3)}
        )
        if win is not None:
            win.step_done(st.seconds, st.tokens, len(b.sample_ids))
    mm = conservative_memory_model(probes, static_bytes=static, at_tokens=2 * a.probe_tokens)
    budget = choose_token_budget(
        mm, max_vram_gb=a.max_vram_gb, min_tokens=CAP, max_tokens=a.max_budget, headroom_gb=a.headroom_gb
    )
    torch.cuda.empty_cache()  # the budgeted steps' peak is measured from here
    return (mm, budget), seen


def run_ours(
    model: Any,
    a: argparse.Namespace,
    prof: str,
    vocab: int,
    *,
    label: str,
    on_gpu_event: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    import torch

    from jobs.training.packing import packed_batches
    from jobs.training.step import make_optimizer, train_step

    opt = make_optimizer(model)
    samples = make_samples(prof, a.data_tokens * 3, vocab=vocab, seed=a.seed)
    win = Window(warmup=a.warmup + 3, max_steps=a.max_steps, seconds=a.seconds, on_gpu_event=on_gpu_event)
    torch.cuda.reset_peak_memory_stats()
    (mm, budget), probes = probe_and_plan(model, samples, a, opt, win)
    if budget is None:
        return {"error": f"not even {CAP} tokens/step fit under {a.max_vram_gb} GB", "probes": probes}
    if a.budget:
        budget = a.budget
    torch.cuda.reset_peak_memory_stats()
    used = sum(p["tokens"] for p in probes)
    rest, acc = [], 0
    for s in samples:
        acc += s.n_tokens
        if acc > used:
            rest.append(s)
    t_loop = time.perf_counter()
    for b in packed_batches(rest, tokens_per_step=budget):
        st = train_step(model, b, opt)
        if win.step_done(st.seconds, st.tokens, len(b.sample_ids)):
            break
    loop_s = time.perf_counter() - t_loop
    r = win.result()
    peak = _peak_gb()
    return {
        "stack": "ours",
        "label": label,
        "profile": prof,
        "batch": f"packed {budget} tok",
        "grad_ckpt": "off" if not a.ours_ckpt else "unsloth",
        **r,
        **peak,
        "token_budget": budget,
        "predicted_peak_gb": round(mm.peak(budget) / 1e9, 2),
        "memory_model": {
            "static_gb": round(mm.static_bytes / 1e9, 2),
            "mb_per_token": round(mm.bytes_per_token / 1e6, 3),
        },
        "probes": probes,
        "loop_seconds": round(loop_s, 2),
        "max_vram_gb": a.max_vram_gb,
        "first_step_end": win.first_step_end,
    }


def worker_ours(a: argparse.Namespace, model_path: Path, out: Path) -> None:
    import torch

    gc = "unsloth" if a.ours_ckpt else False
    model, _tok, info = _load_ours(a, model_path, gc=gc, cache=a.state_dir is not None, max_seq=a.max_budget)
    events: list[dict[str, Any]] = []
    for prof in a.profiles:
        row = run_ours(
            model,
            a,
            prof,
            _vocab(model_path),
            label="nightshift (packed, varlen, budgeted)",
            on_gpu_event=events.append if a.gpu_events else None,
        )
        first = row.pop("first_step_end", None)
        row.update(
            load_seconds=info["load_seconds"],
            load=info,
            first_step_s=round(first - a.t_launch, 1) if first and prof == a.profiles[0] else None,
        )
        _append(out, row)
        if a.torch_profile and row.get("token_budget"):
            profile_steps(model, a, prof, row["token_budget"], Path(f"{a.torch_profile}.{prof}.txt"))
        torch.cuda.empty_cache()
    if a.gpu_events and events:
        with open(Path(a.gpu_events), "w") as f:
            for e in events:
                f.write(json.dumps(e) + "\n")


def profile_steps(model: Any, a: argparse.Namespace, prof: str, budget: int, path: Path) -> None:
    """Where the time goes: 3 steps under torch.profiler, kernels grouped, top by CUDA time."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from jobs.training.packing import packed_batches
    from jobs.training.step import make_optimizer, train_step

    opt = make_optimizer(model)
    batches = list(
        packed_batches(
            make_samples(prof, budget * 5, vocab=_vocab(Path(a.model)), seed=a.seed + 1), tokens_per_step=budget
        )
    )[:4]
    train_step(model, batches[0], opt)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        for b in batches[1:]:
            train_step(model, b, opt)
    torch.cuda.synchronize()
    ka = p.key_averages()
    total_cuda = sum(getattr(e, "self_device_time_total", 0) for e in ka)
    lines = [
        f"profile {prof}: {len(batches) - 1} steps of <= {budget} tokens; total self CUDA time "
        f"{total_cuda / 1e3:.1f} ms",
        ka.table(sort_by="self_device_time_total", row_limit=40, max_name_column_width=90),
    ]
    path.write_text("\n".join(lines))


def worker_first_step(a: argparse.Namespace, model_path: Path, out: Path) -> None:
    """A night's start: load (cache or not), build one packed batch, one step. Time from launch."""
    from jobs.training.packing import packed_batches
    from jobs.training.step import make_optimizer, train_step

    model, _tok, info = _load_ours(a, model_path, gc=False, cache=True, max_seq=a.max_budget)
    t_loaded = time.time()
    samples = make_samples("alpaca", 4096, vocab=_vocab(model_path), seed=a.seed)
    b = next(packed_batches(samples, tokens_per_step=4096))
    opt = make_optimizer(model)
    st = train_step(model, b, opt)
    now = time.time()
    st2 = train_step(model, next(packed_batches(samples[len(b.sample_ids) :], tokens_per_step=4096)), opt)
    _append(
        out,
        {
            "mode": "faststart",
            "first_step_s": round(now - a.t_launch, 2),
            "launch_to_loaded_s": round(t_loaded - a.t_launch, 2),
            "first_step_seconds": round(st.seconds, 2),
            "second_step_seconds": round(st2.seconds, 3),
            "load": info,
        },
    )


def worker_moe(a: argparse.Namespace, model_path: Path, out: Path) -> None:
    """MoE check: trainable parameters with and without expert targets, then a few packed steps."""
    import torch

    from jobs.training.architectures import make_config
    from jobs.training.packing import packed_batches
    from jobs.training.step import make_optimizer, train_step

    model, _tok, info = _load_ours(a, model_path, gc=False, cache=False, max_seq=a.max_budget)
    names = sorted(
        {
            n.split(".")[-2] if n.endswith(("lora_A.weight", "lora_B.weight")) else n.rsplit(".", 1)[0]
            for n, p in model.named_parameters()
            if p.requires_grad
        }
    )
    cfg = make_config(a.arch) if a.arch else None
    expected = None
    if cfg is not None and getattr(cfg, "num_local_experts", None):
        r, h, i, e, L = (
            a.lora_r,
            cfg.hidden_size,
            cfg.intermediate_size,
            cfg.num_local_experts,
            cfg.num_hidden_layers,
        )
        hd, nh, kv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        attn = r * ((h + nh * hd) + 2 * (h + kv * hd) + (nh * hd + h))
        # PEFT ParamWrapper LoRA on a 3D (E, in, out) weight: A (E*r, in), B (out, E*r)
        experts = e * r * (h + 2 * i) + e * r * (i + h)
        expected = {"attention": L * attn, "experts": L * experts, "total": L * (attn + experts)}
    samples = make_samples("alpaca", 20000, vocab=_vocab(model_path), seed=a.seed)
    opt = make_optimizer(model)
    before = {n: p.detach().float().clone() for n, p in model.named_parameters() if p.requires_grad and ".experts" in n}
    losses, err = [], None
    try:
        for b in list(packed_batches(samples, tokens_per_step=4096))[:4]:
            losses.append(round(train_step(model, b, opt).loss, 4))
    except Exception as ex:
        err = f"{type(ex).__name__}: {ex}"[:400]
    changed = sum(
        1 for n, p in model.named_parameters() if n in before and not torch.equal(before[n], p.detach().float())
    )
    _append(
        out,
        {
            "mode": "moe",
            "arch": a.arch,
            "info": info,
            "expected_trainable": expected,
            "trainable_names_sample": [n for n in names if "expert" in n][:10] + names[:5],
            "losses": losses,
            "error": err,
            "expert_lora_tensors": len(before),
            "expert_lora_tensors_updated": changed,
            **_peak_gb(),
        },
    )


WORKERS = {
    "baseline": worker_baseline,
    "unsloth": worker_unsloth,
    "trl": worker_trl,
    "ours": worker_ours,
    "first_step": worker_first_step,
    "moe": worker_moe,
}


# ---- the parent: resolve model, spawn workers, print the table ------------------------------------


def resolve_model(a: argparse.Namespace) -> Path:
    if a.model:
        return Path(a.model)
    from jobs.training.architectures import build_random_model

    d = Path(a.models_dir) / (a.arch + ("-nf4" if a.build_4bit else ""))
    t0 = time.time()
    build_random_model(a.arch, d, load_in_4bit=a.build_4bit)
    print(f"model {a.arch} at {d} ({time.time() - t0:.0f} s to build or find)", flush=True)
    return d


def spawn(stack: str, a: argparse.Namespace, model_path: Path, rows: Path, timeout: float) -> int:
    argv = [
        sys.executable,
        "-m",
        "jobs.bench.cli",
        "worker",
        "--stack",
        stack,
        "--model",
        str(model_path),
        "--rows",
        str(rows),
        "--t-launch",
        repr(time.time()),
        *a.passthrough,
    ]
    print(f"--- {stack}: {' '.join(argv[3:])}", flush=True)
    try:
        return subprocess.run(argv, timeout=timeout, check=False).returncode
    except subprocess.TimeoutExpired:
        print(f"--- {stack}: timed out after {timeout:.0f} s", flush=True)
        return 124


def summarise(rows: list[dict[str, Any]], *, matmul: int, peak_flops: float) -> list[dict[str, Any]]:
    base = {r["profile"]: r.get("real_tok_s") for r in rows if r.get("stack") == "baseline"}
    for r in rows:
        tps = r.get("real_tok_s")
        if tps:
            r["mfu"] = tps * 4 * matmul / peak_flops
            b = base.get(r.get("profile"))
            r["x_baseline"] = tps / b if b else None
    best_peer = {}
    for r in rows:
        if r.get("stack") == "trl" and r.get("real_tok_s"):
            best_peer[r["profile"]] = max(best_peer.get(r["profile"], 0.0), r["real_tok_s"])
    for r in rows:
        if r.get("stack") == "ours" and r.get("real_tok_s") and best_peer.get(r["profile"]):
            r["x_unsloth_best"] = r["real_tok_s"] / best_peer[r["profile"]]
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    def f(v: Any, fmt: str) -> str:
        return "—" if v is None else format(v, fmt)

    head = (
        "| stack | data | batch | grad. ckpt | real tok/s | samples/h | peak alloc / reserved GB | W | J per 1k tok "
        "| MFU | x baseline | first step s |"
    )
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        if "profile" not in r:
            continue
        if r.get("error"):
            lines.append(
                f"| {r.get('label')} | {r['profile']} | {r.get('batch')} | {r.get('grad_ckpt')} | "
                f"error: {r['error'][:80]} |||||||"
            )
            continue
        cells = [
            r.get("label"),
            r["profile"],
            r.get("batch"),
            r.get("grad_ckpt"),
            f(r.get("real_tok_s"), ",.0f"),
            f(r.get("samples_per_hour"), ",.0f"),
            f"{f(r.get('peak_allocated_gb'), '.1f')} / {f(r.get('peak_reserved_gb'), '.1f')}",
            f(r.get("mean_power_w"), ".0f"),
            f(r.get("j_per_1k_tok"), ".0f"),
            f(r.get("mfu") and 100 * r["mfu"], ".1f") + "%",
            f(r.get("x_baseline"), ".2f"),
            f(r.get("first_step_s"), ".0f"),
        ]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def _gpu_info() -> dict[str, Any]:
    try:
        out = subprocess.run(
            [
                "nvidia-smi",
                "--query-gpu=name,memory.total,driver_version,power.limit",
                "--format=csv,noheader",
            ],
            capture_output=True,
            text=True,
            timeout=20,
        ).stdout.strip()
        return {"nvidia_smi": out}
    except Exception as e:
        return {"nvidia_smi_error": str(e)}


def parent(a: argparse.Namespace) -> dict[str, Any]:
    from jobs.training.architectures import matmul_params

    model_path = resolve_model(a)
    from transformers import AutoConfig

    matmul = matmul_params(AutoConfig.from_pretrained(str(model_path), local_files_only=True))
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    name = a.arch or model_path.name
    rows_path = out_dir / f"{a.mode}-{name}.rows.jsonl"
    rows_path.unlink(missing_ok=True)
    stacks = ["ours"] if a.mode == "calibrate" else a.stacks
    smi = smi_file = None
    if a.smi_log:
        smi_file = open(a.smi_log, "w")  # noqa: SIM115  (open while nvidia-smi writes to it)
        smi = subprocess.Popen(
            ["nvidia-smi", f"--query-gpu={a.smi_fields}", "--format=csv,nounits", "-lms", "500"],
            stdout=smi_file,
            stderr=subprocess.DEVNULL,
        )
    t0 = time.time()
    codes = {}
    try:
        for st in stacks:
            left = a.deadline - (time.time() - t0) if a.deadline else 3600
            if left < 30:
                codes[st] = "skipped: no time left"
                continue
            codes[st] = spawn(st, a, model_path, rows_path, left)
    finally:
        if smi is not None:
            smi.terminate()
            smi.wait(10)
        if smi_file is not None:
            smi_file.close()
    rows = [json.loads(x) for x in rows_path.read_text().splitlines()] if rows_path.exists() else []
    rows = summarise(rows, matmul=matmul, peak_flops=a.peak_flops)
    result = {
        "mode": a.mode,
        "model": str(model_path),
        "arch": a.arch,
        "matmul_params": matmul,
        "peak_flops": a.peak_flops,
        "max_vram_gb": a.max_vram_gb,
        "lora_r": a.lora_r,
        "settings": {
            "warmup": a.warmup,
            "max_steps": a.max_steps,
            "seconds": a.seconds,
            "profiles": a.profiles,
            "cap": CAP,
        },
        "exit_codes": codes,
        "gpu": _gpu_info(),
        "rows": rows,
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    (out_dir / f"{a.mode}-{name}.json").write_text(json.dumps(result, indent=1, default=str))
    print(table(rows))
    if a.mode == "calibrate":
        ok = [r for r in rows if r.get("real_tok_s")]
        # the slower profile: a plan must not promise more than the worse case delivers
        result["tokens_per_second"] = min(r["real_tok_s"] for r in ok) if ok else None
        result["tokens_per_step"] = min(r["token_budget"] for r in ok) if ok else None
        result["gradient_checkpointing"] = ok[0]["grad_ckpt"] if ok else None
        (out_dir / f"{a.mode}-{name}.json").write_text(json.dumps(result, indent=1, default=str))
        print(json.dumps({k: result[k] for k in ("tokens_per_second", "tokens_per_step", "gradient_checkpointing")}))
    return result


def run(argv: Sequence[str]) -> dict[str, Any]:
    """`bench` / `calibrate` for callers (nightshift CLI): the result dict, also written as JSON.

    calibrate's result has "tokens_per_second" (the slower length profile), "tokens_per_step" and
    "gradient_checkpointing": what the planner's throughput history should store.
    """
    a = build_parser().parse_args(list(argv))
    if a.mode not in ("bench", "calibrate"):
        raise ValueError("run() does bench or calibrate; use main() for the other modes")
    _passthrough(a)
    return parent(a)


def faststart(a: argparse.Namespace) -> dict[str, Any]:
    """Two 'nights' in fresh processes sharing one state dir: the second reuses the NF4 base and caches."""
    model_path = resolve_model(a)
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows_path = out_dir / f"faststart-{a.arch or model_path.name}.rows.jsonl"
    rows_path.unlink(missing_ok=True)
    if not a.state_dir:
        a.state_dir = tempfile.mkdtemp(prefix="nightshift-state-")
        a.passthrough += ["--state-dir", a.state_dir]
    for _night in (1, 2):
        if a.drop_caches:  # a later night starts with a cold page cache: measure that, not a warm one
            os.sync()
            with contextlib.suppress(OSError), open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
        spawn("first_step", a, model_path, rows_path, 900)
    rows = [json.loads(x) for x in rows_path.read_text().splitlines()] if rows_path.exists() else []
    for i, r in enumerate(rows, 1):
        print(
            f"night {i}: first step {r['first_step_s']} s after launch "
            f"(loaded at {r['launch_to_loaded_s']} s, cache hit {r['load'].get('base_cache_hit')})"
        )
    return {"rows": rows}


def budget_check(a: argparse.Namespace) -> dict[str, Any]:
    """Calibrate on one profile, then plan and train two data sets of other sizes; predicted vs actual."""
    import torch

    from jobs.training.packing import packed_batches
    from jobs.training.step import make_optimizer, train_step

    model_path = resolve_model(a)
    vocab = _vocab(model_path)
    model, _tok, info = _load_ours(a, model_path, gc=False, cache=a.state_dir is not None, max_seq=a.max_budget)
    cal = run_ours(model, a, "wiki", vocab, label="calibrate")
    tps, budget = cal["real_tok_s"], cal["token_budget"]
    print(f"calibrated: {tps:,.0f} tok/s at {budget} tokens/step", flush=True)
    out = {"calibration": cal, "runs": []}
    opt = make_optimizer(model)
    for prof, target_s in zip(("alpaca", "wiki"), a.budget_seconds, strict=True):
        samples = make_samples(prof, int(tps * target_s), vocab=vocab, seed=a.seed + 7)
        tokens = sum(s.n_tokens for s in samples)
        predicted = tokens / tps
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for b in packed_batches(samples, tokens_per_step=budget):
            train_step(model, b, opt)
        actual = time.perf_counter() - t0
        r = {
            "profile": prof,
            "samples": len(samples),
            "tokens": tokens,
            "predicted_s": round(predicted, 1),
            "actual_s": round(actual, 1),
            "error_percent": round(100 * (actual - predicted) / predicted, 1),
        }
        print("BUDGET", json.dumps(r), flush=True)
        out["runs"].append(r)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / f"budget-{a.arch or model_path.name}.json").write_text(
        json.dumps({**out, "load": info, "when": time.strftime("%Y-%m-%d %H:%M:%S")}, indent=1, default=str)
    )
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nightshift bench", description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=["bench", "calibrate", "faststart", "budget", "moe", "worker"])
    p.add_argument("--model", help="local HF model directory")
    p.add_argument("--arch", help="architecture name, built random-initialised (jobs.training.architectures)")
    p.add_argument("--models-dir", default=os.environ.get("NIGHTSHIFT_BENCH_MODELS", "/tmp/nightshift-models"))
    p.add_argument("--build-4bit", action="store_true", help="build the random model directly as NF4 (32B)")
    p.add_argument("--out", default="bench-out")
    p.add_argument("--stacks", type=lambda s: s.split(","), default=list(STACKS))
    p.add_argument("--profiles", type=lambda s: s.split(","), default=list(PROFILES))
    p.add_argument("--max-vram-gb", type=float, default=40.0)
    p.add_argument("--headroom-gb", type=float, default=3.0, help="CUDA context + allocator slack")
    p.add_argument("--max-budget", type=int, default=32768, help="token budget per step, at most")
    p.add_argument("--budget", type=int, default=0, help="force the token budget (skip the choice)")
    p.add_argument("--probe-tokens", type=int, default=2048)
    p.add_argument("--ours-ckpt", action="store_true", help="our path with Unsloth checkpointing (large models)")
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--max-steps", type=int, default=30)
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--data-tokens", type=int, default=400_000, help="random tokens generated per profile")
    p.add_argument("--trl-pack-length", type=int, default=4096)
    p.add_argument("--trl-configs", type=lambda s: s.split(","), default=["padding_free", "packing"])
    p.add_argument("--peak-flops", type=float, default=PEAK_BF16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--state-dir", help="nightshift state dir: NF4 base cache and compile caches")
    p.add_argument("--deadline", type=float, default=0, help="seconds for all stacks; later ones are skipped")
    p.add_argument("--smi-log", help="also log nvidia-smi readings (CSV) to this file")
    p.add_argument("--smi-fields", default="timestamp,power.draw,memory.used,utilization.gpu")
    p.add_argument("--gpu-events", help="ours: write the NVML sampler's events (JSON lines) here")
    p.add_argument("--drop-caches", action="store_true", help="faststart: drop the page cache before each night")
    p.add_argument("--torch-profile", help="ours: profile 3 steps per profile into <this>.<profile>.txt")
    p.add_argument("--budget-seconds", type=lambda s: [float(x) for x in s.split(",")], default=[60.0, 180.0])
    # worker-only
    p.add_argument("--stack")
    p.add_argument("--rows")
    p.add_argument("--t-launch", type=float, default=0.0)
    return p


_PASS = (
    "--profiles",
    "--max-vram-gb",
    "--headroom-gb",
    "--max-budget",
    "--budget",
    "--probe-tokens",
    "--lora-r",
    "--warmup",
    "--max-steps",
    "--seconds",
    "--data-tokens",
    "--trl-pack-length",
    "--trl-configs",
    "--seed",
    "--state-dir",
    "--gpu-events",
    "--torch-profile",
    "--arch",
)


def _passthrough(a: argparse.Namespace) -> None:
    """The flags a worker process inherits."""
    a.passthrough = []
    for flag in _PASS:
        v = getattr(a, flag[2:].replace("-", "_"))
        if v not in (None, "", 0, False):
            a.passthrough += [flag, ",".join(map(str, v)) if isinstance(v, list) else str(v)]
    if a.ours_ckpt:
        a.passthrough.append("--ours-ckpt")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = build_parser().parse_args(argv)
    _passthrough(a)
    if a.mode == "worker":
        from jobs.training.unsloth_backend import setup_caches

        setup_caches(a.state_dir)  # before anything imports torch's compile machinery
        if a.stack != "baseline":
            import unsloth
        WORKERS[a.stack](a, Path(a.model), Path(a.rows))
        return 0
    if a.mode in ("bench", "calibrate"):
        r = parent(a)
        return 0 if r["rows"] else 1
    if a.mode == "faststart":
        return 0 if faststart(a)["rows"] else 1
    if a.mode == "moe":
        model_path = resolve_model(a)
        rows = Path(a.out) / f"moe-{a.arch or model_path.name}.rows.jsonl"
        Path(a.out).mkdir(parents=True, exist_ok=True)
        return spawn("moe", a, model_path, rows, 900)
    if a.mode == "budget":
        from jobs.training.unsloth_backend import setup_caches

        setup_caches(a.state_dir)
        import unsloth  # noqa: F401

        budget_check(a)
        return 0
    return 2


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
