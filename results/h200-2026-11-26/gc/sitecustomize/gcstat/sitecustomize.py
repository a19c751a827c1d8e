# every garbage collection over 2 ms of this process: generation, collected, seconds -> /tmp/gcstat/<pid>
import gc
import os
import time

_t = [0.0]
def _cb(phase, info):
    if phase == "start":
        _t[0] = time.perf_counter()
        return
    d = time.perf_counter() - _t[0]
    if d > 0.002:
        os.makedirs("/tmp/gcstat", exist_ok=True)
        with open(f"/tmp/gcstat/{os.getpid()}", "a") as f:
            f.write(f"{time.time():.3f} {info['generation']} {info['collected']} {d:.4f}\n")
gc.callbacks.append(_cb)
