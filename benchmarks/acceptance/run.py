"""`python -m benchmarks acceptance`: the workstation night, proven end to end on one card.

1. builds (or takes) the model: a random-initialised real architecture (jobs/training/models/architectures.py)
   on a GPU, the tiny demo Llama on a CPU;
2. starts a long-lived inference server on the same card (benchmarks/acceptance/server.py) holding a
   share of its memory, serving the base model and, from night 1 on, the adapter in service; a
   client asks it twice a second for the newest adapter (nightshift's newest_name_file) all along;
3. runs `nightshift calibrate` (where the GPU path exists) under the memory the server left;
4. runs the real daemon (`nightshift run`) through N short windows, new data dropped before each,
   nightshift hot-swapping every promoted version into the server through the vLLM API; in night 2
   the daemon and its child are SIGKILLed mid-training and the daemon is started again;
5. checks, and writes <--out>/<gpu>-<date>/acceptance.json and acceptance.md (benchmarks/acceptance/checks.py).

Nothing here imports torch: the model is built in a child, the server and the nights are children,
so this process holds no GPU memory. Progress is printed as it goes.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import math
import os
import random
import shutil
import signal
import subprocess
import tempfile
import time
import zoneinfo
from pathlib import Path
from typing import Any

from benchmarks.acceptance import checks
from benchmarks.acceptance.procs import (
    PROMPT,
    CardSampler,
    Client,
    Ledger,
    Proc,
    http,
    pid_alive,
    python,
    wait_for,
)
from benchmarks.acceptance.zones import next_night, write_zone

REPO = Path(__file__).resolve().parents[2]
FINAL = ("succeeded", "rejected", "failed", "skipped")
T0 = time.time()


def say(msg: str) -> None:
    print(f"[acceptance {time.time() - T0:6.1f} s] {msg}", flush=True)


def has_gpu() -> bool:
    from jobs.gpu.telemetry import free_vram_gb

    return free_vram_gb(0) is not None


def build_parser() -> argparse.ArgumentParser:
    gpu = has_gpu()
    ap = argparse.ArgumentParser(prog="python -m benchmarks acceptance", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="llama3.2-1b" if gpu else "tiny",
                    help="random-initialised architecture (jobs/training/models/architectures.py) or 'tiny' "
                    "(the CPU demo model); default: %(default)s")
    ap.add_argument("--model", type=Path, help="an existing local model directory instead of --arch")
    ap.add_argument("--models-dir", type=Path, default=Path(os.environ.get("NIGHTSHIFT_BENCH_MODELS",
                                                                          "/tmp/nightshift-models")))
    ap.add_argument("--work", type=Path, help="state, inbox, configs, logs (default: a new temp dir)")
    ap.add_argument("--out", type=Path, default=REPO / "results", help="<gpu>-<date>/ goes here")
    ap.add_argument("--nights", type=int, default=3)
    ap.add_argument("--window-minutes", type=float, default=2.0 if gpu else 1.5)
    ap.add_argument("--save-margin-minutes", type=float, default=0.4 if gpu else 0.25,
                    help="the window's end minus this is the training deadline (evaluate, publish, hot-swap after)")
    ap.add_argument("--fill", type=float, default=0.6,
                    help="data per night: this share of a window's training capacity (from the calibration)")
    ap.add_argument("--samples-per-night", type=int, default=0 if gpu else 80, help="fixed size instead of --fill")
    ap.add_argument("--server-share", type=float, default=0.25, help="share of the card's memory the server holds")
    ap.add_argument("--kill-night", type=int, default=2, help="SIGKILL daemon + child mid-training in this night "
                    "(0: never)")
    ap.add_argument("--grow-gb", type=float, default=0.0,
                    help="the server grabs this much more memory mid-training of the last night (OOM halving)")
    ap.add_argument("--prewarm-seconds", type=float, default=40.0 if gpu else 2.0,
                    help="each daemon starts this long before its window opens ([window] prewarm_seconds: the "
                    "night's process imports before the opening)")
    ap.add_argument("--calibrate-seconds", type=float, default=6.0)
    ap.add_argument("--calibrate-checkpointing-line", action="store_true",
                    help="let calibrate reload the model to measure the checkpointing line (slower)")
    ap.add_argument("--max-seq-length", type=int, default=512)
    ap.add_argument("--epochs", type=int, default=1 if gpu else 2)
    ap.add_argument("--prior-tokens-per-second", type=float, default=5000.0 if gpu else 2000.0)
    ap.add_argument("--verify-outputs", action=argparse.BooleanOptionalAction, default=not gpu,
                    help="recompute each served version's outputs here with PEFT (CPU-sized models)")
    return ap


# ---- model and data ----------------------------------------------------------------------------------


def build_model(a: argparse.Namespace, work: Path) -> Path:
    if a.model is not None:
        return a.model
    if a.arch == "tiny":
        path = work / "models" / "tiny-llama"
        corpus = sorted((REPO / "config" / "sample-inbox").glob("*.json*"))
        code = ("import sys; from pathlib import Path; from jobs.training.models.tiny import build_tiny_llama; "
                "build_tiny_llama(Path(sys.argv[1]), [Path(p) for p in sys.argv[2:]])")
        subprocess.run([python(), "-c", code, str(path), *map(str, corpus)], check=True, cwd=REPO)
        return path
    path = a.models_dir / a.arch
    result = work / "model.json"
    subprocess.run([python(), "-m", "benchmarks.model", "--path", str(path), "--result", str(result),
                    "--arch", a.arch], check=True, cwd=REPO)
    return path


def data_mode(model: Path) -> str:
    """Random-initialised architectures have a word-level tokenizer over w0..w255."""
    return "words" if (model / "nightshift_random.json").exists() else "text"


def records(mode: str, n: int, seed: int) -> list[dict[str, str]]:
    r = random.Random(seed)
    out = []
    for i in range(n):
        if mode == "words":
            q = " ".join(f"w{r.randrange(256)}" for _ in range(r.randint(10, 60)))
            ans = " ".join(f"w{r.randrange(256)}" for _ in range(r.randint(10, 80)))
            out.append({"instruction": f"{q} n{seed}x{i}", "output": ans})
        else:
            x, y = r.randint(0, 10**6), r.randint(0, 10**6)
            out.append({"instruction": f"Compute {x} plus {y}. (#{seed}-{i})", "output": f"{x} + {y} = {x + y}."})
    return out


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    os.replace(tmp, path)


# ---- the config of one night ---------------------------------------------------------------------------


def config(a: argparse.Namespace, work: Path, model: Path, *, zone: str, start: str, end: str, server: str,
           gpu: bool, kill: bool = False) -> str:
    # the night that is killed checkpoints every second: a checkpoint to resume from, soon (a GPU night
    # of these windows trains for seconds only; a CPU night about one second: every 0.25 s there)
    ckpt = 0.25 if not gpu else 1.0 if kill else a.window_minutes * 60 / 8
    return f"""# acceptance run: one window of {a.window_minutes:g} min in zone {zone}
state_dir = "{work / 'state'}"
[model]
path = "{model}"
name = "acc"
[[sources]]
name = "inbox"
inbox = "{work / 'inbox'}"
settle_seconds = 0
[plan]
prior_tokens_per_second = {a.prior_tokens_per_second}
prior_overhead_seconds = {20 if gpu else 5}
heldout_share = 0.05
replay_share = 0.1
[train]
backend = "auto"
batching = "{'packed' if gpu else 'padded'}"
lora_rank = 16
lora_alpha = 16
learning_rate = 1e-3
epochs = {a.epochs}
max_seq_length = {a.max_seq_length}
checkpoint_every_seconds = {ckpt:g}
gradient_checkpointing = {'"auto"' if gpu else 'false'}
[eval]
regression_set = "{work / 'regression.jsonl'}"
max_regression_increase_pct = 50.0   # the system is on trial, not the random model: every night promotes
max_eval_samples = {64 if gpu else 16}
[window]
start = "{start}"
end = "{end}"
timezone = "{zone}"
save_margin_minutes = {a.save_margin_minutes}
min_run_minutes = {min(0.2, a.window_minutes / 4):g}
prewarm_seconds = {a.prewarm_seconds:g}
[daemon]
stop_grace_seconds = 20
max_attempts = 3
retry_backoff_seconds = 2
min_free_disk_gb = 1
[gpu]
sample_hz = 2
[metrics]
port = 0
[hotswap]
newest_name_file = "{work / 'newest-adapter'}"
[[hotswap.targets]]
kind = "vllm"
name = "acceptance-server"
base_url = "{server}"
keep_loaded = 2
timeout_s = 60
retries = 2
backoff_s = 1
"""


# ---- one night -------------------------------------------------------------------------------------------


def daemon(cfg: Path, work: Path, k: int, attempt: int, env: dict[str, str]) -> Proc:
    d = Proc([python(), "-m", "daemon", "--config", str(cfg), "run"], log=work / "logs" / f"daemon-{k}-{attempt}.log",
             env=env, cwd=REPO)
    say(f"night {k}: daemon started (pid {d.pid})")
    return d


def scrape(d: Proc) -> dict[str, float]:
    """The daemon's /metrics as {series{labels}: value} (once it serves)."""
    url = wait_for(lambda: (d.events("metrics_serving") or [{}])[-1].get("url"), 60, "the metrics endpoint")
    status, text = http("GET", url)
    out = {}
    for line in str(text).splitlines() if status == 200 else []:
        if line.startswith("nightshift_") and " " in line:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def open_run(ledger: Ledger, night: str) -> dict[str, Any] | None:
    runs = ledger.runs(night)
    return runs[-1] if runs else None


def run_night(a: argparse.Namespace, k: int, work: Path, model: Path, server_url: str, env: dict[str, str],
              after: dt.date | None, ledger: Ledger, gpu: bool) -> dict[str, Any]:
    start = dt.datetime.now(dt.UTC).replace(microsecond=0) + dt.timedelta(seconds=max(3.0, a.prewarm_seconds))
    end = start + dt.timedelta(minutes=a.window_minutes)
    day, offset = next_night(start, after)
    zone = write_zone(work / "tz", f"night{k}", offset)
    z = dt.timezone(dt.timedelta(seconds=offset))
    cfg = work / f"night{k}.toml"
    cfg.write_text(config(a, work, model, zone=zone, start=start.astimezone(z).strftime("%H:%M:%S"),
                          end=end.astimezone(z).strftime("%H:%M:%S"), server=server_url, gpu=gpu,
                          kill=k == a.kill_night))
    night = day.isoformat()
    info: dict[str, Any] = {"night": k, "key": night, "zone": zone, "window_start": start.timestamp(),
                            "window_end": end.timestamp(), "attempts": 1, "children": []}
    say(f"night {k} ({night} in {zone}): window {start:%H:%M:%S}-{end:%H:%M:%S} UTC")
    d = daemon(cfg, work, k, 1, env)
    watch = ChildWatch(lambda: d)
    info["restored_series_at_start"] = sorted(n for n in scrape(d) if n.startswith("nightshift_last_run_"))
    if k == a.kill_night:
        d = kill_mid_training(a, k, work, cfg, d, ledger, night, info, env, watch)
    if k == a.nights and a.grow_gb > 0:
        grow_mid_training(a, k, work, ledger, night, server_url, info)
    deadline = end.timestamp() + 60
    while time.time() < deadline:
        run = open_run(ledger, night)
        if run is not None and run["status"] in FINAL:
            break
        if not d.alive():
            break
        time.sleep(0.2)
    wait_for(lambda: not watch.alive(), 60, "the night's child to exit")
    watch.stop()
    info["children"], info["child_last_seen_alive"] = sorted(watch.pids), watch.last_alive
    prewarmed = d.events("prewarmed")  # the child that started before the opening: its import, its wait
    info["prewarmed"] = prewarmed[-1] if prewarmed else None
    info["metrics_after"] = {n: v for n, v in scrape(d).items() if n.startswith("nightshift_last_run_")}
    info["daemon_exit"] = d.stop(signal.SIGTERM, timeout=90)
    info["run"] = open_run(ledger, night)
    status = (info["run"] or {}).get("status")
    say(f"night {k}: {status}; daemon stopped (exit {info['daemon_exit']})")
    return info


class ChildWatch:
    """Every child the night's daemon started, and the last moment one of them was alive (5 Hz)."""

    def __init__(self, daemon_now: Any) -> None:
        import threading

        self.daemon_now, self.pids, self.last_alive = daemon_now, set(), None
        self._stop = threading.Event()
        threading.Thread(target=self._loop, daemon=True).start()

    def alive(self) -> bool:
        self.pids |= {e["pid"] for e in self.daemon_now().events("child_started")}
        up = any(pid_alive(p) for p in self.pids)
        if up:
            self.last_alive = time.time()
        return up

    def _loop(self) -> None:
        while not self._stop.wait(0.2):
            self.alive()

    def stop(self) -> None:
        self._stop.set()


def kill_mid_training(a: argparse.Namespace, k: int, work: Path, cfg: Path, d: Proc, ledger: Ledger, night: str,
                      info: dict[str, Any], env: dict[str, str], watch: ChildWatch) -> Proc:
    """SIGKILL the daemon and its child once the run has a checkpoint, then start the daemon again."""
    def checkpoint() -> dict[str, Any] | None:
        """The latest checkpoint's state, read at once: the next checkpoint renames it away (every 0.25 s
        on a CPU), and a CPU night trains for seconds, so the kill follows right after."""
        run = open_run(ledger, night)
        if run is None or run["status"] != "running":
            return None
        return _read_json(work / "state" / "checkpoints" / run["id"] / "latest" / "state.json")

    try:
        state = wait_for(checkpoint, a.window_minutes * 60, "a checkpoint of night 2's training", poll=0.05)
    except TimeoutError as e:
        info["kill"] = {"done": False, "why": str(e)}
        say(f"night {k}: no checkpoint to kill after ({e})")
        return d
    children = [e["pid"] for e in d.events("child_started")]
    for pid in [*children, d.pid]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    d.p.wait(timeout=30)
    info["kill"] = {"done": True, "at": time.time(), "checkpoint_next_batch": state.get("next_batch"),
                    "killed_pids": [*children, d.pid]}
    info["attempts"] = 2
    say(f"night {k}: SIGKILLed daemon {d.pid} and child {children} (checkpoint at batch {state.get('next_batch')}); "
        "starting the daemon again")
    d2 = daemon(cfg, work, k, 2, env)
    watch.pids |= set(children)
    watch.daemon_now = lambda: d2
    info["restored_series_after_kill"] = sorted(n for n in scrape(d2) if n.startswith("nightshift_last_run_"))
    return d2


def grow_mid_training(a: argparse.Namespace, k: int, work: Path, ledger: Ledger, night: str, server: str,
                      info: dict[str, Any]) -> None:
    def training() -> bool:
        run = open_run(ledger, night)
        return bool(run) and any(p["phase"] == "train" for p in ledger.phases(run["id"]))

    try:
        wait_for(training, a.window_minutes * 60, "night training")
    except TimeoutError:
        return
    time.sleep(2)
    status, body = http("POST", server + "/admin/grow", {"gb": a.grow_gb})
    info["server_grew"] = {"gb": a.grow_gb, "status": status, "ballast_bytes": (body or {}).get("ballast_bytes")}
    say(f"night {k}: the server grew by {a.grow_gb:g} GB mid-training")


# ---- the whole run --------------------------------------------------------------------------------------


def calibrate(a: argparse.Namespace, work: Path, cfg: Path, env: dict[str, str]) -> dict[str, Any]:
    argv = [python(), "-m", "daemon", "--config", str(cfg), "calibrate", "--seconds", str(a.calibrate_seconds),
            "--out", str(work / "calibrate")]
    if not a.calibrate_checkpointing_line:
        argv.append("--no-checkpointing-line")
    t0 = time.time()
    r = subprocess.run(argv, cwd=REPO, env={**os.environ, **env}, capture_output=True, text=True)
    (work / "logs").mkdir(parents=True, exist_ok=True)
    (work / "logs" / "calibrate.log").write_text(r.stdout + r.stderr)
    out: dict[str, Any] = {"exit": r.returncode, "seconds": round(time.time() - t0, 1)}
    f = work / "calibrate" / "calibration.json"
    if r.returncode == 0 and f.exists():
        out["record"] = json.loads(f.read_text())
    else:
        out["skipped" if r.returncode == 2 else "error"] = (r.stderr.strip().splitlines() or ["?"])[-1][:500]
    return out


MIN_TRAIN_SECONDS = 20.0  # a window that leaves less trains nothing worth checking: every night would skip


def training_seconds(a: argparse.Namespace, rec: dict[str, Any]) -> float:
    """What a window leaves for training after the save margin, the calibrated overheads and the wake."""
    return a.window_minutes * 60 - a.save_margin_minutes * 60 - (rec.get("overhead_seconds") or 30) - 25


def too_short(a: argparse.Namespace, cal: dict[str, Any]) -> str | None:
    """Why the windows cannot train on this card (None: they can). An H100 run of 1.75-minute windows once
    skipped every night: its calibrated overheads (load 43 s) left nothing before the training deadline."""
    rec = cal.get("record")
    left = training_seconds(a, rec) if rec else MIN_TRAIN_SECONDS
    if left >= MIN_TRAIN_SECONDS:
        return None
    need = (MIN_TRAIN_SECONDS - left) / 60 + a.window_minutes
    return (f"--window-minutes {a.window_minutes:g} leaves {left:.0f} s of training on this card "
            f"(save margin {a.save_margin_minutes * 60:.0f} s, calibrated overheads {rec.get('overhead_seconds')} s, "
            f"25 s to wake): every night would skip; use --window-minutes {math.ceil(need * 4) / 4:g} or more")


def night_size(a: argparse.Namespace, cal: dict[str, Any], mode: str) -> int:
    if a.samples_per_night:
        return a.samples_per_night
    rec = cal.get("record")
    if not rec:
        return 400
    tps = min(rec["tokens_per_second"].values())
    train_s = training_seconds(a, rec)
    per_record = 75 if mode == "words" else 30  # tokens, template included
    return max(50, int(a.fill * max(10.0, train_s) * tps / per_record / max(1, a.epochs)))


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    gpu = has_gpu()
    work = a.work or Path(tempfile.mkdtemp(prefix="nightshift-acceptance-"))
    work.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(work / "state", ignore_errors=True)
    (work / "inbox").mkdir(exist_ok=True)
    say(f"work dir {work}; {'GPU' if gpu else 'CPU'} run, {a.nights} windows of {a.window_minutes:g} min")
    card = CardSampler()
    model = build_model(a, work)
    mode = data_mode(model)
    say(f"model {model} ({mode} data)")
    write_jsonl(work / "regression.jsonl", records(mode, 32, seed=999))
    # the repository first, then whatever the caller's PYTHONPATH holds (an install --target on a GPU box)
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = {"PYTHONTZPATH": os.pathsep.join([str(work / "tz"), *zoneinfo.TZPATH]), "PYTHONPATH": path}
    server = Proc([python(), "-m", "benchmarks.acceptance.server", "--model", str(model), "--port-file",
                   str(work / "server.port"), "--hold-fraction", str(a.server_share if gpu else 0)],
                  log=work / "logs" / "server.log", env=env, cwd=REPO)
    port = wait_for(lambda: (work / "server.port").exists() and (work / "server.port").read_text(), 300,
                    "the inference server")
    url = f"http://127.0.0.1:{port}"
    say(f"server up at {url} (pid {server.pid}): {http('GET', url + '/stats')[1]}")
    (work / "newest-adapter").unlink(missing_ok=True)
    client = Client(url, work / "newest-adapter", PROMPT[mode])
    client.start()
    ledger = Ledger(work / "state" / "ledger.sqlite")
    nights: list[dict[str, Any]] = []
    cal: dict[str, Any] = {}
    try:
        probe_cfg = work / "calibrate.toml"
        probe_cfg.write_text(config(a, work, model, zone="UTC", start="00:00", end="23:00", server=url, gpu=gpu))
        say("nightshift calibrate ...")
        cal = calibrate(a, work, probe_cfg, env)
        say(f"calibrate: exit {cal['exit']} in {cal['seconds']} s "
            f"{cal.get('skipped') or cal.get('error') or json.dumps(cal['record']['tokens_per_second'])}")
        short = too_short(a, cal)
        if short:
            say(f"stopping: {short}")
            return 2
        n = night_size(a, cal, mode)
        after = None
        for k in range(1, a.nights + 1):
            # the killed night: on a GPU half (its restart pays the wake again and must still finish in the
            # window); on a CPU twice (its training lasts seconds: long enough to be killed mid-way)
            m = (n // 2 if gpu else 2 * n) if k == a.kill_night else n
            write_jsonl(work / "inbox" / f"night-{k}.jsonl", records(mode, m, seed=k))
            say(f"night {k}: dropped {m} new records")
            info = run_night(a, k, work, model, url, env, after, ledger, gpu)
            info["records_dropped"] = m
            nights.append(info)
            newest = work / "newest-adapter"
            if newest.exists():  # the client asks for the new version before the next night (or the end)
                name = newest.read_text().strip()
                try:
                    wait_for(lambda name=name: any(x.ok and x.requested == name for x in client.answers), 120,
                             f"an answer from {name}")
                except TimeoutError as e:
                    say(str(e))
            after = dt.date.fromisoformat(info["key"])
    finally:
        client.stop()
        server_stats = http("GET", url + "/stats")[1] if server.alive() else {}
        server.stop()
        card.stop()
    say("checking ...")
    result = checks.evaluate(work=work, model=model, nights=nights, calibration=cal, client=client,
                             server_stats=server_stats, card=card, args=vars(a), gpu=gpu, mode=mode,
                             verify_outputs=a.verify_outputs)
    out = checks.write(result, a.out, card.name)
    say(f"wrote {out}/acceptance.json and acceptance.md")
    print((out / "acceptance.md").read_text())
    return 0 if result["passed"] else 1


def _read_json(path: Path) -> dict[str, Any] | None:
    """The file's JSON, or None while it is being replaced (a checkpoint's rotation renames it away)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
