"""Synthetic tasks whose answers are checked by exact match: what a chain of nights learns and forgets.

A task maps a key (a country name: one token of the demo tokenizer) to a two-digit code, asked
after a few filler words and the task's cue word:

    user:      "lantern orbit. harbor Norway"      (task A's cue: harbor)
    assistant: "27"

Task B asks the same keys after its own cue with other codes, so a model that learns B by
ignoring the cue unlearns A: forgetting shows at once. A "wrong-label" variant of a task keeps its
prompts and scrambles its codes (a bad data drop); a "noisy" variant gives a share of each night's
records a wrong code drawn at random (a user's everyday label noise). The fixed test set of a task
(`test_set(per_key)` prompts per key) never appears in its training data: the model must map the
key, not remember prompts. `draw` picks another draw of every night's prompts (and of its noise).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

KEYS = ("Norway", "Sweden", "France", "Spain", "Italy", "Japan", "Brazil", "Peru", "Chile", "Kenya", "Egypt",
        "Ghana")
FILLERS = ("meadow", "river", "lantern", "thunder", "velvet", "window", "signal", "orbit", "copper", "letters")
CODES = tuple(str(n) for n in (10, 12, 14, 16, 18, 21, 23, 25, 27, 29, 32, 34, 36, 39, 41, 43, 45, 47, 49, 51,
                               53, 56, 58, 60, 63, 65, 67, 69, 72, 76, 78, 81, 83, 85, 87, 89, 91, 93))


@dataclass(frozen=True)
class Task:
    name: str
    cue: str
    codes: dict[str, str]  # key -> the answer
    wrong_share: float = 0.0  # share of a night's records given a wrong code at random (noisy())

    def record(self, key: str, fillers: tuple[str, ...]) -> dict[str, Any]:
        return {"messages": [{"role": "user", "content": f"{' '.join(fillers)}. {self.cue} {key}"},
                             {"role": "assistant", "content": self.codes[key]}]}

    def prompts(self, n: int, seed: int | str) -> list[tuple[str, tuple[str, ...]]]:
        rng = random.Random(f"{self.name}:{seed}")
        return [(KEYS[i % len(KEYS)], tuple(rng.choice(FILLERS) for _ in range(rng.randint(1, 3))))
                for i in range(n)]

    def test_prompts(self, per_key: int = 2) -> list[tuple[str, tuple[str, ...]]]:
        """`per_key` distinct prompts per key, fixed (the same for every draw): the chain's yardstick."""
        rng = random.Random(f"{self.name}:test")
        out: dict[tuple[str, tuple[str, ...]], None] = {}
        for key in KEYS:
            mine: set[tuple[str, ...]] = set()
            while len(mine) < per_key:
                mine.add(tuple(rng.choice(FILLERS) for _ in range(rng.randint(1, 3))))
            out.update(dict.fromkeys((key, f) for f in sorted(mine)))
        return list(out)

    def test_set(self, per_key: int = 2) -> list[dict[str, Any]]:
        return [self.record(k, f) for k, f in self.test_prompts(per_key)]

    def night(self, n: int, night: int, *, draw: int = 0, test_per_key: int = 20) -> list[dict[str, Any]]:
        """`n` training records of one night, none of them a prompt of the test set (`test_per_key`
        or fewer per key); a noisy task's records each get a wrong code with chance `wrong_share`."""
        test = set(self.test_prompts(test_per_key))
        rng = random.Random(f"{self.name}:noise:{draw}:{night}")
        out: list[dict[str, Any]] = []
        more = 0
        while len(out) < n:
            seed: int | str = night * 1000 + more if draw == 0 else f"{draw}:{night}:{more}"
            for key, fillers in self.prompts(n, seed=seed):
                if (key, fillers) not in test and len(out) < n:
                    rec = self.record(key, fillers)
                    if self.wrong_share and rng.random() < self.wrong_share:
                        wrong = rng.choice([c for c in CODES if c != self.codes[key]])
                        rec["messages"][1]["content"] = wrong
                    out.append(rec)
            more += 1
        return out

    def scrambled(self) -> Task:
        """Same prompts, every answer wrong (a bad drop of labels)."""
        keys = list(KEYS)
        return Task(self.name, self.cue, {k: self.codes[keys[(i + 1) % len(keys)]] for i, k in enumerate(keys)})

    def noisy(self, share: float) -> Task:
        """The same task with a share of every night's answers wrong (a random other code each)."""
        return Task(self.name, self.cue, self.codes, wrong_share=share)

    @property
    def wrong(self) -> str:
        """How this task's labels differ from the task's own: "" (they do not), "scrambled", "15 % wrong"."""
        if self.wrong_share:
            return f"{self.wrong_share * 100:g} % wrong"
        return "" if self.codes == TASKS[self.name].codes else "scrambled"


def make_task(name: str, cue: str, seed: int) -> Task:
    rng = random.Random(seed)
    return Task(name, cue, dict(zip(KEYS, rng.sample(CODES, len(KEYS)), strict=True)))


TASK_A = make_task("A", "harbor", 1)
TASK_B = make_task("B", "thunder", 2)
TASKS = {t.name: t for t in (TASK_A, TASK_B)}
