# ruff: noqa  (the device script as it ran: a night's pull of 60,000 records, its own process under cProfile)
import cProfile, gc, pstats, sys, tempfile, time
from pathlib import Path
def main():
    from jobs.training.load import load_tokenizer
    from jobs.bench.acceptance.run import records, write_jsonl
    from jobs.data.pull import pull, Quarantine
    from jobs.data.sources import SourceConfig
    from jobs.data.token_cache import TokenCache
    from jobs.store.ledger import Ledger
    w = Path(tempfile.mkdtemp())
    tok = load_tokenizer(Path(sys.argv[1]))
    (w / "inbox").mkdir()
    write_jsonl(w / "inbox/n.jsonl", records("words", 60000, 5))
    led = Ledger(w / "ledger.db")
    src = SourceConfig(name="inbox", inbox=str(w / "inbox"), settle_seconds=0)
    cache = TokenCache(w / "cache", tok, max_seq_length=2048, overlong="truncate", special_tokens="escape")
    from jobs.data.parallel import start_early
    start_early(Path(sys.argv[1]))  # as the night's child does, while it imports
    time.sleep(10)
    gc.freeze()
    pr = cProfile.Profile(); t = time.time(); pr.enable()
    res = pull([src], led, tok, run_id="r1", quarantine=Quarantine(w / "q.jsonl", excerpt_bytes=16384),
               max_seq_length=2048, overlong="truncate", token_cache=cache)
    pr.disable()
    print("pull", round(time.time() - t, 2), dict(res.ingested))
    pstats.Stats(pr).sort_stats("tottime").print_stats(30)
if __name__ == "__main__":
    main()
