"""DPO: the loss against a hand-computed value, packed log-probabilities equal to one sequence at a time,
and a tiny model's preference moved toward the chosen replies on prompts it never trained on."""

import math
import threading

import pytest

torch = pytest.importorskip("torch")

from jobs.data.preference import normalise_record  # noqa: E402
from jobs.training.preference.dpo import (  # noqa: E402
    dpo_loss,
    packed_row,
    pair_margins,
    pair_rows,
    pairs_from_records,
    sequence_logps,
    train_preference,
)


def test_dpo_loss_matches_a_hand_computed_value():
    # pair 1: policy - ref = (-1 - -2) - (-3 - -2) = 1 - (-1) = 2 -> beta*2 = 0.2
    # pair 2: (-4 - -4) - (-1 - -2) = 0 - 1 = -1 -> -0.1
    loss, rc, rr = dpo_loss(torch.tensor([-1.0, -4.0]), torch.tensor([-3.0, -1.0]),
                            torch.tensor([-2.0, -4.0]), torch.tensor([-2.0, -2.0]), beta=0.1)
    expected = (math.log1p(math.exp(-0.2)) + math.log1p(math.exp(0.1))) / 2  # -log sigmoid(x) = log(1 + e^-x)
    assert float(loss) == pytest.approx(expected, rel=1e-6)
    assert rc.tolist() == pytest.approx([0.1, 0.0]) and rr.tolist() == pytest.approx([-0.1, 0.1])


def _pairs(tokenizer, n, start=0):
    rows = [(i, normalise_record({"prompt": f"Add {i} and {i + 1}.", "chosen": f"{i} + {i + 1} = {2 * i + 1}",
                                  "rejected": "I do not know."}).record) for i in range(start, start + n)]
    pairs, others = pairs_from_records(tokenizer, rows, max_seq_length=128)
    assert not others
    return pairs


@pytest.fixture()
def lora_model(tiny_model):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_model, local_files_only=True, dtype=torch.float32)
    return get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))


def test_packed_log_probs_equal_each_sequence_alone(lora_model, tokenizer):
    pairs = _pairs(tokenizer, 3)
    with torch.no_grad():
        packed = sequence_logps(lora_model, packed_row(pairs), "cpu")
        alone = [float(sequence_logps(lora_model, packed_row([p]), "cpu")[j]) for p in pairs for j in (0, 1)]
    assert packed.tolist() == pytest.approx(alone, abs=1e-4)
    assert all(x < 0 for x in alone)


def test_pairs_are_packed_under_the_token_budget(tokenizer):
    pairs = _pairs(tokenizer, 10)
    budget = 3 * pairs[0].n_tokens
    rows = list(pair_rows(pairs, budget))
    assert [p for r in rows for p in r] == pairs and len(rows) > 1
    assert all(sum(p.n_tokens for p in r) <= budget for r in rows)


def test_a_preference_night_moves_held_out_margins_toward_chosen(lora_model, tokenizer, tmp_path):
    train, held = _pairs(tokenizer, 16), _pairs(tokenizer, 8, start=100)
    before = pair_margins(lora_model, held, "cpu")
    ref = tmp_path / "ref.pt"
    res = train_preference(lora_model, train, beta=0.1, lr=5e-3, epochs=2, tokens_per_step=4 * train[0].n_tokens,
                           deadline=float("inf"), stop=threading.Event(), reference_file=ref)
    after = pair_margins(lora_model, held, "cpu")
    assert res.stopped is None and sorted(res.trained_ids) == [p.sample_id for p in train]
    assert ref.exists() and res.tokens > 0
    shift = sum(after) / len(after) - sum(before) / len(before)
    assert shift > 1.0, (before, after)  # nats of chosen-over-rejected preference on unseen prompts
    assert sum(a > b for a, b in zip(after, before, strict=True)) == len(held)
    assert res.loss_curve[-1][1] < res.loss_curve[0][1]


def test_a_stop_leaves_pairs_not_reached_untrained(lora_model, tokenizer):
    pairs = _pairs(tokenizer, 6)
    stop = threading.Event()
    stop.set()
    res = train_preference(lora_model, pairs, beta=0.1, lr=1e-3, tokens_per_step=pairs[0].n_tokens * 2,
                           deadline=float("inf"), stop=stop)
    assert res.stopped == "signal" and res.trained_ids == [] and res.steps == 0


def test_a_step_that_would_end_past_the_deadline_is_not_begun(lora_model, tokenizer):
    pairs = _pairs(tokenizer, 6)
    now = [0.0]

    def clock():  # every call advances: a step takes several seconds of this clock
        now[0] += 1.0
        return now[0]

    res = train_preference(lora_model, pairs, beta=0.1, lr=1e-3, tokens_per_step=pairs[0].n_tokens * 2,
                           deadline=12.0, stop=threading.Event(), clock=clock)
    assert res.stopped == "deadline" and 0 < res.steps < 3
    assert len(res.trained_ids) == 2 * res.steps  # whole rows only


def test_dpo_on_several_processes_is_refused_by_name():
    from jobs.training.config import TrainConfig

    with pytest.raises(ValueError, match="gpus = 1"):
        TrainConfig(objective="dpo", gpus=2)


def test_the_first_step_of_an_attempt_is_warm_up_in_the_plans_units(lora_model, tokenizer):
    """A first step compiles (Unsloth compiles each block on its first forward): its seconds and its pairs' chosen
    tokens are the run's warm-up, which the recorded rate leaves out and the plan adds back, as the supervised
    loop's (jobs/night/publish.py close_run)."""
    pairs = _pairs(tokenizer, 6)
    now = [0.0]

    def clock():
        now[0] += 1.0
        return now[0]

    budget = pairs[0].n_tokens * 2
    res = train_preference(lora_model, pairs, beta=0.1, lr=1e-3, tokens_per_step=budget, deadline=float("inf"),
                           stop=threading.Event(), clock=clock)
    first = next(pair_rows(pairs, budget))
    assert res.warmup_tokens == sum(p.chosen.n_tokens for p in first) > 0
    assert 0 < res.warmup_seconds < res.seconds


def test_progress_counts_the_plans_units_as_the_summary_does(lora_model, tokenizer):
    """The progress line of a preference night counted both replies: an 8B night showed 982 k tokens at 10 k tok/s
    while its summary and plan said 493 k at 5.1 k (RESULTS.md: 2026-11-28, 8B DPO night). Progress now counts the
    chosen conversations' tokens, two epochs included, and ends at the planned total with an ETA."""
    pairs = _pairs(tokenizer, 6)
    seen = []
    budget = pairs[0].n_tokens * 2
    res = train_preference(lora_model, pairs, beta=0.1, lr=1e-3, epochs=2, tokens_per_step=budget,
                           deadline=float("inf"), stop=threading.Event(), emit=seen.append)
    per_epoch = sum(p.chosen.n_tokens for p in pairs)
    assert [e.tokens for e in seen] == sorted(e.tokens for e in seen)
    assert seen[-1].tokens == seen[-1].planned_tokens == 2 * per_epoch < res.tokens  # res.tokens: both replies
    assert all(e.eta is not None for e in seen) and seen[-1].fraction == 1.0
