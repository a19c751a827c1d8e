"""One rank of the kill-at-each-point tests (tests/training/test_kill_each_point.py), forked from a forkserver
that imported torch once (each child costs a fork, not an import of torch).

`run_rank(out, spec)` trains the night's loop (jobs.training.loop.train) on a tiny torch model, as one process
(world 1) or as one rank of a gloo group, optionally with NIGHTSHIFT_CRASH_AT set (the crash point SIGKILLs it),
optionally resuming from the newest whole checkpoint as a night does (rank 0 chooses it, every rank reads it).
What it did goes to OUT/<name>-rank<r>.json and its final weights to OUT/<name>-rank<r>.pt.

The clock is fake (one second a call, checkpoints every second): a checkpoint after every step, whatever the
machine's load, so the N-th time a point is reached names the same step in every run.
"""

from __future__ import annotations

import itertools
import json
import os
import threading
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch._dynamo  # the optimizer's first construction imports it: 5 s a child, once here)

from jobs.contract import StepShape
from jobs.data.batching import TokenizedSample
from jobs.training.checkpoints import latest_checkpoint
from jobs.training.config import TrainConfig
from jobs.training.load import Loaded
from jobs.training.loop import train
from jobs.training.ranks.collectives import init_group
from jobs.training.ranks.topology import DistributedConfig

SAMPLES = 12
EPOCHS = 3


class TinyLM(torch.nn.Module):
    """A causal LM's interface (`model(**inputs).loss`, `save_pretrained`) in two layers: no transformers import."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(64, 16)
        self.out = torch.nn.Linear(16, 64)

    def forward(self, input_ids: Any, labels: Any, attention_mask: Any = None, **_: Any) -> Any:
        logits = self.out(torch.tanh(self.emb(input_ids)))
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 64), labels[:, 1:].reshape(-1),
                                                 ignore_index=-100)
        return SimpleNamespace(loss=loss)

    def save_pretrained(self, path: str) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        torch.save(self.state_dict(), Path(path) / "weights.pt")


def samples() -> list[TokenizedSample]:
    """Lengths 40-72: the probe steps (about 256 tokens each) take a few samples, the rest pack 2 a row."""
    out = []
    for i in range(SAMPLES):
        ids = [1 + (i * 7 + j) % 63 for j in range(40 + (i * 11) % 33)]
        out.append(TokenizedSample(i, ids, [-100, *ids[1:]]))
    return out


def run_rank(out: str, spec: dict[str, Any]) -> None:
    """`spec`: name, case, rank, world, port, resume (bool), crash ("point@N" or None), crash_rank, late_after
    (the deadline passes once this many global steps are counted)."""
    torch.set_num_threads(1)
    rank, world = int(spec["rank"]), int(spec["world"])
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(spec["port"]))
    for key in ("NIGHTSHIFT_CRASH_AT", "NIGHTSHIFT_CRASH_RANK"):
        os.environ.pop(key, None)
    if spec.get("crash"):
        os.environ["NIGHTSHIFT_CRASH_AT"] = spec["crash"]
        os.environ["NIGHTSHIFT_CRASH_RANK"] = str(spec.get("crash_rank", 0))
    dest = Path(out) / f"{spec['name']}-rank{rank}"
    ckpt_root = Path(out) / f"ckpt-{spec['case']}"
    group = init_group(DistributedConfig(backend="gloo", timeout_seconds=120, setup_timeout_seconds=120))
    try:
        model = TinyLM()
        resume = None
        if spec.get("resume"):  # as a night: rank 0 picks the checkpoint, every rank reads the same one
            found = latest_checkpoint(ckpt_root) if group.is_owner else None
            picked = group.broadcast(str(found) if found else None)
            resume = Path(picked) if picked else None
            if resume is not None:  # what the loader does with the checkpoint's adapter
                model.load_state_dict(torch.load(resume / "weights.pt"))
        cfg = TrainConfig(batching="padded", batch_size=2, max_seq_length=128, epochs=EPOCHS, warmup_steps=2,
                          learning_rate=1e-2, checkpoint_every_seconds=1.0)
        shape = StepShape(tokens_per_step=4096, gradient_checkpointing=False, basis="test")
        ticks, late = itertools.count(), [0.0]

        def emit(ev: Any) -> None:  # `late_after` steps counted: the clock jumps past the deadline
            if spec.get("late_after") and getattr(ev, "steps", 0) >= spec["late_after"]:
                late[0] = 2e12

        res = train(Loaded(model, SimpleNamespace(pad_token_id=0), "hf", "cpu", {}), samples(), cfg,
                    ckpt_root=ckpt_root, deadline=1e12, stop=threading.Event(), shape=shape,
                    clock=lambda: float(next(ticks)) + late[0], emit=emit, resume=resume, probe_first=True,
                    group=group)
        torch.save(torch.cat([p.detach().reshape(-1) for p in model.parameters()]), f"{dest}.pt")
        dest.with_suffix(".json").write_text(json.dumps({
            "steps": res.steps, "tokens": res.tokens, "trained_ids": sorted(res.trained_ids),
            "partial_ids": res.partial_ids, "resumed_from": res.resumed_from_step, "stopped": res.stopped,
            "batches": res.detail.batches, "batches_done": res.detail.batches_done,
            "loss_steps": [s for s, _ in res.loss_curve], "resumed_checkpoint": str(resume) if resume else None}))
    except Exception as e:  # a collective that lost its peer: recorded, the test checks it failed, not hung
        dest.with_suffix(".json").write_text(json.dumps({"error": f"{type(e).__name__}: {e}",
                                                         "trace": traceback.format_exc()[-2000:]}))
        raise SystemExit(1) from None
    finally:
        group.close()
