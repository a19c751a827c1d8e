"""The loop closed on the CPU: replies served through the capture path, users choose between two replies,
the feedback lands in the inbox, a preference night trains from it, and the promoted version prefers the
chosen kind of reply on prompts it never saw (its chosen-vs-rejected log-prob margin moved up against the
version that was in service). The upstream is a small local OpenAI-compatible server (tests/capture/upstream.py):
the real vLLM of the real-server tests is not on this branch."""

from __future__ import annotations

import json
import threading
import time

import pytest

from jobs.capture.config import CaptureConfig
from jobs.capture.server import CaptureServer
from tests.capture.test_capture import call, chat
from tests.capture.upstream import upstream
from tests.conftest import alpaca, hang_bound, run, write_jsonl

torch = pytest.importorskip("torch")


def answer(messages, n):  # every prompt is asked twice: a right answer, then a useless one
    q = messages[-1]["content"]
    i = int(q.split()[1])
    return f"{i} + {i + 1} = {2 * i + 1}" if n % 2 else "I do not know."


def margins(tiny_model, adapter, tokenizer, prompts):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from jobs.data.preference import normalise_record
    from jobs.training.preference.dpo import pair_margins, pairs_from_records

    base = AutoModelForCausalLM.from_pretrained(tiny_model, local_files_only=True, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, adapter)
    rows = [(i, normalise_record({"prompt": f"Add {i} and {i + 1}.", "chosen": f"{i} + {i + 1} = {2 * i + 1}",
                                  "rejected": "I do not know."}).record) for i in prompts]
    pairs, _ = pairs_from_records(tokenizer, rows, max_seq_length=128)
    return pair_margins(model, pairs, "cpu")


@pytest.mark.slow
def test_capture_feedback_preference_night_and_a_shift_on_unseen_prompts(night_env, tmp_path, tiny_model, tokenizer):
    inbox, make = night_env
    write_jsonl(inbox / "sft.jsonl", [alpaca(i) for i in range(200, 206)])
    first = run(make())
    assert first["outcome"] == "succeeded" and first["version_name"] == "tiny-v0001", first["error"]

    cfg = CaptureConfig(upstream="http://127.0.0.1:1", inbox=inbox, state=tmp_path / "capture", port=0,
                        feedback_per_second=1000, captures_per_second=1000)
    with upstream(answer, model="tiny-v0001") as up:
        srv = CaptureServer(cfg.model_copy(update={"upstream": up}))
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        try:
            for i in range(40):
                good = json.loads(chat(srv.address, f"Add {i} and {i + 1}.")[1])["id"]
                bad = json.loads(chat(srv.address, f"Add {i} and {i + 1}.")[1])["id"]
                deadline = time.monotonic() + hang_bound(60)
                while bad not in srv.store.held:
                    assert time.monotonic() < deadline
                    time.sleep(0.01)
                status, body, _ = call(srv.address, "POST", "/nightshift/feedback", {"chosen": good, "rejected": bad})
                assert status == 200, body
            assert srv.store.held[bad].version == 1  # the served version is recorded
        finally:
            srv.shutdown()

    night = run(make(train={"objective": "dpo", "learning_rate": 5e-3, "epochs": 2},
                     plan={"prior_tokens_per_second": 2000, "prior_overhead_seconds": 0, "heldout_share": 0.2}),
                night="2026-11-22")
    assert night["outcome"] == "succeeded" and night["promoted"], night["error"]
    assert night["version_name"] == "tiny-v0002" and night["preference_pairs"] >= 30
    state = tmp_path / "state"
    unseen = range(100, 110)
    before = margins(tiny_model, state / "adapters" / "tiny-v0001", tokenizer, unseen)
    after = margins(tiny_model, (state / "current").resolve(), tokenizer, unseen)
    assert (state / "current").resolve().name == "tiny-v0002"
    shift = [a - b for a, b in zip(after, before, strict=True)]
    assert min(shift) > 0 and sum(shift) / len(shift) > 1.0, shift  # nats toward the chosen kind of reply
