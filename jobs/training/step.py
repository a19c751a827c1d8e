"""The training step of the fast path: Batch -> tensors -> forward/backward/step, nothing hidden.

Why a module: packed batches need three things a plain `model(**batch)` gets wrong.
- `use_cache=False`: in transformers 5 a model called with a KV cache (the default) skips the
  block-diagonal mask that reset `position_ids` would give, and samples attend to each other.
- `packed_seq_lengths` (Unsloth models only): the segment lengths as a CPU int32 tensor, so
  Unsloth's varlen attention gets its `cu_seqlens` without a device-to-host sync per step.
- a CUDA out-of-memory is caught, the batch split in two (same samples, same order) and retried
  once, and the event reported; a second failure is raised.

The night's loop (jobs/training/loop.py), calibration's probe and the benchmark all step through here.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from jobs.contract import Emit, OomSplitEvent
from jobs.contract.crashpoints import declare, reached
from jobs.data.batching import Batch
from jobs.training.packing import is_packed, segment_lengths, split_in_two

UNSLOTH_FLAG = "_nightshift_unsloth"  # set on models that jobs.training.backends.unsloth loaded
BACKWARD = declare("train.backward", "this rank's backward ran; the step's gradients are not applied (nor summed "
                                     "across ranks) yet")


def is_unsloth(model: Any) -> bool:
    return bool(getattr(model, UNSLOTH_FLAG, False))


def model_inputs(batch: Batch, device: Any, *, unsloth: bool = False) -> dict[str, Any]:
    """Tensors for `model(**inputs)`; pinned + non-blocking copies on CUDA."""
    import torch

    cuda = str(device).startswith("cuda")

    def t(x: list[list[int]]) -> Any:
        v = torch.tensor(x, dtype=torch.long)
        return v.pin_memory().to(device, non_blocking=True) if cuda else v.to(device)

    out: dict[str, Any] = {}
    if unsloth and is_packed(batch):
        # On the host, and first: Unsloth's full fine-tuning takes its autocast device from the last tensor
        # argument, and a host tensor there turns CUDA autocast off (fp32 norms then meet bf16 weights).
        out["packed_seq_lengths"] = torch.tensor(segment_lengths(batch.position_ids[0]), dtype=torch.int32)
    out.update(input_ids=t(batch.input_ids), labels=t(batch.labels), use_cache=False)
    if batch.attention_mask is not None:
        out["attention_mask"] = t(batch.attention_mask)
    if batch.position_ids is not None:
        out["position_ids"] = t(batch.position_ids)
    return out


@dataclass
class StepStat:
    tokens: int  # real (non-padding) tokens
    seconds: float  # host time to queue the step and read its loss; step after step, the GPU's time a step
    loss: float
    split: bool = False  # retried as two halves after an out-of-memory


class HostLoss:
    """A step's loss, copied to pinned host memory right after the forward, before the backward is queued: reading
    it waits for that copy only, not for the backward and the optimizer step, so `train_step` returns while the GPU
    still runs them and the host queues the next step's forward meanwhile (the FP8 8B step's forward is bound by
    the host: RESULTS.md: 2026-11-28, FP8 step host waits). Off CUDA the tensor itself."""

    def __init__(self, loss: Any) -> None:
        import torch

        self.t, self.event = loss.detach(), None
        if self.t.is_cuda:
            host = torch.empty(self.t.shape, dtype=self.t.dtype, pin_memory=True)
            host.copy_(self.t, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
            self.t = host

    def value(self) -> float:
        if self.event is not None:
            self.event.synchronize()
        return float(self.t)


def _one(model: Any, batch: Batch, device: Any, unsloth: bool, scale: float) -> HostLoss:
    """The batch's forward and backward; its loss, on its way to the host before the backward is queued (reading
    it after the backward would wait for the backward and the optimizer step)."""
    out = model(**model_inputs(batch, device, unsloth=unsloth))
    loss = HostLoss(out.loss)
    (out.loss * scale).backward()
    return loss


def trainable(optimizer: Any) -> list[Any]:
    """The weights the optimizer steps, from its param groups: what a step clips, without scanning the
    model's parameters every step."""
    return [p for g in optimizer.param_groups for p in g["params"]]


def train_step(
    model: Any,
    batch: Batch,
    optimizer: Any,
    *,
    device: Any = "cuda",
    max_grad_norm: float | None = 1.0,
    scheduler: Any = None,
    params: list[Any] | None = None,
    on_event: Emit = lambda _: None,
    halve: bool = False,
) -> StepStat:
    """One optimizer step over one batch; on CUDA OOM, the batch in two halves (gradients accumulated).

    Returns once the step is queued and its loss read, not once the GPU has run it: the next step's forward is
    queued while the GPU still runs this one's backward. Reading the loss waits for this step's forward, and so for
    the step before it: the host runs at most about a backward ahead, and a caller that times a window synchronises
    at its end, as jobs/training/probe.py does.
    NIGHTSHIFT_STEP_SYNC=1 waits for the whole step, as before (the bench's before/after)."""
    import torch

    unsloth = is_unsloth(model)
    cuda = str(device).startswith("cuda")
    t0 = time.perf_counter()
    losses: list[tuple[float, HostLoss]] = []

    def whole() -> None:
        losses.append((1.0, _one(model, batch, device, unsloth, 1.0)))

    halves = whole_or_halves(batch, whole, optimizer, halve=halve, on_event=on_event)
    for h in halves:  # token-weighted, so the step equals the whole batch's step
        w = h.real_tokens / batch.real_tokens
        losses.append((w, _one(model, h, device, unsloth, w)))
    reached(BACKWARD)
    if max_grad_norm:
        torch.nn.utils.clip_grad_norm_(params if params is not None else trainable(optimizer), max_grad_norm)
    optimizer.step()
    if scheduler is not None:
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    value = losses[0][1].value() if len(losses) == 1 else sum(w * x.value() for w, x in losses)
    if cuda and os.environ.get("NIGHTSHIFT_STEP_SYNC") == "1":
        torch.cuda.synchronize()
    return StepStat(batch.real_tokens, time.perf_counter() - t0, value, bool(halves))


def whole_or_halves(batch: Batch, attempt: Callable[[], None], optimizer: Any, *, halve: bool,
                    on_event: Emit) -> list[Batch]:
    """Run `attempt` (the whole batch's forward and backward); the two halves to run instead when asked to
    (`halve`: the run already hit an out-of-memory) or when it runs out of memory (gradients zeroed, the
    event emitted). [] when the whole batch ran. The caller runs the halves after this returns: inside the
    handler the exception's traceback still holds the failed attempt's frames, and with them its
    activations, and the halves would find no more room than the whole did."""
    import torch

    splittable = is_packed(batch) and len(batch.sample_ids) > 1
    oom = False
    if not (halve and splittable):
        try:
            attempt()
        except torch.OutOfMemoryError:
            if not splittable:
                raise
            oom = True
        else:
            return []
    optimizer.zero_grad(set_to_none=True)
    halves = split_in_two(batch)
    if oom:
        torch.cuda.empty_cache()
        on_event(OomSplitEvent(tokens=batch.real_tokens, halves=[h.real_tokens for h in halves]))
    return halves


def make_optimizer(model: Any, *, lr: float = 2e-4, weight_decay: float = 0.0) -> Any:
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    fused = bool(params) and params[0].is_cuda
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=fused)
