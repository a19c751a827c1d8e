"""A model is scored once on a sample: the service adapter, the base and the reference are not re-evaluated
on the regression samples they were scored on in earlier nights (issue 11: fast wake)."""


from jobs.data.batching import TokenizedSample
from jobs.evaluate import SampleScore
from jobs.night.scores import LoadIdentity, ScoreCache
from tests.conftest import alpaca, run, write_jsonl


def test_night_two_scores_only_what_no_model_was_scored_on_before(night_env, monkeypatch):
    import jobs.night.measure as measure

    inbox, make = night_env
    cfg = make(eval={"min_eval_samples": 1}, plan={"heldout_share": 0.2})
    scored: list[list[int]] = []
    real = measure._scores

    def spy(ctx, loaded, samples):
        scored.append([s.sample_id for s in samples])
        return real(ctx, loaded, samples)

    monkeypatch.setattr(measure, "_scores", spy)
    write_jsonl(inbox / "a.jsonl", [alpaca(i) for i in range(30)])
    s1 = run(cfg)
    assert s1["outcome"] == "succeeded" and s1["promoted"]
    scored.clear()

    write_jsonl(inbox / "b.jsonl", [alpaca(i, " please") for i in range(20)])
    s2 = run(cfg, night="2026-11-22")
    assert s2["outcome"] in ("succeeded", "rejected") and s2["parent_version"] == 1
    m1, m2 = s1["metrics"], s2["metrics"]
    # the regression set is night 1's held-out slice: the service adapter (v1) and the base were scored on it
    # then (as the candidate and as the base): their figures come back, exactly, without a forward pass
    assert m2["regression_before"] == m1["heldout_after"] and m2["regression_base"] == m1["heldout_base"]
    assert m2["regression_reference"] == m2["regression_before"]  # the reference is the service
    passes: dict[int, int] = {}
    for ids in scored:
        for sid in ids:
            passes[sid] = passes.get(sid, 0) + 1
    n_regression, n_heldout = int(m2["regression_after"]["samples"]), int(m2["heldout_after"]["samples"])
    assert n_regression > 0 and n_heldout > 0 and len(passes) == n_heldout + n_regression
    # tonight's held-out samples: before, base, after (3 forward passes each); the regression samples: after only
    assert sorted(passes.values()) == [1] * n_regression + [3] * n_heldout


def test_the_base_is_scored_after_training_off_the_first_steps_path(night_env, monkeypatch):
    """Before the first step only the adapter in service is scored on tonight's held-out samples (night 1's new
    adapter not even that); the base (which training does not change) comes after, with the candidate, and
    still serves as night 1's reference."""
    import jobs.night.measure as measure
    import jobs.night.run as night_run

    inbox, make = night_env
    cfg = make(eval={"min_eval_samples": 1}, plan={"heldout_share": 0.2})
    events: list[tuple[str, int]] = []
    real_scores, real_train = measure._scores, night_run.train_candidate

    def scores(ctx, loaded, samples):
        events.append(("score", len(samples)))
        return real_scores(ctx, loaded, samples)

    def train(*a, **kw):
        events.append(("train", 0))
        return real_train(*a, **kw)

    monkeypatch.setattr(measure, "_scores", scores)
    monkeypatch.setattr(night_run, "train_candidate", train)
    write_jsonl(inbox / "a.jsonl", [alpaca(i) for i in range(30)])
    s1 = run(cfg)
    m1 = s1["metrics"]
    assert s1["outcome"] == "succeeded" and m1["heldout_reference"] == m1["heldout_base"]
    # night 1's new adapter adds nothing to the base yet: not scored apart, its figures are the base's
    assert events[0] == ("train", 0) and m1["heldout_before"] == m1["heldout_base"]
    assert s1["losses"]["heldout_before"] == m1["heldout_base"]["loss"]
    events.clear()
    write_jsonl(inbox / "b.jsonl", [alpaca(i, " please") for i in range(20)])
    s2 = run(cfg, night="2026-11-22")
    n_heldout = int(s2["metrics"]["heldout_after"]["samples"])
    at = events.index(("train", 0))
    assert events[:at] == [("score", n_heldout)]  # the service adapter only
    assert sum(n for _, n in events[at + 1:]) >= 2 * n_heldout  # the candidate and the base
    assert s2["metrics"]["heldout_base"] is not None and s2["metrics"]["heldout_reference"] == s2["metrics"][
        "heldout_before"]


IDENT = LoadIdentity(base="/models/x", method="qlora", compute="bf16", backend="unsloth", max_seq_length=512,
                     special_tokens="escape")


def sample(sid: int, ids: list[int]) -> TokenizedSample:
    return TokenizedSample(sid, ids, ids)


def test_the_cache_rescores_a_changed_sample_another_load_and_an_unreadable_file(tmp_path):
    calls: list[list[int]] = []

    def score(samples):
        calls.append([s.sample_id for s in samples])
        return {s.sample_id: SampleScore(float(len(s.input_ids)), len(s.input_ids), False, 1, 0) for s in samples}

    cache = ScoreCache(tmp_path / "cache" / "scores", IDENT)
    a, b = sample(1, [5, 6, 7]), sample(2, [8, 9])
    assert cache.scored("v1", [a, b], score)[1].tokens == 3 and calls == [[1, 2]]
    cache.scored("v1", [a, b], score)
    assert calls == [[1, 2]]  # both kept
    cache.scored("v1", [sample(1, [5, 6, 7, 7]), b], score)  # sample 1 rendered differently: scored again
    assert calls[-1] == [1]
    cache.scored("v2", [a], score)  # another model
    assert calls[-1] == [1]
    other = ScoreCache(tmp_path / "cache" / "scores", IDENT.__class__(**{**IDENT.__dict__, "compute": "fp8"}))
    other.scored("v1", [b], score)  # the same version loaded another way
    assert calls[-1] == [2]
    cache.scored(None, [a], score)  # no lasting identity: always scored, never kept
    cache.scored(None, [a], score)
    assert calls[-2:] == [[1], [1]]
    for f in (tmp_path / "cache" / "scores").glob("v1-*.json"):
        f.write_text("{not json")
    cache.scored("v1", [a], score)
    assert calls[-1] == [1]  # an unreadable file is an empty cache
    assert oct((tmp_path / "cache" / "scores").stat().st_mode & 0o777) == "0o700"
    cache.forget_versions_except({2})
    assert sorted(p.name.split("-")[0] for p in (tmp_path / "cache" / "scores").glob("*.json")) == ["v2"]


def test_a_new_adapter_scores_exactly_as_the_base(tiny_model):
    """Why night 1 takes the base's figures for its `before`: PEFT's LoRA starts with every lora_B zero."""
    import torch

    from jobs.contract import StepShape
    from jobs.evaluate import score_samples
    from jobs.night.measure import _new_adapter
    from jobs.training.config import TrainConfig
    from jobs.training.load import load_for_training

    cfg = TrainConfig(backend="hf", lora_rank=4, lora_alpha=8, max_seq_length=128, gradient_checkpointing=False)
    loaded = load_for_training(tiny_model, cfg, adapter=None,
                               shape=StepShape(tokens_per_step=256, gradient_checkpointing=False, basis="test"))
    model, samples = loaded.model, [sample(i, [5 + i, 9, 11 + i, 7, 3, 8 + i]) for i in range(6)]
    assert _new_adapter(model)
    kw = {"pad_id": 0, "device": "cpu", "max_tokens_per_batch": 512}
    with model.disable_adapter():
        base = score_samples(model, samples, **kw)
    assert score_samples(model, samples, **kw) == base
    with torch.no_grad():
        next(p for n, p in model.named_parameters() if "lora_B" in n)[0, 0] = 0.5
    assert not _new_adapter(model)
