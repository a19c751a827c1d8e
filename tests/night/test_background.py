"""The night's model loads while its token ids are read back (issue 11: the wake), in a thread that keeps
the run's logging context and never outlives the block that started it."""

import threading
import time

import pytest
import structlog

from jobs.night.background import in_background
from tests.conftest import alpaca, hang_bound, run, write_jsonl


def test_the_call_keeps_the_callers_context_and_its_error_reaches_the_caller():
    structlog.contextvars.bind_contextvars(run_id="night-7")
    try:
        with in_background(lambda: structlog.contextvars.get_contextvars().get("run_id")) as job:
            pass
        assert job.result() == "night-7"
        with in_background(lambda: 1 / 0) as failing:
            pass
        with pytest.raises(ZeroDivisionError):
            failing.result()
    finally:
        structlog.contextvars.unbind_contextvars("run_id")


def test_leaving_the_block_waits_for_the_call_even_when_the_block_fails():
    done = threading.Event()

    def slow() -> None:
        time.sleep(0.3)
        done.set()

    with pytest.raises(RuntimeError), in_background(slow):
        raise RuntimeError("the caller's own work failed")
    assert done.is_set()


def test_the_token_ids_are_read_while_the_model_loads(night_env, monkeypatch):
    """Fails where the two come one after the other: the load waits (up to 20 s, stretched by the load) for the
    ids to be read, and
    the model loads in the night's own thread (the one that trains: Unsloth patches and compiles there)."""
    import jobs.data.token_cache as token_cache
    import jobs.night.candidate as candidate

    inbox, make = night_env
    ids_read, seen = threading.Event(), []
    real_load, real_samples = candidate.load_for_training, token_cache.TokenCache.samples

    def load(*a, **kw):
        seen.append((ids_read.wait(hang_bound(20)), threading.current_thread() is threading.main_thread()))
        return real_load(*a, **kw)

    def samples(self, *a, **kw):
        out = real_samples(self, *a, **kw)
        ids_read.set()
        return out

    monkeypatch.setattr(candidate, "load_for_training", load)
    monkeypatch.setattr(token_cache.TokenCache, "samples", samples)
    write_jsonl(inbox / "a.jsonl", [alpaca(i) for i in range(30)])
    s = run(make(eval={"min_eval_samples": 1}))
    assert s["outcome"] == "succeeded" and seen == [(True, True)]
    assert s["trained_samples"] > 0


def test_a_loader_with_another_tokenizer_gets_the_ids_of_its_own(night_env, monkeypatch):
    """Read ahead with the base's tokenizer; where the loaded model's tokenizer is another, its own ids count."""
    import jobs.night.candidate as candidate

    inbox, make = night_env
    read_with: list[object] = []
    real_train_set, real_identity = candidate._train_set, candidate._identity

    def train_set(ctx, tokenizer, ids):
        read_with.append(tokenizer)
        return real_train_set(ctx, tokenizer, ids)

    monkeypatch.setattr(candidate, "_train_set", train_set)
    monkeypatch.setattr(candidate, "_identity", lambda ctx, tok: f"{real_identity(ctx, tok)}-{id(tok)}")
    write_jsonl(inbox / "a.jsonl", [alpaca(i) for i in range(30)])
    s = run(make(eval={"min_eval_samples": 1}))
    assert s["outcome"] == "succeeded" and len(read_with) == 2 and read_with[0] is not read_with[1]
