"""A model is scored once on a sample: the service adapter, the base and the reference are not re-evaluated
on the regression samples they were scored on in earlier nights (issue 11: fast wake)."""


from jobs.data.batching import TokenizedSample
from jobs.learning.evaluate import SampleScore
from jobs.night.scores import LoadIdentity, ScoreCache
from tests.conftest import alpaca, run, write_jsonl
from tests.fixtures.night_events import StopAtProgress


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
    n_regression, n_heldout = int(m2["regression_after"]["samples"]), s2["heldout_samples"]
    n_retention = int(m2["retention_after"]["samples"])  # v1's trained samples: scored by no model before
    n_new = int(m2["tonight_after"]["samples"])  # tonight's new training samples: did the night learn?
    # the held-out set is tonight's topped up with night 1's (issue 39), which are the regression samples
    assert m2["heldout_after"]["samples"] == n_heldout + n_regression
    assert n_regression > 0 and n_heldout > 0 and n_retention > 0
    assert len(passes) == n_heldout + n_regression + n_retention + n_new
    # tonight's held-out and new samples: before, base, after (3 forward passes each); the retention set (v1's
    # trained samples, scored by the base on night 1 as that night's new samples): before and after; the
    # regression samples: the candidate only (once in each set: a candidate's scores are not kept until it is
    # published)
    assert sorted(passes.values()) == [2] * (n_regression + n_retention) + [3] * (n_heldout + n_new)


def test_every_model_is_scored_after_training_off_the_first_steps_path(night_env, monkeypatch):
    """Nothing is scored before the first step: the base (which training does not change) comes after, with
    the candidate, and still serves as night 1's reference; the adapter in service is scored after too, its
    weights loaded into the trained adapter for the pass and the candidate's put back (what is published)."""
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
    assert events[0] == ("train", 0)
    n_regression = int(s2["metrics"]["regression_after"]["samples"])
    n_retention = int(s2["metrics"]["retention_after"]["samples"])
    n_new = int(s2["metrics"]["tonight_after"]["samples"])
    # the candidate on every set (the held-out pooled with night 1's), then the base on tonight's own held-out
    # and new samples (its scores of night 1's kept, v1's trained samples among them), the service on those and
    # on the retention set (v1's trained samples)
    tonight = s2["heldout_samples"]
    assert [n for _, n in events[1:]] == [n_heldout, n_regression, n_retention, n_new, tonight, n_new, tonight,
                                          n_retention, n_new] and n_heldout > tonight
    m2 = s2["metrics"]
    assert m2["heldout_reference"] == m2["heldout_before"] and m2["heldout_before"] != m2["heldout_after"]


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
    from jobs.learning.evaluate import score_samples
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


def test_the_service_scored_after_training_is_the_service_and_the_candidate_is_put_back(tiny_model, tmp_path):
    """The adapter in service is scored after training by loading its file's weights into the trained adapter:
    its scores must be those of the service loaded as a night loads it, and the candidate's weights (what is
    published) must come back bit for bit."""
    import torch

    from jobs.contract import StepShape
    from jobs.learning.evaluate import score_samples
    from jobs.night.measure import _run_swapped
    from jobs.training.config import TrainConfig
    from jobs.training.load import load_for_training

    cfg = TrainConfig(backend="hf", lora_rank=4, lora_alpha=8, max_seq_length=128, gradient_checkpointing=False)
    shape = StepShape(tokens_per_step=256, gradient_checkpointing=False, basis="test")
    samples = [sample(i, [5 + i, 9, 11 + i, 7, 3, 8 + i]) for i in range(6)]
    kw = {"pad_id": 0, "device": "cpu", "max_tokens_per_batch": 512}
    model = load_for_training(tiny_model, cfg, adapter=None, shape=shape).model
    torch.manual_seed(0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    service = tmp_path / "v1"
    model.save_pretrained(service)
    expected = score_samples(load_for_training(tiny_model, cfg, adapter=service, shape=shape).model, samples, **kw)
    with torch.no_grad():  # "training": the candidate moves away from the service
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.add_(0.25)
    candidate = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    got: dict = {}
    assert _run_swapped(None, model, service, "before", lambda: got.update(score_samples(model, samples, **kw)), None)
    assert got == expected
    assert all(torch.equal(p, candidate[n]) for n, p in model.named_parameters() if "lora_" in n)
    assert score_samples(model, samples, **kw) != expected


def test_a_resumed_night_two_still_scores_the_adapter_in_service_after_training(night_env):
    """What the first attempt owed (the service's scores) is kept beside its checkpoints: the attempt that
    resumes from them measures it after training, against the service's own file."""
    import json
    import threading

    inbox, make = night_env
    # no periodic save (the interval stays the default's): the stop's own checkpoint is the one resumed from.
    # A save every 0.001 s made night 1's measured save time part of night 2's plan (one save a millisecond of
    # training): on a loaded box that plan fitted no sample and the night ended `skipped`, never started
    cfg = make(eval={"min_eval_samples": 1}, plan={"heldout_share": 0.2}, train={"batch_size": 4, "epochs": 2})
    write_jsonl(inbox / "a.jsonl", [alpaca(i) for i in range(30)])
    assert run(cfg)["promoted"]
    write_jsonl(inbox / "b.jsonl", [alpaca(i, " please") for i in range(20)])
    stop = threading.Event()
    first = run(cfg, night="2026-11-22", stop=stop, events=StopAtProgress(stop))
    assert first["outcome"] == "interrupted" and first["metrics"].get("heldout_before") is None
    assert first["steps"] == 1 and first["stopped"] == "signal"  # stopped by the event, after one step
    kept = json.loads(next((cfg.state_dir / "checkpoints").glob("*/before.json")).read_text())
    assert kept["owed"] == ["before"] and kept["metrics"] == {}
    second = run(cfg, night="2026-11-22")
    m = second["metrics"]
    assert second["outcome"] in ("succeeded", "rejected") and second["run_id"] == first["run_id"]
    assert m["heldout_before"]["samples"] == m["heldout_after"]["samples"] > 0
    assert m["heldout_reference"] == m["heldout_before"] != m["heldout_after"]


def test_a_service_file_damaged_since_the_load_costs_its_figures_not_the_night_nor_the_candidate(tiny_model,
                                                                                               tmp_path):
    """Scored after training, the service's file may be gone or damaged since the night loaded it: its figures
    are reported missing, the candidate's weights (what is published) stay as trained."""
    import types

    import torch

    from jobs.contract import StepShape
    from jobs.night.measure import _run_swapped
    from jobs.training.config import TrainConfig
    from jobs.training.load import load_for_training

    cfg = TrainConfig(backend="hf", lora_rank=4, lora_alpha=8, max_seq_length=128, gradient_checkpointing=False)
    model = load_for_training(tiny_model, cfg, adapter=None,
                              shape=StepShape(tokens_per_step=256, gradient_checkpointing=False, basis="test")).model
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.add_(0.25)
    trained = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    damaged = tmp_path / "v1"
    damaged.mkdir()
    (damaged / "adapter_model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{not a header")
    ctx = types.SimpleNamespace(summary=types.SimpleNamespace(not_evaluated={}))
    ran: list[int] = []
    for path in (damaged, tmp_path / "gone"):
        assert not _run_swapped(ctx, model, path, "before", lambda: ran.append(1), {"heldout": [], "regression": []})
    assert ran == [] and set(ctx.summary.not_evaluated) == {"heldout_before", "regression_before"}
    assert all(torch.equal(p, trained[n]) for n, p in model.named_parameters() if "lora_" in n)
