# ruff: noqa  (a record of how the table below was made: the rows' samples/h again, over each data set's mean)
"""Fixstars' ratio is taken on samples/h. The rows of these runs counted the samples of their timed window
(the recipe: one or two padded batches of 32, or 8-20 of 4 for the 8B; ours: 8-20 packed steps, filled best-fit
since `sZ`), which
are not the data set's mix of lengths. This recomputes samples/h = real tok/s x 3600 / the mean sample length
of the data set each side drew from (regenerated with the same generator, sizes and seed), as
`jobs.bench.measure.Window.result(data)` now does (the last run's rows already count that way), and prints
the ratios.

    python results/h200-2026-11-26/fixstars-32b-fp8-bestfit/per_sample.py
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from jobs.training.synthetic import make_samples  # noqa: E402

QUICK_DATA_TOKENS = 200_000  # --quick's --data-tokens; the recipe draws that many, ours three times as many
VOCAB = 151_936  # Qwen3


def mean_len(prof: str, n_tokens: int) -> float:
    ss = make_samples(prof, n_tokens, vocab=VOCAB, seed=0)
    return sum(s.n_tokens for s in ss) / len(ss)


RUNS = (  # under results/: every quick Fixstars run (Qwen3-8B and Qwen3-32B: the same tokenizer size)
    "h200-2026-11-23/workloads/run1-all",
    "h200-2026-11-26/fixstars-32b/wl",
    "h200-2026-11-26/fixstars-32b-fp8/wl",
    "h200-2026-11-26/fixstars-32b-fp8-bestfit/wl",
    "h100-2026-11-26/fixstars-8b-fp8-bestfit/wl",
)


def main() -> None:
    results = Path(__file__).resolve().parents[2]
    for run in RUNS:
        rows = [json.loads(x) for x in (results / run / "workloads.rows.jsonl").read_text().splitlines() if x]
        rows = [r for r in rows if r.get("workload") == "fixstars" and r.get("side") in ("publication", "ours")
                and r.get("real_tok_s")]
        print(f"## {run} ({rows[0].get('arch')}, {rows[0].get('gpu_name')})\n\n| side | compute | profile | tok/s | window tok/sample | data set tok/sample | "
              "samples/h (window) | samples/h (data set) | x recipe (data set) | x recipe tok/s |\n" + "|---" * 10 + "|")
        recipe = {r["profile"]: r for r in rows if r["side"] == "publication"}
        for r in rows:
            n = QUICK_DATA_TOKENS * (1 if r["side"] == "publication" else 3)
            m = mean_len(r["profile"], n)
            sph = r["real_tok_s"] * 3600 / m
            rec = recipe[r["profile"]]
            rec_sph = rec["real_tok_s"] * 3600 / mean_len(r["profile"], QUICK_DATA_TOKENS)
            window = r.get("window_samples_per_hour", r["samples_per_hour"])
            print(f"| {r['side']} | {r.get('compute') or ('recipe' if r['side'] == 'publication' else 'bf16')} | {r['profile']} | {r['real_tok_s']:,.0f} | "
                  f"{r['real_tokens'] / max(1, r['samples']):,.0f} | {m:,.1f} | {window:,.0f} | "
                  f"{sph:,.0f} | {sph / rec_sph:.2f} | {r['real_tok_s'] / rec['real_tok_s']:.2f} |")
        print()


if __name__ == "__main__":
    main()
