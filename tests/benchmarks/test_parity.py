"""`python -m benchmarks parity` (issue 44 item 7): its data, its scorer and its judgement, on the CPU.

The GPU figures come from benchmarks/drivers/parity_gpu.sh (benchmarks/RESULTS.md); here: the task is written in
words the random model's tokenizer knows, no test prompt is trained on, the scorer switches adapters for real,
and a path that learns worse than bf16 by more than a point is reported as a miss, along the curve.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import greedy, parity
from benchmarks.parity_table import Point, accuracy_table, exact_match, judge, loss_table, verdict_lines


def curve(path: str, ems: list[float | None]) -> list[Point]:
    return [Point(path, n, 10 * n, em) for n, em in enumerate(ems, start=1)]


def test_exact_match_counts_equal_replies_in_points():
    assert exact_match(["w1", " w2 ", "w3"], ["w1", "w2", "w4"]) == pytest.approx(200 / 3)
    with pytest.raises(ValueError, match="2 replies for 3 answers"):
        exact_match(["w1", "w2"], ["w1", "w2", "w3"])


def test_a_path_more_than_a_point_below_bf16_anywhere_on_the_curve_is_a_miss():
    points = curve("bf16", [20.0, 60.0, 90.0]) + curve("nf4", [19.5, 60.4, 89.2]) \
        + curve("fp8", [21.0, 57.5, 90.0]) + curve("ahead", [30.0, 70.0, 95.0])
    nf4, fp8, ahead = judge(points, "nf4"), judge(points, "fp8"), judge(points, "ahead")
    assert nf4.passed and nf4.misses == () and nf4.worst == pytest.approx(-0.8)
    assert not fp8.passed and fp8.misses == (2,) and fp8.worst == pytest.approx(-2.5) and fp8.final == 0.0
    assert ahead.passed  # learning faster than bf16 is no miss
    table = accuracy_table(points, ["bf16", "nf4", "fp8"])
    row2 = next(line for line in table.splitlines() if line.startswith("| 2 |"))
    assert "57.5 % (20) -2.5 ✗" in row2 and "60.4 % (20) +0.4" in row2 and "✗" not in row2.split("|")[3]
    lines = verdict_lines(points, ["bf16", "nf4", "fp8"])
    assert lines[0].startswith("nf4: within 1 point") and lines[1].startswith("fp8: MISS")
    assert "misses at night 2" in lines[1]


def test_a_failed_night_is_a_miss_a_night_never_started_is_listed_and_unscored_bf16_judges_nothing():
    failed = judge(curve("bf16", [20.0, 60.0]) + curve("fp8", [20.0, None]), "fp8")
    assert not failed.passed and failed.misses == (2,)
    missing = judge(curve("bf16", [20.0, 60.0]) + curve("fp8", [20.0]), "fp8")  # night 2 never started
    assert missing.passed and missing.misses == () and missing.not_run == (2,)
    assert "failed ✗" in accuracy_table(curve("bf16", [20.0, 60.0]) + curve("fp8", [20.0, None]), ["bf16", "fp8"])
    assert "not run" in verdict_lines(curve("bf16", [20.0, 60.0]) + curve("fp8", [20.0]), ["bf16", "fp8"])[0]
    assert not judge(curve("fp8", [20.0]), "fp8").passed


def test_a_bf16_curve_at_the_floor_or_the_ceiling_compares_nothing():
    floor = judge(curve("bf16", [0.0, 1.0]) + curve("fp8", [0.0, 1.0]), "fp8")
    assert not floor.passed and "learned nothing" in floor.note
    ceiling = judge(curve("bf16", [100.0, 100.0]) + curve("fp8", [100.0, 100.0]), "fp8")
    assert not ceiling.passed and "saturated" in ceiling.note
    assert judge(curve("bf16", [100.0, 100.0, 40.0]) + curve("fp8", [100.0, 100.0, 40.0]), "fp8").passed


def test_the_task_is_in_the_random_models_words_and_no_test_prompt_is_trained():
    from jobs.training.models.architectures import make_config, make_tokenizer

    tok = make_tokenizer(make_config("tiny-llama"))
    records = parity.night_records(2, 300, test_per_key=40)
    assert len(records) == 300
    for r in records[:50]:
        for m in r["messages"]:
            ids = tok(m["content"], add_special_tokens=False).input_ids
            assert tok.unk_token_id not in ids and len(ids) == len(m["content"].split())
    tests = parity.test_sets(40)
    assert [len(v) for v in tests.values()] == [480, 480]
    prompts = {r["messages"][0]["content"] for v in tests.values() for r in v}
    assert not prompts & {r["messages"][0]["content"] for r in records}
    # two cues, the same keys, 24 answers: the cue must be read
    assert len({(r["messages"][0]["content"].split()[-2:][0], r["messages"][1]["content"]) for r in records}) == 24
    with pytest.raises(ValueError, match="'Oslo'"):
        parity.in_words({"messages": [{"role": "user", "content": "harbor Oslo"}]})


def test_steps_and_loss_curves_are_counted_across_a_paths_nights():
    rows = {"bf16": [{"night": 1, "steps": 3, "loss_curve": [[1, 5.0], [2, 4.0], [3, 3.0]], "train_loss": 4.0},
                     {"night": 2, "steps": 2, "loss_curve": [[1, 2.5], [2, 2.0]], "train_loss": 2.25}]}
    points, curves = parity.points_and_curves(rows, {"bf16/1": {"A": 0.5, "B": 0.25}})
    assert [(p.steps, p.exact_match) for p in points] == [(3, 37.5), (5, None)]
    assert curves["bf16"] == [(1, 5.0), (2, 4.0), (3, 3.0), (4, 2.5), (5, 2.0)]
    assert "| 4 | 2.500 |" in loss_table(curves, every=2)


def test_the_scorer_switches_adapters_on_one_base(tmp_path: Path):
    """Each adapter answers through the shared base exactly as it does loaded alone (the 8B is read once)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from jobs.training.models.architectures import build_random_model

    model = build_random_model("tiny-llama", tmp_path / "m", device="cpu")
    adapters = {}
    for seed in (1, 2):
        torch.manual_seed(seed)
        net = get_peft_model(AutoModelForCausalLM.from_pretrained(model),
                             LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
        for p in net.parameters():
            if p.requires_grad:
                p.data.mul_(40.0)  # large enough to change the greedy replies
        net.save_pretrained(tmp_path / f"a{seed}")
        adapters[seed] = tmp_path / f"a{seed}"
    prompts = [r["messages"][0]["content"] for r in parity.test_sets(2)["A"]]
    alone = {}
    for seed, path in adapters.items():
        net, tok = greedy.load(model, path)
        alone[seed] = greedy.greedy_replies(net, tok, prompts)
    base_net, tok = greedy.load(model, None)
    base = greedy.greedy_replies(base_net, tok, prompts)
    assert alone[1] != alone[2] and alone[1] != base  # the check below can tell them apart
    scorer = greedy.Scorer(model)
    for seed in (1, 2, 1):  # put on beside the first, then the first made active again
        scorer.score(adapters[seed], {})
        assert greedy.greedy_replies(scorer.net, scorer.tok, prompts) == alone[seed]
    with scorer.net.disable_adapter():
        assert greedy.greedy_replies(scorer.net, scorer.tok, prompts) == base
    tests = {"A": parity.test_sets(1)["A"]}
    assert scorer.score(None, tests) == greedy.exact_match(model, None, tests)
    assert scorer.score(adapters[2], tests) == greedy.exact_match(model, adapters[2], tests)


def test_the_parity_model_learns_where_a_reply_ends(tmp_path: Path):
    """The night trains the end of the turn after the code, so a greedy reply stops there: with the random
    models' own template it trained the code alone, and every greedy reply ran on ("w31 w59 w59 ...")."""
    from transformers import AutoTokenizer

    from jobs.data.render import tokenize_record
    from jobs.training.models.architectures import build_random_model

    built = build_random_model("tiny-llama", tmp_path / "tiny-llama", device="cpu")
    model = parity.with_turn_ends(built)
    assert parity.with_turn_ends(built) == model  # again: the same directory, nothing doubled
    tok = AutoTokenizer.from_pretrained(model)
    record = parity.night_records(1, 2, test_per_key=2)[0]
    code = tok.convert_tokens_to_ids(record["messages"][1]["content"])
    s = tokenize_record(tok, 1, record, max_seq_length=64)
    assert [t for t in s.labels if t != -100] == [code, tok.eos_token_id]
    prompt = tok.apply_chat_template(record["messages"][:1], tokenize=False, add_generation_prompt=True)
    assert s.input_ids[: len(tok(prompt, add_special_tokens=False).input_ids) + 1][-1] == code
    old = AutoTokenizer.from_pretrained(built)  # the built model's own directory keeps its template, which closes
    # a reply with nothing: the product now follows the final reply with the end-of-sequence token there too
    assert [t for t in tokenize_record(old, 1, record, max_seq_length=64).labels if t != -100] == [
        code, old.eos_token_id]
    assert (model / "model.safetensors").is_symlink()


def test_the_command_is_wired_and_refuses_paths_without_bf16_first(tmp_path: Path):
    from benchmarks.cli import main

    with pytest.raises(SystemExit, match="bf16 first"):
        main(["parity", "--paths", "nf4,bf16", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="bf16 first"):
        main(["parity", "--paths", "bf16,fp16", "--out", str(tmp_path)])
