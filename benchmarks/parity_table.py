"""The parity benchmark's judgement and tables, pure (no torch): what `python -m benchmarks parity` prints.

A path (`fp8`, `nf4`) is judged against `bf16` at every scored point of the curve (after each night):
its exact match may be higher, or lower by at most `PARITY_POINTS`; one point lower by more is a miss
(issue 44 item 7: "within 1 point"), and so is a night the path failed or left unscored. A night the path
never started (the run's time budget: benchmarks/parity.py) is shown as not run, compared with nothing.
A bf16 curve that never leaves the floor or sits at the ceiling from its first point compares nothing: the
table says so instead of calling it parity.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from daemon.tables import markdown

PARITY_POINTS = 1.0  # issue 44 item 7: within 1 point of bf16's exact match
REFERENCE = "bf16"
FLOOR, CEILING = 5.0, 99.5  # bf16 below / above these everywhere: nothing learned / nothing left to compare


@dataclass(frozen=True)
class Point:
    """One path after one night: its candidate's exact match on the unseen test set (points, 0-100)."""

    path: str
    night: int
    steps: int  # optimizer steps so far, all nights of the path
    exact_match: float | None  # None: the night failed or was not scored
    loss: float | None = None  # the night's mean training loss


@dataclass(frozen=True)
class Verdict:
    path: str
    passed: bool
    worst: float | None  # the most negative difference to bf16 along the curve, points
    final: float | None  # the difference at the last night both have
    misses: tuple[int, ...]  # nights where the path fell more than PARITY_POINTS below bf16, or failed
    note: str = ""
    not_run: tuple[int, ...] = ()  # nights bf16 was scored on that this path never started


def exact_match(replies: Sequence[str], answers: Sequence[str]) -> float:
    """Points (0-100) of replies equal to their answer (both stripped)."""
    if len(replies) != len(answers):
        raise ValueError(f"{len(replies)} replies for {len(answers)} answers")
    if not answers:
        raise ValueError("no test prompts to score")
    return 100.0 * sum(r.strip() == a.strip() for r, a in zip(replies, answers, strict=True)) / len(answers)


def by_night(points: Sequence[Point], path: str) -> dict[int, Point]:
    return {p.night: p for p in points if p.path == path}


def informative(points: Sequence[Point]) -> str:
    """"" when bf16's curve can show a difference; else why not."""
    ref = [p.exact_match for p in points if p.path == REFERENCE and p.exact_match is not None]
    if not ref:
        return "bf16 was not scored"
    if max(ref) < FLOOR:
        return f"bf16 learned nothing (at most {max(ref):.1f} %): nothing to compare"
    if min(ref) > CEILING:
        return f"bf16 at {min(ref):.1f} % from its first point: saturated, the curve shows no difference"
    return ""


def judge(points: Sequence[Point], path: str) -> Verdict:
    """`path` against bf16 at every night both were scored; a night the path failed (no figure where bf16
    has one) is a miss; a night it never started is only listed."""
    ref, mine = by_night(points, REFERENCE), by_night(points, path)
    diffs: list[tuple[int, float]] = []
    misses: list[int] = []
    not_run: list[int] = []
    for night, r in sorted(ref.items()):
        if r.exact_match is None:
            continue
        m = mine.get(night)
        if m is None:
            not_run.append(night)
            continue
        if m.exact_match is None:
            misses.append(night)  # bf16 has a figure, this path none: not parity
            continue
        d = m.exact_match - r.exact_match
        diffs.append((night, d))
        if d < -PARITY_POINTS:
            misses.append(night)
    why = informative(points)
    if not diffs:
        return Verdict(path, False, None, None, tuple(misses), why or "no night scored on both paths",
                       tuple(not_run))
    return Verdict(path, not misses and not why, min(d for _, d in diffs), diffs[-1][1], tuple(misses), why,
                   tuple(not_run))


def accuracy_table(points: Sequence[Point], paths: Sequence[str]) -> str:
    """One row per night: each path's exact match, and the difference to bf16 in points."""
    nights = sorted({p.night for p in points})
    head = ["night", *[f"{p} (steps)" if p == REFERENCE else f"{p} (steps) Δ bf16" for p in paths]]
    body = []
    for n in nights:
        ref = by_night(points, REFERENCE).get(n)
        row = [str(n)]
        for path in paths:
            p = by_night(points, path).get(n)
            if p is None or p.exact_match is None:
                row.append("not run" if p is None else "failed ✗")
                continue
            cell = f"{p.exact_match:.1f} % ({p.steps})"
            if path != REFERENCE and ref is not None and ref.exact_match is not None:
                d = p.exact_match - ref.exact_match
                cell += f" {d:+.1f}" + (" ✗" if d < -PARITY_POINTS else "")
            row.append(cell)
        body.append(row)
    return markdown(head, body)


def verdict_lines(points: Sequence[Point], paths: Sequence[str]) -> list[str]:
    out = []
    for path in paths:
        if path == REFERENCE:
            continue
        v = judge(points, path)
        worst = "—" if v.worst is None else f"{v.worst:+.1f}"
        final = "—" if v.final is None else f"{v.final:+.1f}"
        state = "within 1 point" if v.passed else "MISS"
        extra = f"; misses at night {', '.join(map(str, v.misses))}" if v.misses else ""
        extra += f"; night {', '.join(map(str, v.not_run))} not run (time budget)" if v.not_run else ""
        extra += f"; {v.note}" if v.note else ""
        out.append(f"{path}: {state} of bf16 (final {final} points, worst along the curve {worst}{extra})")
    return out


def loss_table(curves: dict[str, list[tuple[int, float]]], every: int = 10) -> str:
    """The loss curves side by side, every `every` steps (each path's steps counted across its nights)."""
    paths = list(curves)
    steps = sorted({s for c in curves.values() for s, _ in c if s % every == 0 or s == 1})
    body = []
    for s in steps:
        row = [str(s)]
        for p in paths:
            loss = dict(curves[p]).get(s)
            row.append("—" if loss is None else f"{loss:.3f}")
        body.append(row)
    return markdown(["step", *paths], body)
