"""Readable tables for the terminal: the night's summary and its plan."""

from __future__ import annotations

from typing import Any

from daemon.tables import key_values
from jobs.contract import Outcome, Plan, RunSummary
from jobs.contract.redact import redact_text
from jobs.gpu.cost import summary_cost


def _num(x: Any, fmt: str = ",.0f") -> str:
    return "—" if x is None else format(x, fmt)


def _loss(x: float | None) -> str:
    return "—" if x is None else f"{x:.4f}"


def _answers(s: RunSummary, data: str, metric: str = "exact_match") -> str:
    """A metric of the adapter in service -> the candidate (the reference, the base), or why none."""
    def pct(stage: str) -> str:
        m = s.metrics.get(f"{data}_{stage}")
        return "—" if not m or m.get(metric) is None else f"{m[metric]:.1%}"

    if data in s.not_evaluated:
        return f"not evaluated: {s.not_evaluated[data]}"
    return f"{pct('before')} -> {pct('after')} (reference {pct('reference')}, base {pct('base')})"


def plan_table(p: Plan) -> str:
    return key_values([
        ("new samples to train", _num(len(p.train_ids))),
        ("replayed from earlier nights", f"{_num(len(p.replay_ids))} samples, {_num(p.replay_tokens)} tokens"),
        ("tokens to train (per epoch)", _num(p.train_tokens)),
        ("held out for evaluation", _num(len(p.heldout_ids))),
        ("deferred to a later night", f"{_num(p.deferred_samples)} samples, {_num(p.deferred_tokens)} tokens"),
        ("epochs", str(p.epochs)),
        ("time available to train", f"{_num(p.available_seconds, ',.1f')} s"),
        ("predicted train time", f"{_num(p.predicted_train_seconds, ',.1f')} s"),
        ("overheads (load+eval+save)", f"{_num(p.overhead_seconds, ',.1f')} s"),
        ("throughput used", f"{_num(p.tokens_per_second)} tok/s"),
        ("basis", p.basis),
        ("backend / device", f"{p.backend or '?'} / {p.device or '?'}"),
    ])


def split_unreadable(counts: dict[str, int]) -> tuple[dict[str, int], int]:
    """(reasons a record or file was quarantined for, files not read this time): an unreadable file is left
    where it is and tried again at the next pull, so it is not called quarantined."""
    return {k: v for k, v in counts.items() if k != "unreadable"}, counts.get("unreadable", 0)


def summary_table(s: RunSummary, price_per_gpu_hour: float | None = None) -> str:
    bad, unreadable = split_unreadable(dict(s.quarantined))
    quarantined = sum(bad.values())
    by_reason = ", ".join(f"{k} {v}" for k, v in sorted(bad.items()))
    losses = s.losses
    version = s.version_name or "—"
    if s.outcome in (Outcome.succeeded, Outcome.rejected):
        held_back = s.gate.held_back if s.gate else None
        why = f"held back: {held_back}" if held_back else "gate failed"
        version += " (promoted: now in service)" if s.promoted else f" (kept, NOT promoted: {why})"
    elif s.version_name:  # the number the run holds: a stopped run publishes it when it resumes
        version += (" (promoted: now in service)" if s.promoted else
                    " (not published yet: the night resumes from its checkpoint)" if s.outcome == Outcome.interrupted
                    else " (not published)")
    predicted, actual = s.predicted_train_seconds, s.actual_train_seconds
    ratio = f" (actual/predicted {actual / predicted:.2f})" if predicted and actual else ""
    planned = s.planned_tokens
    share = f" ({s.trained_tokens / planned:.0%} of the plan)" if planned else ""
    return key_values([
        ("outcome", s.outcome.value + (f": {s.error}" if s.error else "")),
        ("run", s.run_id),
        ("files ingested", _num(s.files_ingested)),
        ("samples ingested", _num(sum(s.ingested.values())) + f" (duplicates skipped: {s.duplicates})"),
        ("quarantined", _num(quarantined) + (f" ({by_reason})" if by_reason else "")),
        *([("not read this time", f"{unreadable:,} file(s) or inbox(es): left in place, tried again at the next "
            "pull (the log says why)")] if unreadable else []),
        ("trained", f"{_num(s.trained_samples)} samples, {_num(s.trained_tokens)} tokens, {_num(s.steps)} steps"),
        ("replayed", _num(s.replay_samples)),
        ("held out", _num(s.heldout_samples)),
        ("deferred", _num(s.deferred_samples)),
        ("backlog now", f"{_num(s.backlog_samples)} samples, {_num(s.backlog_tokens)} tokens"),
        ("throughput", f"{_num(s.tokens_per_second)} tok/s, {_num(s.samples_per_hour)} samples/h"),
        ("train seconds", f"predicted {_num(predicted, ',.1f')}, actual {_num(actual, ',.1f')}{ratio}"),
        ("train tokens", f"planned {_num(planned)}, trained {_num(s.trained_tokens)}{share}"),
        ("step shape", f"{_num(s.step_shape.tokens_per_step)} tokens, checkpointing "
                       f"{'on' if s.step_shape.gradient_checkpointing else 'off'}: {s.step_shape.basis}"
         if s.step_shape else "—"),
        ("wake -> first step", f"{_num(s.first_step_seconds, ',.1f')} s"),
        ("loss: train", _loss(losses.train)),
        ("loss: held-out", f"{_loss(losses.heldout_before)} -> {_loss(losses.heldout_after)}"),
        ("loss: regression", f"{_loss(losses.regression_before)} -> {_loss(losses.regression_after)}"),
        ("exact match: held-out", _answers(s, "heldout")),
        ("exact match: regression", _answers(s, "regression")),
        ("reply tokens: held-out", _answers(s, "heldout", "token_accuracy")),
        ("reply tokens: regression", _answers(s, "regression", "token_accuracy")),
        *([("rejected night's samples", f"{s.returned_samples:,} put back, {s.set_aside_samples:,} set aside")]
          if s.returned_samples else []),
        ("version", version),
        *([("hot-swap", hotswap_line(s))] if s.hotswap or s.hotswap_error else []),
        ("phases", ", ".join(f"{k} {v:.1f}s" for k, v in s.phase_seconds.items())),
        ("per million tokens", summary_cost(s, price_per_gpu_hour).line() or "—"),  # jobs/gpu/cost.py
        *([("expert LoRA", expert_lora_line(s))] if s.expert_lora else []),
    ])


def hotswap_failures(s: RunSummary) -> list[str]:
    """Each target that did not take the night's version (this summary's and, with [[adapters]], each
    adapter's): `once` then ends with status 4."""
    out = [f"{o.target}: {redact_text(o.error or 'failed')}" for o in s.hotswap if not o.ok]
    out += [redact_text(s.hotswap_error)] if s.hotswap_error else []
    return out + [f"adapter {a.adapter}: {x}" for a in s.adapters for x in hotswap_failures(a)]


def hotswap_line(s: RunSummary) -> str:
    """What the inference servers did with the version, and what to do when one did not take it."""
    failed = hotswap_failures(s)
    if not failed:
        return ", ".join(f"{o.target} ok" for o in s.hotswap)
    return ("; ".join(failed) + f". {s.version_name or 'The version'} stays in service here; once the server is "
            "up, `nightshift hotswap` re-sends it (the service does at its next start)")


def inbox_preview(s: RunSummary) -> dict[str, Any]:
    """What `nightshift plan` read in the inboxes without ingesting it."""
    return {"files": s.files_ingested, "new_samples": sum(s.ingested.values()), "by_source": s.ingested,
            "duplicates": s.duplicates, "would_quarantine": s.quarantined}


def inbox_table(inbox: dict[str, Any]) -> str:
    bad, unreadable = split_unreadable(inbox["would_quarantine"])
    reasons = ", ".join(f"{k} {v}" for k, v in sorted(bad.items()))
    return "not ingested yet (a plan changes nothing):\n" + key_values([
        ("new files in the inboxes", _num(inbox["files"])),
        ("new samples they hold", _num(inbox["new_samples"])),
        ("duplicates (known or repeated)", _num(inbox["duplicates"])),
        ("would be quarantined", _num(sum(bad.values())) + (f" ({reasons}: see `nightshift validate FILE`)"
                                                             if reasons else "")),
        *([("cannot be read now", f"{unreadable:,} file(s) or inbox(es): the night retries them, not quarantined")]
          if unreadable else []),
    ])


def expert_lora_line(s: RunSummary) -> str:
    """MoE bases: how many expert LoRA tensors got a gradient and moved (issue 15)."""
    e = s.expert_lora
    assert e is not None
    moved = "—" if e.moved is None else str(e.moved)
    text = f"{e.tensors} tensors, {e.with_grad} with gradient, {moved} moved"
    return text + (f" ({e.not_judged} lora_A not judged)" if e.not_judged else "")
