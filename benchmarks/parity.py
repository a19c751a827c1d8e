"""`python -m benchmarks parity`: does speed cost learning? The same task trained through bf16, NF4 and FP8.

Each path runs the same nights (jobs/night/run.py's run_night, as benchmarks/chain.py does; one process per
path, the paths side by side on one card) on the same random-initialised model of a real architecture, with
the same data, seed, step size and hyper-parameters; only `[train] method` / `compute` differ (PATHS):

- bf16: `method = "lora"`, `compute = "bf16"`: 16-bit LoRA on a bf16 base (the reference);
- nf4:  `method = "qlora"`, `compute = "bf16"`: QLoRA, the base in NF4;
- fp8:  `method = "qlora"`, `compute = "fp8"`: the default on an FP8 card (the NF4 base's e4m3 copy);
- fp8-bf16base: `method = "lora"`, `compute = "fp8"` (the bf16 base's e4m3 copy), on request.

The task (benchmarks/tasks.py, tasks A and B mixed: the same 12 keys after two cues, 24 answers) is written
in the words of the random model's tokenizer (`w0` ... `w255`, jobs/training/models/architectures.py): a
random-initialised base knows nothing, so whatever it answers it learned tonight. After each night every
path's candidate answers the tasks' unseen test prompts, scored by exact match by the independent greedy
decoder (benchmarks/greedy.py: transformers + PEFT, the same fp32 base for every path, none of the
product's evaluation); the judgement is benchmarks/parity_table.py's (within 1 point of bf16 at every
night). The config: the shipped config's [plan], [train] and [eval] (config/nightshift.toml) with what its
own comments say to change on a GPU (GPU_TRAIN) and a fixed step size, so every path trains the same
batches; nights grow (`--per-night 96,96,192,480`: about 7, 17, 37 and 87 steps of 512 tokens) so the curve has points
across the 8B's learning (its loss fell from 12.2 to 0.02 within the first 19 steps on the H200).

    python -m benchmarks parity --arch llama3.1-8b --out /tmp/parity      (a GPU; drivers/parity_gpu.sh)
    python -m benchmarks parity --arch tiny-llama --paths bf16,nf4 --per-night 96,96 --out /tmp/p   (CPU)
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import greedy
from benchmarks.chain import machine, night_config, shipped_sections
from benchmarks.parity_table import Point, accuracy_table, informative, judge, loss_table, verdict_lines
from benchmarks.tasks import CODES, FILLERS, KEYS, TASK_A, TASK_B

PATHS: dict[str, dict[str, str]] = {
    "bf16": {"method": "lora", "compute": "bf16"},
    "nf4": {"method": "qlora", "compute": "bf16"},
    "fp8": {"method": "qlora", "compute": "fp8"},
    "fp8-bf16base": {"method": "lora", "compute": "fp8"},
}
# config/nightshift.toml is a CPU demo; its comments say what a GPU changes: Unsloth where it exists, packed rows
# (auto is transformers + PEFT on a CPU; packed there too, so the CPU check runs the GPU's batches)
GPU_TRAIN = {"backend": "auto", "batching": "packed"}
TASKS = (TASK_A, TASK_B)
VOCAB = {w: f"w{i}" for i, w in enumerate(dict.fromkeys([*KEYS, *FILLERS, *(t.cue for t in TASKS), *CODES, "."]))}


def in_words(record: dict[str, Any]) -> dict[str, Any]:
    """The record with every word of the task replaced by its word of the random model's tokenizer."""
    def one(text: str) -> str:
        out = []
        for w in re.findall(r"\w+|[^\w\s]", text):
            if w not in VOCAB:
                raise ValueError(f"parity: {w!r} (in {text!r}) is no word of the task's vocabulary")
            out.append(VOCAB[w])
        return " ".join(out)
    return {"messages": [{**m, "content": one(m["content"])} for m in record["messages"]]}


def night_records(night: int, n: int, *, test_per_key: int) -> list[dict[str, Any]]:
    """`n` records of night `night`: tasks A and B alternating, none a prompt of either test set."""
    a = TASK_A.night(n - n // 2, night, test_per_key=test_per_key)
    b = TASK_B.night(n // 2, night, test_per_key=test_per_key)
    mixed = [r for pair in zip(a, b, strict=False) for r in pair] + a[len(b):]
    return [in_words(r) for r in mixed]


def test_sets(per_key: int) -> dict[str, list[dict[str, Any]]]:
    return {t.name: [in_words(r) for r in t.test_set(per_key)] for t in TASKS}


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")
# Every turn closed by the end-of-sequence token, as real chat templates close theirs (Llama 3: <|eot_id|>): the
# reply's trained span then ends with it, so the model learns to stop and the greedy scorer reads a whole reply.
# The random models' own template (architectures.py) has none: a night trained "w31" and never an end, and the
# first H200 run scored 0 % on every path while the product's teacher-forced exact match read 100 %.
TURN_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{{ eos_token }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant: {% endif %}")


def with_turn_ends(model: Path) -> Path:
    """`<model>-turns`: the random model's files linked (nothing copied: an 8B is 16 GB), its tokenizer saved
    again with TURN_TEMPLATE. The built model's own directory is left as the bench and calibrate use it."""
    from transformers import AutoTokenizer

    out = model.with_name(model.name + "-turns")
    out.mkdir(parents=True, exist_ok=True)
    for f in model.iterdir():
        link = out / f.name
        if f.name not in TOKENIZER_FILES and not link.exists():
            link.symlink_to(f.resolve())
    tok = AutoTokenizer.from_pretrained(model)
    tok.chat_template = TURN_TEMPLATE
    tok.save_pretrained(out)
    return out


def path_over(path: str, *, cuda: bool, tokens_per_step: int, max_vram_gb: float) -> dict[str, Any]:
    train: dict[str, Any] = {**PATHS[path], **GPU_TRAIN, "tokens_per_step": tokens_per_step}  # on a CPU too: one
    return {"train": train, "model": {"name": "parity"},
            "gpu": {"enabled": cuda, **({"max_vram_gb": max_vram_gb} if cuda else {})}}


def run_one_night(work: Path, model: Path, over: dict[str, Any], records: list[dict[str, Any]], night: int,
                  sections: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One night of one path (its own state directory); the row: outcome, steps, losses, its candidate."""
    from jobs.night.run import run_night

    cfg = night_config(work, model, over, sections)
    (work / "inbox" / f"night-{night:02d}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    t0 = time.time()
    s = run_night(cfg, night=f"2026-12-{night:02d}", deadline=time.time() + 3600, emit=lambda _: None,
                  stop=threading.Event())
    candidate = work / "state" / "adapters" / f"parity-v{s.version:04d}" if s.version else None
    manifest = candidate / "manifest.json" if candidate else None
    curve = ([(int(p["step"]), float(p["loss"])) for p in json.loads(manifest.read_text()).get("loss_curve", [])]
             if manifest and manifest.exists() else [])
    fp8 = s.load_info.get("fp8") or {}
    return {"night": night, "outcome": s.outcome.value, "error": s.error, "promoted": s.promoted,
            "version": s.version, "candidate": str(candidate) if candidate and candidate.is_dir() else None,
            "steps": s.steps or 0, "trained": s.trained_samples, "replayed": s.replay_samples,
            "tokens": s.trained_tokens, "tokens_per_second": s.tokens_per_second, "train_loss": s.losses.train,
            "heldout": {"before": s.losses.heldout_before, "after": s.losses.heldout_after},
            "product_exact_match": {k: getattr(s.metrics.get(f"{k}_after"), "exact_match", None)
                                    for k in ("heldout", "regression")},  # teacher-forced: the gate's own
            "failed": s.gate.failed() if s.gate else "", "compute": (s.step_shape.compute if s.step_shape else None),
            "step_shape_basis": s.step_shape.basis if s.step_shape else None, "method": s.method,
            "fp8": {k: fp8.get(k) for k in ("compute", "error", "numerics_passed", "conversion")} if fp8 else None,
            "loss_curve": curve, "seconds": round(time.time() - t0, 1), "train_seconds": s.actual_train_seconds,
            "gpu_memory_gb": _gpu_memory()}


def _gpu_memory() -> float | None:
    import torch

    if not torch.cuda.is_available():
        return None
    gc.collect()
    torch.cuda.empty_cache()
    return round(torch.cuda.memory_allocated() / 1e9, 2)


def run_path(out: Path, model: Path, path: str, sizes: Sequence[int], *, cuda: bool, test_per_key: int,
             tokens_per_step: int, max_vram_gb: float, budget_s: float, started: float,
             on_row: Any = None) -> list[dict[str, Any]]:
    """One path's nights in order, in `out/work/<path>`; a night that would end past
    `budget_s` is not started (its row is absent: the table shows it as not run, not as a miss).
    `cuda` comes from the caller: torch is first imported by the night, after it points the compile
    caches into the state directory (jobs/training/backends/unsloth.py)."""
    sections = shipped_sections()
    work = out / "work" / path
    over = path_over(path, cuda=cuda, tokens_per_step=tokens_per_step, max_vram_gb=max_vram_gb)
    rows: list[dict[str, Any]] = []
    for night, n in enumerate(sizes, start=1):
        if rows:  # the last night's time: its training grows with the data, the rest (load, evaluate) does not
            train = rows[-1].get("train_seconds") or 0.0
            guess = rows[-1].get("seconds", 0.0) - train + train * n / sizes[night - 2]
            if time.time() - started + guess > budget_s:
                print(f"parity: {path} night {night} would end past the budget of {budget_s:.0f} s: not run",
                      flush=True)
                break
        records = night_records(night, n, test_per_key=test_per_key)
        try:
            row = run_one_night(work, model, over, records, night, sections)
        except Exception as e:  # recorded: a failed night is a miss, not a crash of the benchmark
            row = {"night": night, "outcome": "failed", "error": f"{type(e).__name__}: {e}", "steps": 0,
                   "candidate": None, "loss_curve": []}
        rows.append(row)
        if on_row:
            on_row(path, row)
    return rows


def points_and_curves(rows: dict[str, list[dict[str, Any]]], scores: dict[str, dict[str, float]]
                      ) -> tuple[list[Point], dict[str, list[tuple[int, float]]]]:
    """Each path's candidates as curve points (steps counted across its nights) and its whole loss curve."""
    points, curves = [], {}
    for path, nights in rows.items():
        steps, curve = 0, []
        for r in nights:
            curve += [(steps + s, loss) for s, loss in r.get("loss_curve", [])]
            steps += r.get("steps") or 0
            sc = scores.get(f"{path}/{r['night']}")
            em = None if sc is None else 100.0 * sum(sc.values()) / len(sc)  # A and B have as many prompts
            points.append(Point(path, r["night"], steps, em, r.get("train_loss")))
        curves[path] = curve
    return points, curves


def write(out: Path, doc: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "parity.json").write_text(json.dumps(doc, indent=2, default=str))


def read_rows(path: Path) -> list[dict[str, Any]]:
    """A path's nights so far (one JSON line each, written by its child)."""
    if not path.exists():
        return []
    whole = path.read_text().split("\n")[:-1]  # a line still being written has no newline yet
    return [json.loads(line) for line in whole if line.strip()]


def report(doc: dict[str, Any], rows: dict[str, list[dict[str, Any]]], scores: dict[str, dict[str, float]],
           paths: Sequence[str]) -> str:
    points, curves = points_and_curves(rows, scores)
    doc.update(rows=rows, scores=scores, points=[p.__dict__ for p in points],
               verdicts={p: judge(points, p).__dict__ for p in paths if p != "bf16"})
    every = max(1, max((len(c) for c in curves.values()), default=1) // 12)
    doc["table"] = "\n".join([accuracy_table(points, paths), "", *verdict_lines(points, paths),
                              informative(points), "", loss_table(curves, every=every)])
    return str(doc["table"])


def nights_child(args: argparse.Namespace, path: str, sizes: Sequence[int], started: float) -> int:
    """One path's nights, in a process of their own: the paths train side by side (the card has room for
    all three), and Unsloth, which patches transformers' classes at import, stays out of the scorer's
    process (the parent: plain transformers + PEFT)."""
    from jobs.night.child import _import_unsloth_first
    from jobs.runtime import logs

    logs.configure("WARNING")
    state = args.out / "work" / path / "state"
    shutil.rmtree(state.parent, ignore_errors=True)  # from nothing: no adapter, no ledger of an earlier run
    if args.cuda:  # as the night's child process does: Unsloth before transformers, its caches in the state
        _import_unsloth_first({"train": {**PATHS[path], **GPU_TRAIN}, "state_dir": str(state)})

    def emit(path: str, r: dict[str, Any]) -> None:
        print(f"  night {r['night']} {path}: {r['outcome']} {r.get('steps')} steps, loss {r.get('train_loss')}, "
              f"compute {r.get('compute')}, {r.get('seconds')} s {r.get('error') or ''}", flush=True)
        with args.nights_child.open("a") as f:
            f.write(json.dumps({"path": path, **r}, default=str) + "\n")

    run_path(args.out, args.model, path, sizes, cuda=args.cuda, test_per_key=args.test_per_key,
             tokens_per_step=args.tokens_per_step, max_vram_gb=args.max_vram_gb, budget_s=args.budget_seconds,
             started=started, on_row=emit)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks parity", description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="llama3.1-8b", help="a random-initialised architecture (models/specs.py)")
    ap.add_argument("--model", type=Path, help="a random model built already (its word tokenizer)")
    ap.add_argument("--models-dir", type=Path, default=Path("/tmp/nightshift-models"))
    ap.add_argument("--paths", default="bf16,nf4,fp8", help=f"comma-separated, bf16 first: {', '.join(PATHS)}")
    ap.add_argument("--per-night", default="96,96,192,480", help="new records of each night, comma-separated")
    ap.add_argument("--tokens-per-step", type=int, default=512, help="[train] tokens_per_step, every path")
    ap.add_argument("--test-per-key", type=int, default=40, help="unseen test prompts per key (24 key-cue pairs)")
    ap.add_argument("--max-vram-gb", type=float, default=40.0, help="[gpu] max_vram_gb on a GPU")
    ap.add_argument("--budget-seconds", type=float, default=1e9,
                    help="start no round of nights that would end after this many seconds (the model's build counted)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--nights-child", type=Path, help=argparse.SUPPRESS)  # internal: run the nights, rows here
    ap.add_argument("--only", help=argparse.SUPPRESS)  # internal: the child's path
    ap.add_argument("--cuda", action="store_true", help=argparse.SUPPRESS)  # internal: the parent saw a GPU
    args = ap.parse_args(argv)
    paths = [p for p in args.paths.split(",") if p]
    if paths[:1] != ["bf16"] or any(p not in PATHS for p in paths):
        raise SystemExit(f"--paths {args.paths!r}: bf16 first, then any of {', '.join(PATHS)}")
    sizes = [int(x) for x in args.per_night.split(",") if x]
    started = time.time()
    if args.nights_child:
        return nights_child(args, args.only, sizes, started)
    from jobs.training.backends.peft_env import hide_torchao_peft_refuses

    hide_torchao_peft_refuses()  # before anything imports torchao: the scorer's PEFT (benchmarks/greedy.py)
    import torch

    from jobs.training.models.architectures import build_random_model

    model = with_turn_ends(args.model or build_random_model(args.arch, args.models_dir / args.arch))
    cuda = torch.cuda.is_available()
    doc: dict[str, Any] = {"arch": args.arch, "model": str(model), "paths": {p: PATHS[p] for p in paths},
                           "per_night": sizes, "tokens_per_step": args.tokens_per_step, "test_per_key":
                           args.test_per_key, "machine": machine(), "gpu_train": GPU_TRAIN,
                           "card": torch.cuda.get_device_name(0) if cuda else "cpu",
                           "build_seconds": round(time.time() - started, 1)}
    print(f"parity: {args.arch} at {model} ({doc['build_seconds']} s), paths {', '.join(paths)}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    left = args.budget_seconds - (time.time() - started)  # the budget counts from here: the build is spent
    child_argv = list(argv if argv is not None else sys.argv[1:])
    children: dict[str, subprocess.Popen[bytes]] = {}
    files: dict[str, Path] = {}
    for path in paths:
        files[path] = args.out / f"nights-{path}.jsonl"
        files[path].unlink(missing_ok=True)
        children[path] = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.parity", *child_argv, "--model", str(model), "--only", path,
             "--nights-child", str(files[path]), "--budget-seconds", str(left), *(["--cuda"] if cuda else [])])
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout's TERM: the children go too
    try:
        return score_while_training(args, doc, paths, model, cuda, children, files, started)
    finally:
        for c in children.values():
            if c.poll() is None:
                c.terminate()


def score_while_training(args: argparse.Namespace, doc: dict[str, Any], paths: Sequence[str], model: Path,
                         cuda: bool, children: dict[str, subprocess.Popen[bytes]], files: dict[str, Path],
                         started: float) -> int:
    tests = test_sets(args.test_per_key)
    scorer = greedy.Scorer(model, device="cuda" if cuda else "cpu", batch=256 if cuda else 64)  # meanwhile
    scores: dict[str, dict[str, float]] = {"base": scorer.score(None, tests)}
    print(f"base (no adapter): {scores['base']}", flush=True)
    while True:  # score each night's candidate as it comes, while the next nights train
        running = any(c.poll() is None for c in children.values())
        rows = {p: read_rows(f) for p, f in files.items()}
        for path, nights in rows.items():
            for r in nights:
                label = f"{path}/{r['night']}"
                if r.get("candidate") and label not in scores:
                    scores[label] = scorer.score(Path(r["candidate"]), tests)
                    print(f"  scored {label}: {scores[label]}", flush=True)
        report(doc, rows, scores, paths)
        write(args.out, {**doc, "seconds": round(time.time() - started, 1),
                         "child_exit": {p: c.poll() for p, c in children.items()}})
        if not running:
            break
        time.sleep(2)
    print(doc["table"])
    codes = {p: c.returncode for p, c in children.items()}
    print(f"nights exit {codes}; written: {args.out / 'parity.json'}")
    return max(abs(c) for c in codes.values())


if __name__ == "__main__":
    raise SystemExit(main())
