# ruff: noqa  (a results script: a 60,000-record pull after 25 s of waiting, its file checked by the pull or checked ahead)
import sys, time, tempfile, gc
from pathlib import Path
def main():
    from jobs.training.tinymodel import build_tiny_llama
    from jobs.training.load import load_tokenizer
    from jobs.bench.acceptance.run import records, write_jsonl
    from jobs.data.pull import pull, Quarantine
    from jobs.data.sources import SourceConfig
    from jobs.data.token_cache import TokenCache
    from jobs.data import parallel
    from jobs.data.prefetch import check_ahead
    from jobs.store.ledger import Ledger
    w = Path(tempfile.mkdtemp())
    m = build_tiny_llama(w / "m", sorted(Path("config/sample-inbox").glob("*.json*")))
    tok = load_tokenizer(m)
    for mode in sys.argv[1:]:
        d = w / mode; (d / "inbox").mkdir(parents=True)
        write_jsonl(d / "inbox/n.jsonl", records("words", 60000, 2))
        src = SourceConfig(name="inbox", inbox=str(d / "inbox"), settle_seconds=0)
        pool = parallel.start_early(m, 2)
        if mode.startswith("ahead"):
            check_ahead(pool, [src], options=parallel.check_options(max_seq_length=2048, overlong="truncate", special_tokens="escape"), excerpt_bytes=16384, now=2e9)
        time.sleep(25)  # the imports' time
        led = Ledger(d / "ledger.sqlite")
        cache = TokenCache(d / "cache", tok, max_seq_length=2048, overlong="truncate", special_tokens="escape")
        t = time.time()
        pull([src], led, tok, run_id="r1", quarantine=Quarantine(d / "q.jsonl", excerpt_bytes=16384), max_seq_length=2048, overlong="truncate", token_cache=cache, workers=2)
        print(mode, "pull", round(time.time() - t, 2), flush=True)
if __name__ == "__main__":
    main()
