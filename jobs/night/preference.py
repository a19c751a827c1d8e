"""A preference night (`[train] objective = "dpo"`): the night's pairs trained with DPO, and their judgement.

The plan, the held-out split, the regression set and publishing are the supervised night's (a pair's
normal form is its chosen conversation: jobs/data/preference.py), so the gate's regression rules judge a
preference night as they judge any other. What is added here:
- training: DPO over the night's pairs, the reference being the version in service (the model as loaded,
  before its first step: jobs/training/preference/dpo.py); records that are no pair stay pending (cut);
- the rate: the plan's tokens (each pair's chosen conversation, as the ledger counts it) per second of this
  objective (both replies, the reference pass), under its own throughput key (jobs/night/model.py);
- the judgement: the held-out pairs' chosen-over-rejected log-prob margins before and after, as reward
  accuracy (the share of pairs whose implicit reward beta*(margin after - margin before) is above 0) and
  mean reward margin; a night that moves held-out pairs toward the rejected replies is not promoted.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import structlog
from pydantic import BaseModel, ConfigDict

from jobs.contract import GateCheck, GateResult, Phase

if TYPE_CHECKING:  # (RunContext and Prepared are Any below: jobs/night/candidate.py calls in here, no cycle)
    from jobs.training.loop import TrainResult

log = structlog.get_logger("nightshift.night")
MIN_REWARD_ACCURACY = 0.5  # held-out pairs: more than half must move toward the chosen reply
MIN_MARGIN = 0.0  # and the mean implicit reward margin must not go negative


class PairScores(BaseModel):
    """Held-out pairs' margins (log pi(chosen) - log pi(rejected), nats) before and after the night."""

    model_config = ConfigDict(extra="forbid")
    beta: float
    before: list[float]
    after: list[float]

    @property
    def rewards(self) -> list[float]:
        return [self.beta * (a - b) for a, b in zip(self.after, self.before, strict=True)]


def preference_checks(scores: PairScores | None) -> list[GateCheck]:
    """Reward accuracy and mean margin of the held-out pairs (none held out: skipped, passed)."""
    if scores is None or not scores.before:
        why = "no held-out pairs this night"
        return [GateCheck(name=f"heldout_pairs.{m}", before=None, after=None, change=None, change_pct=None,
                          rule=r, passed=True, skipped=why)
                for m, r in (("reward_accuracy", f">= {MIN_REWARD_ACCURACY}"), ("margin", f">= {MIN_MARGIN}"))]
    rewards = scores.rewards
    accuracy = sum(r > 0 for r in rewards) / len(rewards)
    margin = sum(rewards) / len(rewards)
    return [
        GateCheck(name="heldout_pairs.reward_accuracy", before=MIN_REWARD_ACCURACY, after=accuracy,
                  change=accuracy - MIN_REWARD_ACCURACY, change_pct=None,
                  rule=f"> {MIN_REWARD_ACCURACY} of {len(rewards)} pairs", passed=accuracy > MIN_REWARD_ACCURACY),
        GateCheck(name="heldout_pairs.margin", before=0.0, after=margin, change=margin, change_pct=None,
                  rule=f"mean beta*(margin after - before) >= {MIN_MARGIN}", passed=margin >= MIN_MARGIN),
    ]


def judge_preferences(verdict: GateResult, result: TrainResult) -> GateResult:
    """The supervised gate's verdict (its regression rules hold for a preference night too) and the held-out
    pairs' checks: promoted only if all pass. A supervised night's verdict is returned unchanged."""
    if result.detail.objective != "dpo" or result.detail.preference is None:
        return verdict
    raw = result.detail.preference.heldout_pairs
    checks = preference_checks(PairScores.model_validate(raw) if raw is not None else None)
    verdict.checks = [*verdict.checks, *checks]
    verdict.passed = verdict.passed and all(c.passed for c in checks)
    log.info("gate_preferences", passed=verdict.passed, checks=[c.model_dump() for c in checks])
    return verdict


def reference_kept(ctx: Any) -> bool:
    """A preference run's checkpoint is continued only beside the reference its first attempt kept: the
    version in service cannot be read back from a policy that has moved (else the run starts over from it)."""
    if ctx.cfg.train.objective != "dpo":
        return True
    from jobs.training.preference.dpo import REFERENCE_FILE, read_reference

    return read_reference(ctx.checkpoints / REFERENCE_FILE) is not None


def train_pairs(ctx: Any, prep: Any, relay: Callable[[Any], None]) -> TrainResult:
    """DPO over the night's pairs; the summary filled as the supervised path fills it."""
    from jobs.training.checkpoints import read_state
    from jobs.training.loop import TrainResult
    from jobs.training.loop_state import PreferenceDetail, TrainDetail
    from jobs.training.preference.dpo import REFERENCE_FILE, pair_margins, pairs_from_records, train_preference

    cfg, loaded, s = ctx.cfg.train, prep.loaded, ctx.summary
    ids = [x.sample_id for x in prep.train_set]
    planned_tokens = {x.sample_id: x.n_tokens for x in prep.train_set}
    opts = {"max_seq_length": cfg.max_seq_length, "overlong": cfg.overlong, "special_tokens": cfg.special_tokens}
    rows = ctx.ledger.samples_by_id(ids)
    pairs, others = pairs_from_records(loaded.tokenizer, [(r.id, r.record) for r in rows], **opts)
    held_rows = ctx.ledger.samples_by_id(prep.heldout_ids)
    held, _ = pairs_from_records(loaded.tokenizer, [(r.id, r.record) for r in held_rows], **opts)
    tokens_per_step = max(prep.shape.tokens_per_step or 0, 2 * cfg.max_seq_length)  # a pair always fits a row
    if prep.resume is not None:  # the rows are cut as the checkpoint's run cut them
        tokens_per_step = read_state(prep.resume).tokens_per_step or tokens_per_step
    ctx.checkpoints.mkdir(parents=True, exist_ok=True)
    with ctx.phase(Phase.train):
        res = train_preference(loaded.model, pairs, beta=cfg.dpo_beta, lr=cfg.learning_rate, epochs=cfg.epochs,
                               tokens_per_step=tokens_per_step, deadline=ctx.deadline, stop=ctx.stop,
                               device=loaded.device, clock=ctx.clock, emit=relay,
                               reference_file=ctx.checkpoints / REFERENCE_FILE, heldout=held,
                               ckpt_root=ctx.checkpoints, resume=prep.resume,
                               checkpoint_every=cfg.checkpoint_every_seconds)
    before = res.heldout_before  # the version in service's, kept from the run's first attempt
    after = pair_margins(loaded.model, held, loaded.device, tokens_per_step) if res.stopped != "signal" else []
    trained = set(res.trained_ids)
    tokens = sum(planned_tokens[i] for i in res.trained_ids) * cfg.epochs  # the plan's units
    result = TrainResult(
        trained_ids=res.trained_ids, tokens=tokens, seconds=res.seconds, steps=res.steps, mean_loss=res.mean_loss,
        resumed_from_step=res.resumed_from, warmup_tokens=res.warmup_tokens, warmup_seconds=res.warmup_seconds,
        stopped=res.stopped if res.stopped in ("deadline", "signal") else None,  # type: ignore[arg-type]
        cut_ids=[i for i in ids if i not in trained], loss_curve=res.loss_curve,
        detail=TrainDetail(
            objective="dpo", step_shape=prep.shape, batches_done=res.steps, batches=res.rows,  # a row a step
            preference=PreferenceDetail(
                pairs=len(pairs), not_pairs=len(others), policy_tokens=res.tokens,
                reference_seconds=res.reference_seconds, train_reward_accuracy=res.reward_accuracy,
                train_margin=res.mean_margin,
                heldout_pairs=PairScores(beta=cfg.dpo_beta, before=before, after=after).model_dump()
                if after else None)))
    s.step_shape = prep.shape
    s.trained_samples = sum(1 for i in res.trained_ids if i not in prep.replay_ids)
    s.replay_samples = len(res.trained_ids) - s.trained_samples
    if result.stopped != "signal":  # stopped on request the pairs stay tonight's: the next start resumes them
        s.cut_samples = sum(1 for i in result.cut_ids if i not in prep.replay_ids)
        s.deferred_samples = (s.deferred_samples or 0) + s.cut_samples
    s.trained_tokens, s.steps, s.actual_train_seconds, s.stopped = tokens, res.steps, res.seconds, result.stopped
    s.losses.train = res.mean_loss
    if res.stopped != "signal":  # an interrupted run trains its pairs again when it resumes: counted then
        s.preference_pairs = s.trained_samples
    if res.seconds > 0:
        s.tokens_per_second = tokens / res.seconds
        s.samples_per_hour = len(res.trained_ids) * 3600 / res.seconds
    log.info("preference_trained", pairs=len(pairs), not_pairs=len(others), heldout_pairs=len(held),
             reward_accuracy=res.reward_accuracy, margin=res.mean_margin)
    return result
