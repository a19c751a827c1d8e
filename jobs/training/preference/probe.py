"""calibrate's steps for a preference night: what `[train] objective = "dpo"` runs, timed and probed.

`nightshift calibrate` probes memory and times steps through jobs/training/probe.py; with this objective its
steps are the night's (jobs/training/preference/dpo.py): synthetic samples paired in order (chosen, rejected), the
pairs packed into rows by `pair_rows`, and each step the reference forward of its row (no grad) and a DPO
step through `dpo_step`, with the night's optimizer. A step counts the plan's units: the tokens of its pairs'
chosen conversations (a pair's normal form, as the ledger counts it), per second of the policy step plus the
reference pass shared by the night's epochs (computed once per night, then read for every epoch). So the
rate calibrate records under the DPO throughput key is the one the night's plan divides by, and the memory
line is the DPO step's (its logits of both replies in fp32, not the supervised step's fused loss).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from jobs.data.batching import Batch, TokenizedSample
from jobs.training.config import TrainConfig
from jobs.training.packing import segment_lengths
from jobs.training.preference.dpo import Pair, dpo_step, packed_row, pair_rows, preference_optimizer, sequence_logps
from jobs.training.step import StepStat, trainable


@dataclass(frozen=True)
class PairObjective:
    """The DPO step as calibrate runs it (jobs/night/calibrate.py passes it to probe_memory / timed_steps)."""

    beta: float
    lr: float
    epochs: int

    @classmethod
    def of(cls, t: TrainConfig) -> PairObjective | None:
        """The objective of this config; None: the supervised step (probe.py's own)."""
        return cls(beta=t.dpo_beta, lr=t.learning_rate, epochs=t.epochs) if t.objective == "dpo" else None

    def optimizer(self, model: Any) -> Any:
        return preference_optimizer(model, self.lr)[1]

    def rows(self, samples: Sequence[TokenizedSample], tokens_per_step: int) -> list[Batch]:
        """Consecutive samples as (chosen, rejected) pairs, packed into rows as the night packs its pairs."""
        pairs = [Pair(a.sample_id, a, b) for a, b in zip(samples[0::2], samples[1::2], strict=False)]
        return [packed_row(r) for r in pair_rows(pairs, tokens_per_step)]

    def step(self, model: Any, batch: Batch, optimizer: Any) -> StepStat:
        """The row's reference forward, then its DPO step; seconds: the step plus the reference's share of
        one epoch; tokens: the chosen conversations' (every other sequence, from the first)."""
        import torch

        device = next(model.parameters()).device
        cuda = device.type == "cuda"
        t0 = time.perf_counter()
        was_training = model.training
        model.eval()
        with torch.no_grad():
            ref = sequence_logps(model, batch, device).detach()
        model.train(was_training)
        if cuda:
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        loss, _, _ = dpo_step(model, batch, ref, optimizer, trainable(optimizer), beta=self.beta, device=device)
        if cuda:
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        return StepStat(chosen_tokens(batch), (t2 - t1) + (t1 - t0) / max(1, self.epochs), loss)


def chosen_tokens(batch: Batch) -> int:
    """Tokens of the row's paired chosen sequences (0, 2, 4, ...; an odd last sequence is no pair)."""
    lengths = segment_lengths(batch.position_ids[0]) if batch.position_ids else [batch.real_tokens]
    return sum(lengths[0: len(lengths) // 2 * 2: 2])
