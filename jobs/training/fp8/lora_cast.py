"""The LoRA weights in the activations' dtype, cast once per optimizer step, after it (issue 44).

Why: PEFT keeps LoRA weights in fp32, and every FP8 Function's forward (jobs/training/fp8/lora.py) cast them to
bf16 (a `cat` of a group's A's, one cast per weight: ~15 launches a decoder layer, 480 in an 8B step), on the
host's critical path in the forward, where the 8B step is launch-bound (RESULTS.md: 2026-11-28, 8B FP8 step
profile: ~11 % of the step the GPU waits). Here they are cast by a global optimizer post-step hook, right
after each optimizer step, while the GPU still runs that step's backward; a forward reuses the casts.

The values are the same casts of the same weights, so the step computes what it did. A forward takes a cached
copy only if it is provably current: made after the last optimizer step of this process (fused AdamW changes
the weights without bumping their version counters) and every weight still at the version and storage it had
then (`load_state_dict`, `copy_` or a new `.data` after it invalidate it). Otherwise the forward casts as
before; a group seen once is then kept current by the hook from the next step on. NIGHTSHIFT_FP8_CAST_CACHE=0
turns the cache off (the bench's before/after).
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

Tensor = torch.Tensor


def enabled() -> bool:
    return os.environ.get("NIGHTSHIFT_FP8_CAST_CACHE", "1") != "0"


def _stamp(ws: Sequence[Tensor]) -> tuple[tuple[int, int], ...]:
    return tuple((w._version, w.data_ptr()) for w in ws)


@dataclass
class _Group:
    """One group's weights (weak: a model's release frees them) and their casts."""

    refs: tuple[weakref.ref[Tensor], ...]  # the A's, then the B's
    n_a: int
    dtype: torch.dtype
    a_cat: Tensor | None = None
    bs: list[Tensor] = field(default_factory=list)
    stamp: tuple[tuple[int, int], ...] = ()
    step: int = -1  # the optimizer steps begun when the casts were made

    def alive(self) -> list[Tensor] | None:
        ws = [r() for r in self.refs]
        return None if any(w is None for w in ws) else ws  # type: ignore[return-value]


class CastCache:
    """Per group of LoRA weights (keyed by their identities and the target dtype), the bf16 [A_1; A_2; ...] and
    B's of the last optimizer step."""

    def __init__(self) -> None:
        self.groups: dict[tuple[Any, ...], _Group] = {}
        self.steps = 0  # optimizer steps begun in this process (a pre-step hook counts them)
        self._lock = threading.Lock()
        self._hooked = False

    def get(self, As: Sequence[Tensor], Bs: Sequence[Tensor], dt: torch.dtype
            ) -> tuple[Tensor, list[Tensor]] | None:
        """(a_cat, bs) if current, else None (the caller casts); the group is remembered for the hook."""
        if not enabled() or As[0].dtype == dt:  # weights already in dt: nothing to cast
            return None
        key = (*map(id, As), *map(id, Bs), dt)
        g = self.groups.get(key)
        ws = [*As, *Bs]
        alive = None if g is None else g.alive()
        if alive is None or any(a is not w for a, w in zip(alive, ws, strict=True)):
            self._remember(key, ws, len(As), dt)
            return None
        if g.step != self.steps or g.a_cat is None or g.stamp != _stamp(ws):
            return None
        return g.a_cat, g.bs

    def _remember(self, key: tuple[Any, ...], ws: list[Tensor], n_a: int, dt: torch.dtype) -> None:
        with self._lock:
            self.groups[key] = _Group(tuple(weakref.ref(w) for w in ws), n_a, dt)
            if not self._hooked:
                register_optimizer_step_pre_hook(self._before_step)
                register_optimizer_step_post_hook(self._after_step)
                self._hooked = True

    def _before_step(self, _optimizer: Any, _args: Any, _kwargs: Any) -> None:
        """Every cast is stale from here on: a step that raises halfway leaves none in use."""
        with self._lock:
            self.steps += 1

    def _after_step(self, _optimizer: Any, _args: Any, _kwargs: Any) -> None:
        """Recast every remembered group (one `_foreach_copy_` for all), dropping groups whose weights are gone."""
        with self._lock:
            if not enabled():
                return
            dsts: list[Tensor] = []
            srcs: list[Tensor] = []
            fresh: list[tuple[_Group, list[Tensor]]] = []
            for key, g in list(self.groups.items()):
                ws = g.alive()
                if ws is None:
                    del self.groups[key]
                    continue
                As, Bs = ws[:g.n_a], ws[g.n_a:]
                with torch.no_grad():
                    if g.a_cat is None:
                        g.a_cat = torch.empty(sum(a.shape[0] for a in As), As[0].shape[1], dtype=g.dtype,
                                              device=As[0].device)
                        g.bs = [torch.empty(b.shape, dtype=g.dtype, device=b.device) for b in Bs]
                    dsts += [*g.a_cat.split([a.shape[0] for a in As]), *g.bs]
                srcs += [a.detach() for a in As] + [b.detach() for b in Bs]
                fresh.append((g, ws))
            if dsts:
                with torch.no_grad():
                    torch._foreach_copy_(dsts, srcs)
            for g, ws in fresh:
                g.stamp, g.step = _stamp(ws), self.steps


CACHE = CastCache()
