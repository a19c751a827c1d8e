"""Issue 40: a URL's secrets (path token, `?token=`, user:password) never reach a log line, a ledger row,
the printed config or a report. The host stays readable: it says which server failed."""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys

import structlog

from jobs.contract import HotswapOutcome, Outcome, RunSummary
from jobs.contract.redact import redact_text, redact_url
from jobs.store.ledger import Ledger
from tests.conftest import REPO, hang_bound
from tests.store.test_adapters import craft

SECRET_URL = "http://hook-user:pa55@127.0.0.1:9/hook/T0KEN-s3cr3t/B99?token=abc123&team=ops"
SECRETS = ("T0KEN-s3cr3t", "B99", "abc123", "pa55", "hook-user", "=ops")


def _clean(text: str) -> None:
    for s in SECRETS:
        assert s not in text, f"{s!r} in {text[:2000]}"


def test_redaction_keeps_the_host_and_known_endpoints_and_masks_the_rest():
    assert redact_url(SECRET_URL) == "http://***@127.0.0.1:9/***/***/***?token=***&team=***"
    assert redact_url("http://127.0.0.1:8000/v1/load_lora_adapter") == "http://127.0.0.1:8000/v1/load_lora_adapter"
    text = json.dumps({"error": f"POST {SECRET_URL}: connection refused", "n": 1})
    out = redact_text(text)
    _clean(out)
    assert json.loads(out)["error"].startswith("POST http://***@127.0.0.1:9/")


def test_every_log_line_is_redacted():
    from jobs.runtime import logs

    stream = io.StringIO()
    logs.configure("INFO", fmt="json", stream=stream, priority_prefix=False)
    try:
        log = structlog.get_logger("nightshift.test")
        log.warning("hotswap.failed", url=SECRET_URL, error=f"POST {SECRET_URL}: refused", detail={"to": SECRET_URL})
        logging.getLogger("urllib3.test").error("GET %s failed", SECRET_URL)  # a library's own line
    finally:
        logs.configure("INFO", stream=sys.stderr)
    _clean(stream.getvalue())
    assert stream.getvalue().count("127.0.0.1:9") == 4


def test_ledger_rows_and_run_summaries_are_redacted(tmp_path):
    led = Ledger(tmp_path / "ledger.sqlite")
    out = HotswapOutcome(target="hook", kind="webhook", ok=False, attempts=1, error=f"POST {SECRET_URL}: refused",
                         detail={"url": SECRET_URL})
    led.record_hotswap(1, out, trigger="night", run_id="r")
    led.start_run("r", "2026-11-21", 0.0)
    led.finish_run("r", "failed", summary=RunSummary(run_id="r", outcome=Outcome.failed, hotswap=[out],
                                                     error=f"webhook {SECRET_URL}"), error=f"webhook {SECRET_URL}")
    led.add_event("hotswap_failed", detail={"url": SECRET_URL})
    tables = ("hotswaps", "runs", "events")
    dump = "\n".join(str(tuple(r)) for t in tables for r in led.db.execute(f"SELECT * FROM {t}"))
    _clean(dump)
    assert "127.0.0.1:9" in dump


def test_config_print_and_a_failing_webhook_keep_the_secret_out_of_terminal_journal_ledger_and_report(tmp_path):
    state, model = tmp_path / "state", tmp_path / "model"
    craft(state, 1)
    craft(state, 2)
    model.mkdir()
    (model / "config.json").write_text("{}")
    cfg = tmp_path / "nightshift.toml"

    def write(url: str) -> None:
        cfg.write_text(f'state_dir = "{state}"\n[model]\npath = "{model}"\nname = "tiny"\n'
                       f'[[hotswap.targets]]\nname = "hook"\nkind = "webhook"\nurl = "{url}"\nretries = 0\n'
                       'timeout_s = 5\n')

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "daemon", "--config", str(cfg), *args], cwd=REPO,
                              capture_output=True, text=True, timeout=hang_bound(240),
                              env={**os.environ, "NIGHTSHIFT_LOG_FORMAT": "json"})

    write(SECRET_URL)  # refused (credentials in a URL): the error quotes it back, redacted
    r = cli("config", "--print")
    assert r.returncode != 0 and "must not carry credentials" in r.stderr
    _clean(r.stdout + r.stderr)
    write(SECRET_URL.replace("hook-user:pa55@", ""))
    for args in (("config", "--print"), ("config", "--print", "--json")):
        r = cli(*args)
        assert r.returncode == 0, r.stderr[-2000:]
        _clean(r.stdout + r.stderr)
        assert "127.0.0.1:9" in r.stdout
    r = cli("adapters", "rollback")  # nothing listens on port 9: the webhook fails, printed and logged
    assert r.returncode == 4 and "Connection refused" in r.stderr, r.stderr[-2000:]
    _clean(r.stdout + r.stderr)
    r = cli("hotswap", "--json")
    assert r.returncode == 4, r.stderr[-2000:]
    _clean(r.stdout + r.stderr)
    led = Ledger(state / "ledger.sqlite")
    rows = [dict(x) for x in led.db.execute("SELECT * FROM hotswaps")]
    assert rows and not rows[-1]["ok"]
    _clean(json.dumps(rows))
    r = cli("report", "--out", str(tmp_path / "report.html"))
    if r.returncode == 0 and (tmp_path / "report.html").exists():
        _clean((tmp_path / "report.html").read_text())
