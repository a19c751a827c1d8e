# ruff: noqa  (the device script as it ran: the night child's imports under cProfile)
import cProfile, pstats, sys, time
from pathlib import Path
t = time.time()
pr = cProfile.Profile(); pr.enable()
from jobs.training.unsloth_backend import setup_caches
setup_caches(Path(sys.argv[1]))
from jobs.training.unsloth_import import import_unsloth
import_unsloth()
from jobs.night.config import NightConfig
from jobs.night.run import failure_text, run_night
pr.disable()
print("imports", round(time.time() - t, 2))
pr.dump_stats(sys.argv[2])
pstats.Stats(pr).sort_stats("tottime").print_stats(40)
