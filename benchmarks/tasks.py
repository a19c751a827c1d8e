"""Synthetic tasks whose answers are checked by exact match: what a chain of nights learns and forgets.

A task maps a key (a country name: one token of the demo tokenizer) to a two-digit code, asked
after a few filler words and the task's cue word:

    user:      "lantern orbit. harbor Norway"      (task A's cue: harbor)
    assistant: "27"

Task B asks the same keys after its own cue with other codes, so a model that learns B by
ignoring the cue unlearns A: forgetting shows at once. A "wrong-label" variant of a task keeps its
prompts and scrambles its codes (a bad data drop). The fixed test set of a task (two prompts per
key) never appears in its training data: the model must map the key, not remember prompts.
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

    def record(self, key: str, fillers: tuple[str, ...]) -> dict[str, Any]:
        return {"messages": [{"role": "user", "content": f"{' '.join(fillers)}. {self.cue} {key}"},
                             {"role": "assistant", "content": self.codes[key]}]}

    def prompts(self, n: int, seed: int) -> list[tuple[str, tuple[str, ...]]]:
        rng = random.Random(f"{self.name}:{seed}")
        return [(KEYS[i % len(KEYS)], tuple(rng.choice(FILLERS) for _ in range(rng.randint(1, 3))))
                for i in range(n)]

    def test_set(self) -> list[dict[str, Any]]:
        """Two prompts per key, fixed: the chain's yardstick."""
        return [self.record(k, f) for k, f in self.prompts(2 * len(KEYS), seed=-1)]

    def night(self, n: int, night: int) -> list[dict[str, Any]]:
        """`n` training records of one night, none of them a test prompt."""
        test = set(self.prompts(2 * len(KEYS), seed=-1))
        out: list[dict[str, Any]] = []
        draw = 0
        while len(out) < n:
            for key, fillers in self.prompts(n, seed=night * 1000 + draw):
                if (key, fillers) not in test and len(out) < n:
                    out.append(self.record(key, fillers))
            draw += 1
        return out

    def scrambled(self) -> Task:
        """Same prompts, every answer wrong (a bad drop of labels)."""
        keys = list(KEYS)
        return Task(self.name, self.cue, {k: self.codes[keys[(i + 1) % len(keys)]] for i, k in enumerate(keys)})


def make_task(name: str, cue: str, seed: int) -> Task:
    rng = random.Random(seed)
    return Task(name, cue, dict(zip(KEYS, rng.sample(CODES, len(KEYS)), strict=True)))


TASK_A = make_task("A", "harbor", 1)
TASK_B = make_task("B", "thunder", 2)
