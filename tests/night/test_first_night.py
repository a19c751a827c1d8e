"""The embedded default before its very first night: the demo model is built from whatever the user
dropped in the inbox, so bad input there must neither crash the build nor the night; it is
quarantined like on any other night. `plan` before that night builds nothing in the state."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from jobs.night.run import run_night
from jobs.training.models.tiny import texts_for_tokenizer
from tests.conftest import alpaca, run, write_jsonl

DEEP = b"[" * 100_000  # deeper than any JSON parser recurses


def drop_hidden_bad_input(inbox: Path) -> None:
    write_jsonl(inbox / "good.jsonl", [alpaca(i) for i in range(20)])
    (inbox / "broken.jsonl").write_bytes(b'{"instruction": "a?", "output": "b."}\n{"instruction": "c", "outp\n'
                                         b"\xff\xfe not utf-8\n" + DEEP + b"\n")
    (inbox / "object.json").write_text('{"instruction": "not an array", "output": "x"}')
    (inbox / "truncated.json").write_text('[{"instruction": "a", "output": "b"}, {"instr')
    (inbox / "latin1.json").write_bytes('[{"instruction": "café", "output": "x"}]'.encode("latin-1"))
    (inbox / "empty.jsonl").write_text("")
    (inbox / "a-directory.jsonl").mkdir()


def test_the_tokenizer_corpus_skips_what_it_cannot_read(tmp_path):
    drop_hidden_bad_input(tmp_path)
    texts = texts_for_tokenizer(sorted(tmp_path.iterdir()))
    assert "a?" in texts and "b." in texts and "not an array" in texts and "Add 3 and 4." in texts
    assert not any("café" in t for t in texts)


def test_the_tokenizer_learns_from_a_bounded_share_of_a_large_inbox(tmp_path, monkeypatch):
    """An inbox of gigabytes: the demo tokenizer reads the first `max_chars` of its text, in file order, and
    stops there (a 169 MB inbox at load ~17: build 23.3 s before, 4.3 s after); a `.json` too large to parse
    whole is left to the pull."""
    import jobs.training.models.tiny as tiny

    write_jsonl(tmp_path / "a.jsonl", [alpaca(i) for i in range(50)])
    write_jsonl(tmp_path / "b.jsonl", [alpaca(i) for i in range(50)])
    (tmp_path / "big.json").write_text('[{"instruction": "never read", "output": "x"}]')
    everything = texts_for_tokenizer(sorted(tmp_path.iterdir()))
    assert "never read" in everything
    texts = texts_for_tokenizer(sorted(tmp_path.iterdir()), max_chars=500)
    assert sum(map(len, texts)) == 500 and texts[:-1] == everything[:len(texts) - 1]
    assert everything[len(texts) - 1].startswith(texts[-1])
    monkeypatch.setattr(tiny, "JSON_FILE_MAX_BYTES", 10)
    assert "never read" not in texts_for_tokenizer(sorted(tmp_path.iterdir()))


def test_first_night_of_the_demo_quarantines_hidden_bad_input(night_env, tmp_path):
    inbox, make = night_env
    drop_hidden_bad_input(inbox)
    state = tmp_path / "state"
    cfg = make(model={"path": state / "models" / "tiny-llama", "name": "tiny", "build": "tiny-llama"})

    # a plan before the first night: the model is built in a temporary directory, the state is not made
    plan = run_night(cfg, night="plan", deadline=time.time() + 3600, emit=lambda _: None, stop=threading.Event(),
                     plan_only=True)
    # 20 good records, the first line of broken.jsonl and the first element of truncated.json (arrays are
    # read element by element: the cut-off tail is quarantined alone)
    assert plan.plan is not None and len(plan.plan.train_ids) + len(plan.plan.heldout_ids) == 22
    assert plan.quarantined == {"invalid_json": 2, "invalid_utf8": 2, "too_large": 1, "bad_file": 1}
    assert not state.exists()

    s = run(cfg)
    assert s["outcome"] == "succeeded", s["error"]
    assert (state / "models" / "tiny-llama" / "tokenizer.json").exists()
    assert s["trained_samples"] + s["heldout_samples"] == 22
    [qfile] = (state / "quarantine").glob("*.jsonl")
    got = {(Path(x["file"]).name, x["line"]): x["reason"] for x in map(json.loads, qfile.read_text().splitlines())}
    assert got == {("broken.jsonl", 2): "invalid_json", ("broken.jsonl", 3): "invalid_utf8",
                   ("broken.jsonl", 4): "too_large", ("object.json", None): "bad_file",  # DEEP: nested too deep
                   ("truncated.json", 1): "invalid_json", ("latin1.json", 1): "invalid_utf8"}
    assert s["quarantined"] == plan.quarantined  # the plan said what the night would quarantine


def test_the_tokenizer_corpus_holds_no_huge_line_and_no_huge_word(tmp_path, monkeypatch):
    """A hostile inbox before the first night: a JSONL line longer than LINE_MAX_BYTES is skipped unread (it was
    read whole into memory, then parsed), and a run of characters without a space is cut into words of at most
    WORD_MAX_CHARS (BPE training is quadratic in a word's length: a record holding a 4 MB word stalled the demo
    model's build, and `plan`, for hours)."""
    import jobs.training.models.tiny as tiny

    monkeypatch.setattr(tiny, "LINE_MAX_BYTES", 4096)
    with open(tmp_path / "a.jsonl", "w") as f:
        f.write(json.dumps({"instruction": "huge", "output": "h" * 50_000}) + "\n")  # skipped: over the cap
        f.write(json.dumps({"instruction": "word", "output": "w" * 3000}) + "\n")  # kept, cut into words
        f.write(json.dumps(alpaca(1)) + "\n")
    texts = texts_for_tokenizer([tmp_path / "a.jsonl"])
    assert "huge" not in texts and "Add 1 and 2." in texts
    [word] = [t for t in texts if t.startswith("www")]
    assert word.replace(" ", "") == "w" * 3000
    assert max(len(w) for t in texts for w in t.split()) <= tiny.WORD_MAX_CHARS
