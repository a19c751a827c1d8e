"""`python -m benchmarks.chain` kept runnable: a shortened schedule through the same code as the measured
chains (benchmarks/RESULTS.md, issue 39), the shipped config's sections, and the independent scorer."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

import pytest

from benchmarks import chain, greedy
from benchmarks.tasks import KEYS, TASK_A, TASK_B

REPO = Path(__file__).resolve().parents[2]


def test_the_chains_run_the_shipped_configs_plan_train_and_eval_paths_only_changed():
    sections = chain.shipped_sections()
    raw = tomllib.loads((REPO / "config" / "nightshift.toml").read_text())
    assert sections["train"] == raw["train"] and sections["plan"] == raw["plan"]
    assert {k: v for k, v in sections["eval"].items() if k != "canary_set"} == {
        k: v for k, v in raw["eval"].items() if k != "canary_set"}
    assert Path(sections["eval"]["canary_set"]) == (REPO / "config" / raw["eval"]["canary_set"]).resolve()
    assert chain.parse_set(["eval.heldout_pool=128", "plan.heldout_share=0.2"]) == {
        "eval": {"heldout_pool": 128}, "plan": {"heldout_share": 0.2}}
    with pytest.raises(SystemExit, match="expected"):
        chain.parse_set(["daemon.x=1"])


def test_the_schedules_and_their_data():
    assert [t.name for t, _ in chain.SCHEDULES["two tasks"]] == ["A"] * 3 + ["B"] * 3
    noisy = chain.SCHEDULES["noisy"]
    assert len(noisy) == 13 and [t.wrong for t, _ in noisy] == [""] * 3 + ["15 % wrong"] * 10
    records = noisy[5][0].night(400, 6, draw=2)
    wrong = sum(r["messages"][1]["content"] != TASK_A.codes[r["messages"][0]["content"].split()[-1]]
                for r in records)
    assert 0.10 < wrong / len(records) < 0.20  # 15 % wrong labels, drawn
    test = {r["messages"][0]["content"] for r in TASK_A.test_set(20)}
    assert len(test) == 20 * len(KEYS)  # 240 distinct unseen prompts a task
    for draw in (1, 2):
        night = TASK_A.night(96, 1, draw=draw)
        assert not test & {r["messages"][0]["content"] for r in night}  # never a test prompt
    assert TASK_A.night(96, 1, draw=1) != TASK_A.night(96, 1, draw=2)  # draws differ
    assert TASK_A.night(96, 1, draw=1) == TASK_A.night(96, 1, draw=1)  # and are reproducible


class Scripted:
    """A stand-in model whose next token is scripted per prompt: the scorer's loop, not a model, under test."""

    def __init__(self, tok: Any, replies: dict[str, list[str]]) -> None:
        self.tok, self.replies = tok, {k: [tok.convert_tokens_to_ids(t) for t in v] for k, v in replies.items()}

    def __call__(self, input_ids: Any, attention_mask: Any, position_ids: Any) -> Any:
        import torch

        vocab = len(self.tok)
        logits = torch.zeros(input_ids.shape[0], input_ids.shape[1], vocab)
        for row, ids in enumerate(input_ids.tolist()):
            text = self.tok.decode([i for i, m in zip(ids, attention_mask[row].tolist(), strict=True) if m])
            prompt = next(p for p in self.replies if p in text)
            done = len(self.tok(text.split("<|assistant|>\n", 1)[1], add_special_tokens=False).input_ids)
            script = self.replies[prompt]
            logits[row, -1, script[min(done, len(script) - 1)]] = 1.0
        return type("Out", (), {"logits": logits})()


def test_the_independent_scorer_decodes_greedily_to_the_end_of_the_turn(tiny_model: Path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    net = Scripted(tok, {"harbor Norway": ["27", "<|end|>"], "harbor Peru": ["ĠNorway", "27", "<|end|>"],
                         "harbor Chile": ["27", "27", "27", "27", "27", "27", "27", "27"]})
    replies = greedy.greedy_replies(net, tok, ["river. harbor Norway", "velvet orbit. harbor Peru",
                                               "meadow. harbor Chile"], batch=2)
    assert replies == ["27", "Norway27", "272727272727"]  # stops at <|end|>, or after MAX_NEW_TOKENS


@pytest.mark.slow
def test_a_shortened_chain_runs_through_the_command(tmp_path: Path, tiny_model: Path):
    out = tmp_path / "out"
    argv = ["--chains", "noisy", "--nights", "2", "--draws", "1", "--per-night", "24", "--test-per-key", "2",
            "--work", str(tmp_path / "work"), "--model", str(tiny_model), "--out", str(out)]
    assert chain.main(argv) == 0
    data = json.loads((out / "chain.json").read_text())
    [(name, rows)] = data["results"].items()
    assert name == "noisy, draw 1" and [r["night"] for r in rows] == [1, 2]
    assert data["sections"] == chain.shipped_sections() and data["test_prompts_per_task"] == 24
    for r in rows:
        assert set(r["exact_match"]) == {"A", "B"} and all(0 <= v <= 1 for v in r["exact_match"].values())
        assert r["outcome"] in ("succeeded", "rejected") and r["heldout"] + r["trained"] > 0
    assert rows[1]["checks"] and "| noisy, draw 1 |" in data["table"]
    # the scorer's figure is the adapter in service's: re-scored from outside it agrees
    current = tmp_path / "work" / "noisy-1" / "state" / "current"
    tests = {t.name: t.test_set(2) for t in (TASK_A, TASK_B)}
    assert greedy.exact_match(tiny_model, current.resolve() if current.exists() else None, tests) == \
        rows[-1]["exact_match"]
