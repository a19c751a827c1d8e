"""One rank of the collective tests (tests/training/test_distributed.py), started by torchrun:

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/training/dist_worker.py OUT

Runs the night's loop (jobs.training.loop.train) on a tiny model three times, each with one rank behaving
differently, and writes what each rank saw to OUT/<scenario>-rank<r>.json:
- deadline: after the first step rank 1's clock runs an hour ahead (another host's clock): the deadline
  stop is collective (from the start, an hour ahead would stop rank 1 before any step: the loop checks
  the deadline before the first step too);
- signal: rank 1 alone is asked to stop (SIGTERM to one worker): both stop at the same step, and rank 0
  alone checkpoints the global position;
- oom: rank 1 runs out of memory on long rows: every rank halves its later steps, and the weights stay equal;
- same: samples of different lengths (so each rank's row has its own token count): the two ranks' weights
  equal those of one process that trains each global step's samples as one packed row (rank 0 checks);
- probe: an unmeasured night's probe steps, one row per rank, then steps sized from them: each rank's own
  sizing says something else (patched), rank 0's is the one every rank uses;
- cut: each rank's own cut decision says something else (patched): rank 0's cut is the one every rank makes;
- in_backward: an optimizer that steps each weight in the backward pass is refused on every rank (it would
  move the weights before the ranks' gradients are summed), with what to set instead.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from jobs.contract import StepShape
from jobs.data.batching import TokenizedSample
from jobs.training import loop
from jobs.training.config import TrainConfig
from jobs.training.load import Loaded
from jobs.training.loop import train
from jobs.training.optim import OptimizerChoice
from jobs.training.packing import pack, unpack
from jobs.training.ranks.collectives import Solo, init_group
from jobs.training.ranks.topology import DistributedConfig
from jobs.training.step import train_step


class OomAbove(torch.nn.Module):
    def __init__(self, model: torch.nn.Module, limit: int) -> None:
        super().__init__()
        self.model, self.limit, self.rows = model, limit, []

    def forward(self, **inputs):
        n = inputs["input_ids"].shape[1]
        self.rows.append(n)
        if n > self.limit:
            raise torch.OutOfMemoryError("fake: row too long for this card")
        return self.model(**inputs)

    def save_pretrained(self, path: str) -> None:  # what a checkpoint of the night writes
        Path(path).mkdir(parents=True, exist_ok=True)
        torch.save(self.model.state_dict(), Path(path) / "weights.pt")


def tiny(limit: int) -> OomAbove:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return OomAbove(LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                 num_hidden_layers=1, num_attention_heads=2,
                                                 num_key_value_heads=1)), limit)


def samples(n: int, length: int = 10, vary: bool = False) -> list[TokenizedSample]:
    out = []
    for i in range(n):
        k = 4 + (i * 5) % 9 if vary else length
        out.append(TokenizedSample(i, [1 + (i + j) % 60 for j in range(k)], [-100] + [1 + (i + j) % 60
                                                                                     for j in range(1, k)]))
    return out


class OneProcessOfTwo(Solo):
    """The reference: one process, each global step's two rows trained as one packed row."""

    world = 2

    def step(self, model, rows, optimizer, **kw):
        merged = pack([s for r in rows for s in unpack(r)])
        return train_step(model, merged, optimizer, **kw)


def _cut_of(rank: int):
    """Rank 0 cuts the last 3 samples not reached yet, once; rank 1 would cut its last 5 at every step."""
    calls = []

    def cut(batches, i, first_len, **_):
        tail = [sid for b in batches[i:first_len] for sid in b.sample_ids]
        calls.append(i)
        return tail[-3:] if rank == 0 and len(calls) == 1 else tail[-5:] if rank == 1 else []

    return cut


def main() -> None:
    out = Path(sys.argv[1])
    group = init_group(DistributedConfig(timeout_seconds=60, setup_timeout_seconds=60))
    rank = group.rank
    cfg = TrainConfig(batching="packed", tokens_per_step=40, max_seq_length=16, epochs=1, warmup_steps=0,
                      learning_rate=1e-2, checkpoint_every_seconds=3600)
    shape = StepShape(tokens_per_step=40, gradient_checkpointing=False, basis="test")
    real_fit, real_cut = loop._fit, loop.samples_to_cut
    for scenario in ("deadline", "signal", "oom", "same", "probe", "cut"):
        model = tiny(limit=25 if scenario == "oom" and rank == 1 else 10**6)
        before = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        loaded = Loaded(model, SimpleNamespace(pad_token_id=0), "hf", "cpu", {})
        stop = threading.Event()
        skew = [0.0]
        deadline = time.time() + 3600

        def emit(ev, _stop=stop, _scenario=scenario, _skew=skew) -> None:
            if _scenario == "signal" and rank == 1 and ev.event == "progress":
                _stop.set()  # as SIGTERM to this worker alone would
            if _scenario == "deadline" and rank == 1 and ev.event == "progress":
                _skew[0] = 3600.0  # after its first step, rank 1's clock says the deadline has passed

        loop._fit = (lambda *a, **k: 20 if rank == 0 else 30) if scenario == "probe" else real_fit
        loop.samples_to_cut = _cut_of(rank) if scenario == "cut" else real_cut
        data = {"same": samples(31, vary=True), "probe": samples(60), "cut": samples(48)}.get(scenario, samples(24))
        run_cfg = cfg.model_copy(update={"epochs": 2}) if scenario == "cut" else cfg  # a cut needs epochs > 1
        res = train(loaded, data, run_cfg, ckpt_root=out / f"ckpt-{scenario}-rank{rank}", deadline=deadline,
                    stop=stop, shape=shape, clock=lambda _s=skew: time.time() + _s[0], emit=emit, group=group,
                    probe_first=scenario == "probe")
        weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        reference = None
        if scenario == "same" and rank == 0:
            ref = tiny(limit=10**6)
            ref_res = train(Loaded(ref, SimpleNamespace(pad_token_id=0), "hf", "cpu", {}), data, cfg,
                            ckpt_root=out / "ckpt-ref", deadline=deadline, stop=threading.Event(), shape=shape,
                            group=OneProcessOfTwo())
            ref_weights = torch.cat([p.detach().reshape(-1) for p in ref.parameters()])
            reference = {"max_abs_diff": float((ref_weights - weights).abs().max()), "steps": ref_res.steps,
                         "max_abs": float(ref_weights.abs().max()), "moved": float((ref_weights - before).abs().max())}
        (out / f"{scenario}-rank{rank}.json").write_text(json.dumps({
            "stopped": res.stopped, "steps": res.steps, "next_batch": res.detail.batches_done,
            "batches": res.detail.batches, "halved": res.detail.halved, "rows": model.rows,
            "trained_ids": res.trained_ids, "tokens": res.tokens, "checksum": float(weights.double().sum()),
            "reference": reference, "cut_ids": res.cut_ids, "tokens_per_step": res.detail.tokens_per_step,
            "probe_samples": res.detail.probe_samples}))
    model = tiny(limit=10**6)  # in_backward: the optimizer full fine-tuning may choose under a tight cap
    choice = OptimizerChoice("adamw", True, "test: stepped in the backward pass")
    try:
        train(Loaded(model, SimpleNamespace(pad_token_id=0), "hf", "cpu", {}, optim=choice), samples(8), cfg,
              ckpt_root=out / f"ckpt-in-backward-rank{rank}", deadline=time.time() + 3600, stop=threading.Event(),
              shape=shape, group=group)
        error = None
    except ValueError as e:
        error = str(e)
    (out / f"in_backward-rank{rank}.json").write_text(json.dumps({"error": error}))
    group.close()


if __name__ == "__main__":
    main()
