"""Calibration's probe: measure this GPU's memory per token and throughput for our training path.

Shared by `nightshift calibrate` (which records the result for the night) and the benchmark.
A warm-up step (compiles, autotunes: not a memory sample), then one or two probe steps of known
size give the line peak(tokens) = static + per_token x tokens; the budget is the largest step
whose predicted peak stays under the cap. Then timed packed steps at that budget give tokens/s.
CUDA only (the peaks come from torch's allocator).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from jobs.contract import CalibrationRecord, MemoryModel
from jobs.data.batching import Batch, TokenizedSample
from jobs.training.models.synthetic import make_samples
from jobs.training.packing import (
    MemoryProbe,
    choose_token_budget,
    conservative_memory_model,
    packed_batches,
    second_probe_tokens,
    with_allocated_growth,
)
from jobs.training.step import StepStat, train_step

OnStep = Callable[[StepStat, Batch], None]


@dataclass(frozen=True)
class ProbeSettings:
    max_vram_gb: float  # the budget stays under this (minus headroom)
    min_tokens: int  # a step must hold the longest sample: max_seq_length
    max_tokens: int = 32768
    probe_tokens: int = 2048
    headroom_gb: float = 3.0  # CUDA context (not seen by torch's counters) + allocator slack


@dataclass(frozen=True)
class ProbeResult:
    memory: MemoryModel
    tokens_per_step: int | None  # None: not even min_tokens fit under the cap
    probes: list[dict[str, float]] = field(default_factory=list)  # tokens, peak_reserved_gb, seconds


def probe_memory(model: Any, samples: Sequence[TokenizedSample], settings: ProbeSettings, optimizer: Any,
                 on_step: OnStep = lambda *_: None, objective: Any = None) -> ProbeResult:
    """Probe steps -> memory line -> token budget under the cap. The second probe is never larger
    than the first one's line says fits: probing must respect the limit too. `objective`: another step
    than the supervised one (jobs/training/preference/probe.py: a preference night's); None: train_step."""
    import torch

    probes: list[MemoryProbe] = []
    allocated: list[MemoryProbe] = []  # the same steps' allocated peaks: growth the reserved peaks may hide
    seen: list[dict[str, float]] = []
    it = iter(samples)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    static = float(torch.cuda.memory_reserved())
    static_allocated = float(torch.cuda.memory_allocated())
    # Gradients exist during every step whatever its size (unless the optimizer steps in backward):
    # memory a step holds besides its activations, like the optimizer state the warm-up creates.
    grads = 0 if getattr(optimizer, "in_backward", False) else sum(
        p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    for k, want in enumerate((settings.probe_tokens // 2, settings.probe_tokens, 2 * settings.probe_tokens)):
        size = want
        if k == 2:
            size = second_probe_tokens(probes[0], static_bytes=static, max_vram_gb=settings.max_vram_gb, want=want,
                                       headroom_gb=settings.headroom_gb)
            if size < 1.25 * probes[0].tokens:
                break  # no room for a second size: one probe + static memory
        b = _fill(it, size)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        st = objective.step(model, b, optimizer) if objective is not None else train_step(model, b, optimizer)
        peak, peak_allocated = torch.cuda.max_memory_reserved(), torch.cuda.max_memory_allocated()
        if k:
            probes.append(MemoryProbe(b.real_tokens, float(peak)))
            allocated.append(MemoryProbe(b.real_tokens, float(peak_allocated)))
        else:  # after the warm-up: weights and optimizer state (full fine-tuning: gigabytes), + gradients
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            static = max(static, float(torch.cuda.memory_reserved())) + grads
            static_allocated = max(static_allocated, float(torch.cuda.memory_allocated())) + grads
        seen.append({"tokens": b.real_tokens, "peak_reserved_gb": round(peak / 1e9, 2),
                     "peak_allocated_gb": round(peak_allocated / 1e9, 2), "seconds": round(st.seconds, 3)})
        on_step(st, b)
    at = 2 * settings.probe_tokens
    memory = with_allocated_growth(conservative_memory_model(probes, static_bytes=static, at_tokens=at),
                                   conservative_memory_model(allocated, static_bytes=static_allocated, at_tokens=at))
    budget = choose_token_budget(memory, max_vram_gb=settings.max_vram_gb, min_tokens=settings.min_tokens,
                                 max_tokens=settings.max_tokens, headroom_gb=settings.headroom_gb)
    torch.cuda.empty_cache()  # the budgeted steps' peak is measured from here
    return ProbeResult(memory, budget, seen)


def _fill(it: Iterable[TokenizedSample], size: int) -> Batch:
    """One packed row of about `size` tokens (samples that would overshoot are skipped)."""
    group: list[TokenizedSample] = []
    n = 0
    for scanned, s in enumerate(it, 1):
        if n + s.n_tokens <= size or not group:
            group.append(s)
            n += s.n_tokens
        if n >= 0.9 * size or scanned >= 500:
            break
    return next(packed_batches(group, tokens_per_step=10**9))


@dataclass(frozen=True)
class Throughput:
    tokens: int  # real tokens of the timed steps
    seconds: float  # their wall time, less the excess of one-off stalls
    steps: int
    stalls: int = 0  # timed steps that took more than STALL x the median time per token
    stall_seconds: float = 0.0  # what those took beyond the median rate (left out of `seconds`)
    wall_seconds: float = 0.0  # the window's whole wall time, stalls included

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


PROCESS_WARMUP_SECONDS = 30.0  # a process's first steps: untimed this long, whatever two steps in a row say
STALL = 2.0  # a step this many times slower per token than the window's median: a one-off (compile, autotune)
SETTLED = 0.05  # two warm-up steps this close in seconds per token: compiled, tuned, allocator grown


class StepWindow(Protocol):
    """What watches the timed window from outside (the benchmark: NVML energy over exactly it, its thirds)."""

    def begin(self) -> None: ...

    def record(self, seconds: float, tokens: int, samples: int) -> None: ...

    def end(self) -> None: ...


def timed_steps(model: Any, samples: Sequence[TokenizedSample], tokens_per_step: int, optimizer: Any, *,
                warmup: int = 3, max_steps: int | None = None, seconds: float = 30.0, group: Any = None,
                max_warmup: int = 12, warmup_seconds: float = 0.0, window: StepWindow | None = None,
                objective: Any = None) -> Throughput:
    """Packed steps at the budget: at least `warmup` untimed and `warmup_seconds` of them, more (up to
    `max_warmup`) until two steps in a row take the same time per token within SETTLED, then `seconds`
    timed (or `max_steps`, if given, first), the samples' rows reused as often as that takes: a cap of 30
    steps once cut calibrate's `--seconds 60` to ~15 s of an 8B's steps on an H200.

    A timed step over STALL x the median time per token is taken for a one-off, not the rate: its excess
    is left out and counted in `stalls`. On an H200 (1B, calibrate's first profile) one step took 5x the
    others after three settled ones (RESULTS.md: 2026-11-23, calibrate step stalls); in a 6-second window that
    is a third of the time, and calibrate's figure for that profile (64k tok/s against the 81-83k its
    nights trained at) planned every night.

    [distributed] `group` (jobs.training.ranks.collectives): each step is one row per rank, the end of the
    warm-up and of the window is decided together, and the tokens are the global step's: tokens/s for
    this count of cards. `objective` (one process): its own rows and step, and the tokens it counts
    (jobs/training/preference/probe.py); None: packed rows, train_step."""
    import torch

    world = group.world if group is not None else 1
    rows = (objective.rows(samples, tokens_per_step) if objective is not None
            else list(packed_batches(samples, tokens_per_step=tokens_per_step)))
    steps = [rows[k: k + world] for k in range(0, len(rows) - world + 1, world)]  # one row per rank
    if not steps:
        raise ValueError(f"not one step of {tokens_per_step} tokens for {world} rank(s) in the samples")
    timed: list[tuple[int, float]] = []  # (tokens, seconds) of each timed step
    warm = 0
    started = None
    warm_from = time.perf_counter()
    last = None  # seconds per token of the previous warm-up step
    for k in itertools.count():
        step = steps[k % len(steps)]
        st = (group.step(model, step, optimizer) if group is not None
              else objective.step(model, step[0], optimizer) if objective is not None
              else train_step(model, step[0], optimizer))
        if started is None:
            warm += 1
            per_token = st.seconds / max(1, st.tokens)
            settled = last is not None and abs(per_token - last) <= SETTLED * last
            last = per_token
            done = (warm >= max_warmup or (warm >= warmup and settled)) and \
                time.perf_counter() - warm_from >= warmup_seconds
            if group.agree(done)[0] if group is not None else done:
                _synchronize(torch)
                if window is not None:
                    window.begin()
                started = time.perf_counter()
            continue
        timed.append((st.tokens, st.seconds))
        if window is not None:
            window.record(st.seconds, st.tokens, sum(len(b.sample_ids) for b in step))
        done = (max_steps is not None and len(timed) >= max_steps) or time.perf_counter() - started >= seconds
        if (group.agree(done)[0] if group is not None else done):  # every rank ends at the same step
            break
    _synchronize(torch)  # the window's last steps run on after train_step returns (jobs/training/step.py)
    wall = time.perf_counter() - started if started else 0.0
    if window is not None:
        window.end()
    excess = _stall_excess(timed)
    return Throughput(sum(n for n, _ in timed), max(wall - sum(excess), 0.0), len(timed), stalls=len(excess),
                      stall_seconds=round(sum(excess), 3), wall_seconds=wall)


PROBE_PROFILE = "wiki"  # the probe's rows: the long profile's (its memory line is the one the budget must hold)
PROFILE_SEED = 1


def probe_samples(settings: ProbeSettings, *, vocab: int, cap: int) -> list[TokenizedSample]:
    """The probe steps' data, calibrate's and the benchmark's alike: one probe, one step shape for every profile."""
    return make_samples(PROBE_PROFILE, 8 * settings.probe_tokens, vocab=vocab, cap=cap)


def profile_samples(profile: str, tokens_per_step: int, *, vocab: int, cap: int, world: int = 1,
                    seed: int = PROFILE_SEED, prompt_share: float = 0.0,
                    pool: Sequence[int] | None = None) -> list[TokenizedSample]:
    """A profile's timed data: 40 steps' worth of samples, cycled by timed_steps for as long as its window lasts."""
    return make_samples(profile, 40 * tokens_per_step * world, vocab=vocab, cap=cap, seed=seed,
                        prompt_share=prompt_share, pool=pool)


def time_profiles(model: Any, optimizer: Any, tokens_per_step: int, profiles: Sequence[str], *, vocab: int, cap: int,
                  seconds: float, group: Any = None, before: Callable[[int, str, dict[str, Throughput]], None] =
                  lambda *_: None, window: Callable[[str], StepWindow | None] = lambda _: None,
                  seed: int = PROFILE_SEED, prompt_share: float = 0.0, pool: Sequence[int] | None = None,
                  first_warmup_seconds: float = PROCESS_WARMUP_SECONDS, objective: Any = None) -> dict[str, Throughput]:
    """The timed windows of a calibration, one per length profile at one step shape: `nightshift calibrate` and
    the benchmark's `ours` rows both measure through here, so the two cannot disagree by method. The first
    profile's window waits out the process's warm-up: on an H200 (8B) a 10-s window right after two steps in a
    row agreed read 15,203 tok/s and the night planned from it ran 9.0 % under its plan; after 30 s of warm-up
    15,839 and 4.6 % (RESULTS.md: 2026-11-26, calibrate warm-up). The benchmark's own window, 3 steps after its
    probe and 30 steps long, read the FP8 8B at 18,620 against calibrate's 22,567 on the same machine (issue 44):
    its first third ran at ~15k while kernels were still being tuned.
    `before(i, profile, rates so far)` runs ahead of each window (progress, peak-memory resets); `window(profile)`
    watches one (energy). `first_warmup_seconds`: 0 where the process already ran (the benchmark's MoE rows,
    one call a profile). [distributed] `group`: global steps, one row per rank. `objective`: a preference
    night's steps (jobs/training/preference/probe.py); None: the supervised step."""
    world = group.world if group is not None else 1
    rates: dict[str, Throughput] = {}
    for i, p in enumerate(profiles):
        before(i, p, rates)
        data = profile_samples(p, tokens_per_step, vocab=vocab, cap=cap, world=world, seed=seed,
                               prompt_share=prompt_share, pool=pool)
        rates[p] = timed_steps(model, data, tokens_per_step, optimizer, seconds=seconds, group=group,
                               warmup_seconds=0.0 if i else first_warmup_seconds, window=window(p),
                               objective=objective)
    return rates


def _stall_excess(timed: Sequence[tuple[int, float]]) -> list[float]:
    """Seconds beyond the median rate of each stalled step (at least three steps to judge by)."""
    if len(timed) < 3:
        return []
    per_token = sorted(s / max(1, n) for n, s in timed)
    median = per_token[len(per_token) // 2]
    return [s - n * median for n, s in timed if s > STALL * n * median]


def _synchronize(torch: Any) -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def calibration_record(probe: ProbeResult, rates: dict[str, Throughput], *, gradient_checkpointing: bool,
                       max_vram_gb: float, device: str, versions: dict[str, str]) -> CalibrationRecord:
    """What the night needs from a calibration, typed: the step shape, the memory model, tokens/s."""
    if probe.tokens_per_step is None:
        raise ValueError(f"not even max_seq_length tokens per step fit under max_vram_gb={max_vram_gb:g} "
                         f"(static {probe.memory.static_gb:.1f} GB, {probe.memory.mb_per_token:.2f} MB per token)")
    return CalibrationRecord(tokens_per_step=probe.tokens_per_step, gradient_checkpointing=gradient_checkpointing,
                             memory=probe.memory, max_vram_gb=max_vram_gb, device=device, versions=versions,
                             tokens_per_second={k: r.tokens_per_second for k, r in rates.items()})
