"""GPU telemetry for the night's child, through NVML (nvidia-ml-py).

Why NVML in the child: the daemon never touches the GPU; the child samples it while it
runs (>= 1 Hz) and sends contract "gpu" events up the pipe, and at the end reports the
run's figures for the RunSummary's "gpu" and the version's manifest.

Units: NVML gives power in milliwatts and the card's total energy since the driver
loaded in millijoules; both are converted to watts / joules here. The run's energy is
the delta of that counter between start and stop (exact, the driver integrates it);
where the card does not support the counter, power readings are integrated
(trapezoid rule) instead. Mean power = joules / seconds of the sampled span.

Absent cleanly: no pynvml, no driver, no GPU -> `start()` returns False, `sample()` and
`stop()` return None, one log line, never an exception. NVML is injectable (`nvml=`)
so CPU tests drive the arithmetic with a fake module.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import Annotated, Any

import structlog
from pydantic import BaseModel, ConfigDict, Field

from jobs.contract import Emit, GpuEvent, GpuSummary

log = structlog.get_logger("nightshift.gpu")
PeakMemory = Callable[[], tuple[int, int] | None]  # (max allocated, max reserved) bytes
AUTO = "auto"  # load pynvml when the sampler starts
_logged: set[str] = set()  # reasons already logged: one line per process, not one per second


class GpuConfig(BaseModel):
    """[gpu]: telemetry of the card the night trains on."""

    model_config = ConfigDict(extra="forbid")
    enabled: bool = True
    sample_hz: float = Field(1.0, ge=1.0, le=20.0, description="NVML readings per second while the child runs")
    device: Annotated[int, Field(ge=0)] | str = Field(
        0, description="NVML index, or the card's UUID (GPU-...) when indices differ")
    max_vram_gb: float | None = Field(
        None, gt=0, description="training stays under this (the card may be shared with an inference server)")
    headroom_gb: float = Field(
        3.0, ge=0, description="kept free below max_vram_gb and below the free memory at the night's start: "
        "CUDA context, allocator slack, an inference server's growth")
    min_free_vram_gb: float = Field(
        0.0, ge=0, description="pre-flight: wait (until the latest start) for this much free memory")
    preflight_retry_seconds: float = Field(60.0, gt=0, description="how often to re-check free memory")
    price_per_gpu_hour: float | None = Field(
        None, gt=0, description="what an hour of one card costs (any currency, shown as $): the summary, `adapters "
        "show`, the report and the metrics then say what a million trained tokens cost (jobs/gpu/cost.py); unset: "
        "no dollars, only joules")


def load_nvml() -> Any | None:
    """The pynvml module, or None where nvidia-ml-py is not installed."""
    try:
        import pynvml
    except ImportError:
        return None
    return pynvml


def torch_peak_memory() -> tuple[int, int] | None:
    """torch's max allocated / max reserved bytes on the current CUDA device (None without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return None
    return int(torch.cuda.max_memory_allocated()), int(torch.cuda.max_memory_reserved())


def torch_device_uuid(index: int = 0) -> str | None:
    """NVML UUID of torch's CUDA device `index` (NVML and CUDA may number cards differently)."""
    import torch

    if not torch.cuda.is_available():
        return None
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    return f"GPU-{uuid}" if uuid is not None else None


def energy_fields(gpu: GpuSummary | None, tokens: int) -> dict[str, float | None]:
    """What a version's manifest records: joules, mean watts, tokens per joule (None without a GPU)."""
    joules = gpu.energy_joules if gpu else None
    return {
        "energy_joules": joules,
        "mean_power_watts": gpu.mean_power_watts if gpu else None,
        "tokens_per_joule": tokens / joules if joules else None,
    }


def gpu_count(nvml: Any = AUTO) -> int:
    """Cards NVML sees (0 without nvidia-ml-py, a driver or a GPU); no torch: the daemon asks."""
    nvml = load_nvml() if nvml == AUTO else nvml
    if nvml is None:
        return 0
    try:
        nvml.nvmlInit()
        try:
            return int(nvml.nvmlDeviceGetCount())
        finally:
            nvml.nvmlShutdown()
    except Exception:
        return 0


def free_vram_gb(device: int | str = 0, nvml: Any = AUTO) -> float | None:
    """Free memory of the card now (NVML, no torch: the daemon asks before it starts a night)."""
    nvml = load_nvml() if nvml == AUTO else nvml
    if nvml is None:
        return None
    try:
        nvml.nvmlInit()
        try:
            h = (nvml.nvmlDeviceGetHandleByUUID(device) if isinstance(device, str)
                 else nvml.nvmlDeviceGetHandleByIndex(device))
            return float(nvml.nvmlDeviceGetMemoryInfo(h).free) / 1e9
        finally:
            nvml.nvmlShutdown()
    except Exception:  # no driver, no such device: no GPU to speak of
        return None


def _log_once(reason: str, **kw: Any) -> None:
    if reason not in _logged:
        _logged.add(reason)
        log.info("gpu_telemetry_unavailable", reason=reason, **kw)


class GpuSampler:
    """Samples one card at `hz` on a thread between `start()` and `stop()`.

    `emit` gets one contract "gpu" event per reading; `stop()` returns the run's
    GpuSummary. `peak_memory` (e.g. `torch_peak_memory`) is called once, at stop.
    """

    def __init__(
        self,
        emit: Emit | None = None,
        *,
        hz: float = 1.0,
        device: int | str = 0,
        nvml: Any = AUTO,
        clock: Callable[[], float] = time.time,
        peak_memory: PeakMemory | None = None,
    ) -> None:
        if hz < 1.0:
            raise ValueError(f"sample rate must be >= 1 Hz, got {hz}")
        self.emit, self.hz, self.device, self.clock = emit, hz, device, clock
        self.peak_memory = peak_memory
        self._nvml = nvml
        self._handle: Any = None
        self.name = ""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._unsupported: set[str] = set()
        self._first_t: float | None = None
        self._last_t: float | None = None
        self._last_power: float | None = None
        self._integrated_j = 0.0  # trapezoid integral of power since start (fallback energy)
        self._power_sum, self._power_n = 0.0, 0
        self._energy_first: float | None = None
        self._energy_last: float | None = None
        self._total_bytes: int | None = None
        self._memory_v2: bool | None = None  # None: not tried yet

    def start(self, background: bool = True) -> bool:
        """Open NVML and take the first reading; False (and one log line) where there is no GPU.

        background=False starts no thread: the caller calls `sample()` itself (tests, own loops).
        """
        nvml = load_nvml() if self._nvml == AUTO else self._nvml
        self._nvml = nvml
        if nvml is None:
            _log_once("nvml_missing", detail="nvidia-ml-py is not installed")
            return False
        try:
            nvml.nvmlInit()
        except Exception as e:  # no driver / no GPU: NVMLError_LibraryNotFound, DriverNotLoaded...
            _log_once("nvml_init_failed", error=str(e) or type(e).__name__)
            return False
        try:
            if isinstance(self.device, str):
                uuid = self.device if self.device.startswith(("GPU-", "MIG-")) else f"GPU-{self.device}"
                self._handle = nvml.nvmlDeviceGetHandleByUUID(uuid)
            else:
                self._handle = nvml.nvmlDeviceGetHandleByIndex(self.device)
            name = nvml.nvmlDeviceGetName(self._handle)
            self.name = name.decode() if isinstance(name, bytes) else str(name)
        except Exception as e:
            self._handle = None
            _log_once("nvml_no_device", device=str(self.device), error=str(e) or type(e).__name__)
            self._shutdown()
            return False
        log.info("gpu_telemetry_started", gpu=self.name, hz=self.hz)
        self.sample()
        if background:
            self._thread = threading.Thread(target=self._loop, name="gpu-sampler", daemon=True)
            self._thread.start()
        return True

    def _loop(self) -> None:
        while not self._stop.wait(1.0 / self.hz):
            self.sample()

    def _read(self, what: str, fn: Callable[[], Any]) -> Any:
        if what in self._unsupported:
            return None
        try:
            return fn()
        except Exception as e:
            if getattr(e, "value", None) == getattr(self._nvml, "NVML_ERROR_NOT_SUPPORTED", 3):
                self._unsupported.add(what)  # permanent for this card: stop asking
            _log_once(f"reading:{what}", reading=what, error=str(e) or type(e).__name__)
            return None

    def _memory_info(self) -> Any:
        """v2 where the driver has it: its `used` leaves out driver-reserved memory, as nvidia-smi does
        (v1's `used` counted ~0.6 GiB more than nvidia-smi on an H200)."""
        nvml, v2 = self._nvml, getattr(self._nvml, "nvmlMemory_v2", None)
        if v2 is not None and self._memory_v2 is not False:
            try:
                info = nvml.nvmlDeviceGetMemoryInfo(self._handle, version=v2)
                self._memory_v2 = True
                return info
            except Exception:
                if self._memory_v2:  # worked before: a real failure, not an old driver
                    raise
                self._memory_v2 = False
        return nvml.nvmlDeviceGetMemoryInfo(self._handle)

    def sample(self) -> GpuEvent | None:
        """One reading: update the run's figures and emit the "gpu" event (None when inactive)."""
        if self._handle is None:
            return None
        nvml, h = self._nvml, self._handle
        t = self.clock()
        power = self._read("power", lambda: nvml.nvmlDeviceGetPowerUsage(h) / 1000.0)  # mW -> W
        energy = self._read("energy", lambda: nvml.nvmlDeviceGetTotalEnergyConsumption(h) / 1000.0)  # mJ -> J
        mem = self._read("memory", self._memory_info)
        util = self._read("utilization", lambda: nvml.nvmlDeviceGetUtilizationRates(h).gpu / 100.0)
        temp = self._read("temperature", lambda: float(nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU)))
        with self._lock:
            if power is not None:
                if self._last_t is not None and self._last_power is not None:
                    self._integrated_j += (t - self._last_t) * (self._last_power + power) / 2
                self._last_power = power
                self._power_sum += power
                self._power_n += 1
            if self._first_t is None:
                self._first_t = t
            self._last_t = t
            if energy is not None:
                self._energy_first = energy if self._energy_first is None else self._energy_first
                self._energy_last = energy
            if mem is not None:
                self._total_bytes = int(mem.total)
            energy_total = energy if energy is not None else (self._integrated_j if power is not None else None)
        event = GpuEvent(
            ts=t,
            power_watts=power,
            energy_joules_total=energy_total,
            vram_used_bytes=int(mem.used) if mem is not None else None,
            vram_total_bytes=int(mem.total) if mem is not None else None,
            utilization_ratio=util,
            temperature_celsius=temp,
        )
        if self.emit is not None:
            try:
                self.emit(event)
            except Exception as e:  # a closed pipe must not kill the sampler thread silently mid-run
                _log_once("emit_failed", error=str(e))
        return event

    def stop(self) -> GpuSummary | None:
        """Stop sampling, take a last reading, return the run's figures (None when inactive)."""
        if self._handle is None:
            return None
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        self.sample()
        peak = None
        if self.peak_memory is not None:
            try:
                peak = self.peak_memory()
            except Exception as e:
                _log_once("peak_memory_failed", error=str(e))
        with self._lock:
            summary = GpuSummary(
                mean_power_watts=None,
                energy_joules=self.run_joules(),
                peak_allocated_bytes=peak[0] if peak else None,
                peak_reserved_bytes=peak[1] if peak else None,
                total_memory_bytes=self._total_bytes,
                name=self.name,
            )
            seconds = (self._last_t or 0.0) - (self._first_t or 0.0)
            if summary.energy_joules is not None and seconds > 0:
                summary.mean_power_watts = summary.energy_joules / seconds
            elif self._power_n:
                summary.mean_power_watts = self._power_sum / self._power_n
        self._shutdown()
        self._handle = None
        log.info("gpu_telemetry_stopped", **summary.model_dump(exclude_none=True))
        return summary

    def run_joules(self) -> float | None:
        """Energy since start: the NVML counter's delta, else integrated power (None: neither known)."""
        first, last = self._energy_first, self._energy_last
        if first is not None and last is not None and last >= first:  # a driver reload resets it: integrate
            return last - first
        return self._integrated_j if self._power_n else None

    def _shutdown(self) -> None:
        with contextlib.suppress(Exception):
            self._nvml.nvmlShutdown()
