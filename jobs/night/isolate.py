"""A rejected night: which new file made it worse, so that the rest keeps learning the next night (issue 39).

Retrying a rejected night whole delayed the clean data with it: a night of wrong labels was rejected,
its samples went back to pending, the next clean night trained them with its own and was rejected too.
Instead, each new file of a rejected night is scored by how training on it moves what the gate saw
lost: the cosine between the file's loss gradient and the gradient of the loss of the samples the
candidate lost (answered by the anchor, not by the candidate), over the adapter's trainable weights.
A gradient step on the file changes that loss by about -lr * g_file . g_lost, so a negative cosine
means the file pushes the model away from what it lost (a first-order influence estimate, as TracIn).
Samples the model is known to learn safely (tonight's replay, from promoted nights) give the yardstick:
a file blamed is one whose harm (-cosine) is positive and exceeds theirs by MARGIN (on the CPU chain of
tests/night/test_learning_chain.py a night of wrong labels scored 0.09 against the replay's -0.30).
Blamed files are held (jobs/store/file_strikes.py); the rest of the night goes back to pending
uncounted. A later promoted night scores the held files again against what it knows, with its own new
data as the yardstick: blamed twice, a file is quarantined with the reason; else it is released.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import structlog

from jobs.data.batching import TokenizedSample, padded_batches
from jobs.data.render import tokenize_record
from jobs.learning.gate import STAGE
from jobs.night.context import RunContext
from jobs.night.measure import EvalSets
from jobs.store import file_strikes

log = structlog.get_logger("nightshift.night")
MARGIN = 0.1  # cosine units above the yardstick's harm
PER_GROUP = 32  # samples a group's gradient is taken on


@dataclass(frozen=True)
class Blame:
    harm: dict[int, float]  # file id -> -cos(g_file, g_target)
    yardstick: float
    blamed: list[int]


def gradient(loaded: Any, samples: Sequence[TokenizedSample], max_tokens: int) -> Any:
    """The mean loss's gradient over the trainable weights, flattened (None: no samples)."""
    import torch

    from jobs.training.step import model_inputs

    model = loaded.model
    params = [p for p in model.parameters() if p.requires_grad]
    if not samples or not params:
        return None
    was_training = model.training
    model.eval()
    model.zero_grad(set_to_none=True)
    try:
        with torch.enable_grad():
            batches = list(padded_batches(list(samples), batch_size=16, max_tokens_per_batch=max_tokens,
                                          pad_id=loaded.tokenizer.pad_token_id))
            for b in batches:
                out = model(**model_inputs(b, loaded.device))
                (out.loss / len(batches)).backward()
        return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().float().flatten()
                          for p in params])
    finally:
        model.zero_grad(set_to_none=True)
        if was_training:
            model.train()


def harm(g: Any, target: Any) -> float:
    """-cos(g, target): > 0 when descending on g raises the target's loss."""
    n = float(g.norm()) * float(target.norm())
    return -float(g @ target) / n if n > 0 and math.isfinite(n) else 0.0


def lost_samples(sets: EvalSets, failed: Sequence[tuple[str, str]]) -> list[TokenizedSample]:
    """Samples of the failed rules' data that their anchor answered and the candidate did not."""
    pool = {"heldout": sets.heldout, "regression": sets.regression, "canary": sets.canary,
            "retention": sets.retention}
    out: dict[int, TokenizedSample] = {}
    for name, against in failed:
        data = name.split("[")[0]  # "regression[<slice>]": a per-slice check reads its data set's samples
        anchor, cand = sets.per_sample.get(f"{data}_{STAGE[against]}", {}), sets.per_sample.get(f"{data}_after", {})
        for s in pool.get(data, []):
            a, c = anchor.get(s.sample_id), cand.get(s.sample_id)
            if a is not None and c is not None and a.exact and not c.exact:
                out[s.sample_id] = s
    return list(out.values())


def known_samples(sets: EvalSets) -> list[TokenizedSample]:
    """Regression samples the candidate answers: what a later night protects when it scores a held file."""
    cand = sets.per_sample.get("regression_after", {})
    return [s for s in sets.regression if (c := cand.get(s.sample_id)) is not None and c.exact]


def blame(loaded: Any, target: list[TokenizedSample], groups: dict[int, list[TokenizedSample]],
          yardstick: list[TokenizedSample], max_tokens: int) -> Blame | None:
    g_target = gradient(loaded, target[:PER_GROUP * 4], max_tokens)
    if g_target is None or float(g_target.norm()) == 0:
        return None
    g_yard = gradient(loaded, yardstick[:PER_GROUP], max_tokens)
    base = harm(g_yard, g_target) if g_yard is not None else 0.0
    scores = {fid: harm(g, g_target) for fid, ss in groups.items()
              if (g := gradient(loaded, ss[:PER_GROUP], max_tokens)) is not None}
    return Blame(scores, base, sorted(f for f, h in scores.items() if h > max(base + MARGIN, 0.0)))


def on_rejection(ctx: RunContext, loaded: Any, sets: EvalSets, new: list[TokenizedSample],
                 replay: list[TokenizedSample], failed: Sequence[tuple[str, str]]) -> Blame | None:
    """Which of tonight's files made the candidate worse (None: nothing to tell them apart by)."""
    if not ctx.cfg.train.method.is_adapter:  # a whole model's gradient is as large as the model: not scored
        return None
    target = lost_samples(sets, failed)
    by_file = file_strikes.files_of(ctx.ledger, [s.sample_id for s in new])
    ids = {s.sample_id: s for s in new}
    groups = {fid: [ids[i] for i in sids] for fid, sids in by_file.items()}
    if not target or not groups:
        return None
    try:
        b = blame(loaded, target, groups, replay, ctx.cfg.eval.max_tokens_per_batch)
    except Exception as e:  # a measurement missing never fails the night: the old, counted return
        log.warning("isolate_failed", error=f"{type(e).__name__}: {e}"[:300])
        return None
    if b is not None:
        log.info("isolate", harm={file_strikes.path_of(ctx.ledger, f): round(h, 3) for f, h in b.harm.items()},
                 yardstick=round(b.yardstick, 3), blamed=[file_strikes.path_of(ctx.ledger, f) for f in b.blamed])
    return b if b is not None and b.blamed else None


def rescore_held(ctx: RunContext, loaded: Any, sets: EvalSets, new: list[TokenizedSample], version: int) -> None:
    """A promoted night scores the files held by earlier rejections against what its candidate knows."""
    held = file_strikes.held(ctx.ledger)
    target = known_samples(sets)
    if not held or not target or not ctx.cfg.train.method.is_adapter:
        return
    t = ctx.cfg.train
    groups = {}
    for f in held:
        rows = ctx.ledger.samples_by_id(file_strikes.held_samples(ctx.ledger, f.file_id, PER_GROUP))
        groups[f.file_id] = [tokenize_record(loaded.tokenizer, r.id, r.record, max_seq_length=t.max_seq_length,
                                             overlong="truncate", special_tokens=t.special_tokens) for r in rows]
    try:
        b = blame(loaded, target, groups, new, ctx.cfg.eval.max_tokens_per_batch)
    except Exception as e:
        log.warning("isolate_failed", error=f"{type(e).__name__}: {e}"[:300])
        return
    if b is None:
        return
    with ctx.ledger.tx() as c:
        for f in held:
            if f.file_id in b.blamed:
                row = file_strikes.strike(ctx.ledger, c, f.file_id, version=version,
                                          reason=f"scored against v{version}'s answers: harm {b.harm[f.file_id]:.2f} "
                                                 f"> max(its new data's {b.yardstick:.2f} + {MARGIN}, 0)")
                ctx.summary.isolated[row.path] = f"{row.status}: {row.reason}"
            elif f.file_id in b.harm:
                file_strikes.release(ctx.ledger, c, f.file_id)
                ctx.summary.isolated[f.path] = (f"released: harm {b.harm[f.file_id]:.2f} <= "
                                                f"max({b.yardstick:.2f} + {MARGIN}, 0)")
    log.info("held_files_scored", result=ctx.summary.isolated)
