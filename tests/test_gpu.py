"""jobs/gpu/telemetry.py with a fake NVML module (the units and the energy arithmetic), and on a real GPU when
there is one."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import structlog
from pydantic import ValidationError

from jobs.contract import GpuEvent, GpuSummary
from jobs.gpu import telemetry as gpu_mod
from jobs.gpu.telemetry import GpuConfig, GpuSampler, energy_fields

GIB = 1 << 30


class FakeNVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(f"NVML error {value}")
        self.value = value


class FakeNvml:
    """Just the pynvml calls the sampler makes. Each reading takes the next value of its list
    (the last one repeats); None in `energy_mj` means the card does not support the counter."""

    NVML_TEMPERATURE_GPU = 0
    NVML_ERROR_NOT_SUPPORTED = 3
    NVMLError = FakeNVMLError
    nvmlMemory_v2 = 0x02000028

    def __init__(
        self,
        power_mw: list[int],
        energy_mj: list[int] | None,
        *,
        name: Any = "Fake GPU 96GB",
        init_error: bool = False,
        devices: int = 1,
        memory_v2: bool = True,
    ) -> None:
        self.power_mw, self.energy_mj = list(power_mw), None if energy_mj is None else list(energy_mj)
        self.name, self.init_error, self.devices, self.memory_v2 = name, init_error, devices, memory_v2
        self.calls: dict[str, int] = {}
        self.shutdowns = 0

    def _next(self, what: str, values: list[int]) -> int:
        i = self.calls.get(what, 0)
        self.calls[what] = i + 1
        return values[min(i, len(values) - 1)]

    def nvmlInit(self) -> None:
        if self.init_error:
            raise FakeNVMLError(9)  # driver not loaded

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlDeviceGetHandleByIndex(self, i: int) -> str:
        if i >= self.devices:
            raise FakeNVMLError(2)
        return f"handle{i}"

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> str:
        return f"handle:{uuid}"

    def nvmlDeviceGetName(self, h: str) -> Any:
        return self.name

    def nvmlDeviceGetPowerUsage(self, h: str) -> int:
        return self._next("power", self.power_mw)

    def nvmlDeviceGetTotalEnergyConsumption(self, h: str) -> int:
        if self.energy_mj is None:
            raise FakeNVMLError(self.NVML_ERROR_NOT_SUPPORTED)
        return self._next("energy", self.energy_mj)

    def nvmlDeviceGetMemoryInfo(self, h: str, version: int | None = None) -> SimpleNamespace:
        if version is None:  # v1 counts driver-reserved memory as used
            return SimpleNamespace(used=31 * GIB, total=96 * GIB, free=65 * GIB)
        if not self.memory_v2:
            raise FakeNVMLError(13)  # old driver: function not found
        assert version == self.nvmlMemory_v2
        return SimpleNamespace(used=30 * GIB, total=96 * GIB, free=65 * GIB, reserved=1 * GIB)

    def nvmlDeviceGetUtilizationRates(self, h: str) -> SimpleNamespace:
        return SimpleNamespace(gpu=87, memory=40)

    def nvmlDeviceGetTemperature(self, h: str, sensor: int) -> int:
        assert sensor == self.NVML_TEMPERATURE_GPU
        return 64


class Clock:
    def __init__(self, t: float = 1_000.0, step: float = 1.0) -> None:
        self.t, self.step = t - step, step

    def __call__(self) -> float:
        self.t += self.step
        return self.t


@pytest.fixture(autouse=True)
def _fresh_log_once() -> Iterator[None]:
    gpu_mod._logged.clear()
    yield
    gpu_mod._logged.clear()


def drive(nvml: FakeNvml, samples: int, **kw: Any) -> tuple[list[GpuEvent], GpuSummary]:
    """start (1 reading), `samples` readings, stop (1 reading), one second apart."""
    events: list[Any] = []
    s = GpuSampler(events.append, nvml=nvml, clock=Clock(), **kw)
    assert s.start(background=False)
    for _ in range(samples):
        s.sample()
    summary = s.stop()
    assert all(isinstance(e, GpuEvent) for e in events)
    assert isinstance(summary, GpuSummary)
    return events, summary


def test_units_of_one_reading() -> None:
    events, _ = drive(FakeNvml([250_500], [7_000_000]), 0)
    ev = events[0]
    assert ev.model_dump() == {
        "event": "gpu",
        "adapter": "",  # every child event names its adapter: "" in a config of one (63ba576)
        "ts": 1_000.0,
        "power_watts": 250.5,
        "energy_joules_total": 7_000.0,
        "vram_used_bytes": 30 * GIB,
        "vram_total_bytes": 96 * GIB,
        "utilization_ratio": 0.87,
        "temperature_celsius": 64.0,
        "cards": [],
    }


def test_memory_v1_on_drivers_without_v2() -> None:
    events, _ = drive(FakeNvml([1_000], [1_000], memory_v2=False), 2)
    assert [e.vram_used_bytes for e in events] == [31 * GIB] * 4


def test_run_energy_is_the_counter_delta_and_mean_power_follows() -> None:
    # 1 kJ of card history before the run; then 250 J, 300 J, 350 J in three one-second steps
    nvml = FakeNvml([250_000, 260_000, 270_000, 280_000], [1_000_000, 1_250_000, 1_550_000, 1_900_000])
    events, summary = drive(nvml, 2, peak_memory=lambda: (20 * GIB, 24 * GIB))
    assert [e.energy_joules_total for e in events] == [1_000.0, 1_250.0, 1_550.0, 1_900.0]
    assert summary.model_dump() == {
        "mean_power_watts": pytest.approx(300.0),
        "energy_joules": pytest.approx(900.0),
        "peak_allocated_bytes": 20 * GIB,
        "peak_reserved_bytes": 24 * GIB,
        "total_memory_bytes": 96 * GIB,
        "name": "Fake GPU 96GB",
    }
    assert nvml.shutdowns == 1


def test_without_the_energy_counter_power_is_integrated() -> None:
    nvml = FakeNvml([100_000, 200_000, 300_000], None)
    events, summary = drive(nvml, 1)
    # trapezoids: (100+200)/2 * 1 s + (200+300)/2 * 1 s
    assert [e.energy_joules_total for e in events] == [0.0, 150.0, 400.0]
    assert summary.energy_joules == pytest.approx(400.0)
    assert summary.mean_power_watts == pytest.approx(200.0)
    assert summary.peak_allocated_bytes is None
    assert nvml.calls.get("energy", 0) == 0  # not supported: asked once, then never again


def test_a_counter_reset_mid_run_falls_back_to_integration() -> None:
    _, summary = drive(FakeNvml([100_000, 100_000, 100_000], [5_000_000, 5_100_000, 20_000]), 1)
    assert summary.energy_joules == pytest.approx(200.0)  # 100 W over 2 s


def test_one_reading_only_gives_the_power_it_saw() -> None:
    nvml = FakeNvml([123_000], [1_000])
    s = GpuSampler(nvml=nvml, clock=lambda: 5.0)  # no emit, a clock that does not move
    assert s.start(background=False)
    summary = s.stop()
    assert summary is not None
    assert summary.energy_joules == 0.0
    assert summary.mean_power_watts == pytest.approx(123.0)


def test_no_nvml_is_absent_cleanly_and_logged_once() -> None:
    with structlog.testing.capture_logs() as logs:
        for _ in range(3):
            s = GpuSampler(nvml=None)
            assert s.start() is False
            assert s.sample() is None
            assert s.stop() is None
    assert [e["reason"] for e in logs] == ["nvml_missing"]


def test_no_driver_and_no_device_are_absent_cleanly() -> None:
    assert GpuSampler(nvml=FakeNvml([1], [1], init_error=True)).start() is False
    nvml = FakeNvml([1], [1], devices=0)
    s = GpuSampler(nvml=nvml)
    assert s.start() is False
    assert s.stop() is None
    assert nvml.shutdowns == 1


def test_the_real_pynvml_without_a_gpu_is_absent_cleanly() -> None:
    if shutil.which("nvidia-smi"):
        pytest.skip("this machine has an NVIDIA driver")
    s = GpuSampler()
    assert s.start() is False
    assert s.stop() is None


def test_device_by_uuid_name_in_bytes_and_failing_peak_memory() -> None:
    def boom() -> tuple[int, int]:
        raise RuntimeError("no CUDA")

    nvml = FakeNvml([1_000], [1_000], name=b"Old Driver GPU")
    s = GpuSampler(nvml=nvml, device="abcd-1234", peak_memory=boom, clock=Clock())
    assert s.start(background=False)
    assert s._handle == "handle:GPU-abcd-1234"
    summary = s.stop()
    assert summary is not None
    assert summary.name == "Old Driver GPU"
    assert summary.peak_reserved_bytes is None


def test_a_failing_emit_does_not_stop_the_readings() -> None:
    def closed(_: Any) -> None:
        raise BrokenPipeError("daemon went away")

    s = GpuSampler(closed, nvml=FakeNvml([1_000], [1_000]), clock=Clock())
    assert s.start(background=False)
    assert s.sample() is not None
    assert s.stop() is not None


def test_the_background_thread_samples_at_the_configured_rate() -> None:
    """The thread waits 1/hz between readings. Checked on the waits it asks for, not by counting the readings of
    0.3 s of sleep (a busy box lets the thread run fewer times, or the sleep last longer)."""
    import threading

    from tests.conftest import hang_bound

    asked: list[float | None] = []

    class Waits(threading.Event):
        def wait(self, timeout: float | None = None) -> bool:
            asked.append(timeout)
            return super().wait(timeout)

    events: list[Any] = []
    s = GpuSampler(events.append, hz=20, nvml=FakeNvml([100_000], None))
    s._stop = Waits()
    assert s.start()
    end = time.monotonic() + hang_bound(30)
    while len(events) < 4:  # the start's reading, then three of the thread's
        assert time.monotonic() < end, "the sampler's thread never read"
        time.sleep(0.01)
    summary = s.stop()
    assert len(asked) >= 3 and set(asked) == {1 / 20}
    assert summary is not None and summary.mean_power_watts == pytest.approx(100.0)


def test_config_and_rate_limits() -> None:
    assert GpuConfig().sample_hz == 1.0
    with pytest.raises(ValidationError):
        GpuConfig(sample_hz=0.5)
    with pytest.raises(ValidationError):
        GpuConfig.model_validate({"hz": 2})
    with pytest.raises(ValueError, match=">= 1 Hz"):
        GpuSampler(hz=0.2)


def test_energy_fields_for_the_manifest() -> None:
    g = GpuSummary(
        mean_power_watts=250.0,
        energy_joules=10_000.0,
        peak_allocated_bytes=1,
        peak_reserved_bytes=2,
        total_memory_bytes=3,
        name="x",
    )
    assert energy_fields(g, 45_000) == {"energy_joules": 10_000.0, "mean_power_watts": 250.0, "tokens_per_joule": 4.5}
    assert energy_fields(None, 45_000) == {"energy_joules": None, "mean_power_watts": None, "tokens_per_joule": None}


@pytest.mark.gpu
def test_real_gpu_figures_agree_with_nvidia_smi() -> None:
    """On the GPU machine: a few seconds of matmuls give plausible power, energy and VRAM figures."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from jobs.gpu.telemetry import torch_device_uuid, torch_peak_memory

    events: list[GpuEvent] = []
    s = GpuSampler(events.append, hz=4, device=torch_device_uuid() or 0, peak_memory=torch_peak_memory)
    assert s.start()
    a = torch.randn(8192, 8192, device="cuda")
    t_end = time.time() + 6
    while time.time() < t_end:
        for _ in range(20):
            a = (a @ a).clamp_(-1, 1)
        torch.cuda.synchronize()
    smi = subprocess.run(
        [
            "nvidia-smi",
            "--query-gpu=power.draw,memory.used,memory.total",
            "--format=csv,noheader,nounits",
            "-i",
            torch_device_uuid() or "0",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    summary = s.stop()
    assert summary is not None
    smi_power, smi_used, smi_total = (float(x) for x in smi.stdout.strip().split(","))
    busy = [e for e in events if e.power_watts is not None]
    print(
        f"\nGPU {summary.name}: {len(events)} readings; mean power {summary.mean_power_watts:.1f} W, "
        f"energy {summary.energy_joules:.1f} J over ~6 s, peak allocated "
        f"{summary.peak_allocated_bytes / GIB:.2f} GiB, reserved {summary.peak_reserved_bytes / GIB:.2f} GiB, "
        f"NVML used {busy[-1].vram_used_bytes / GIB:.2f} GiB of {summary.total_memory_bytes / GIB:.2f} GiB; "
        f"nvidia-smi: {smi_power:.1f} W, {smi_used:.0f} MiB used of {smi_total:.0f} MiB; "
        f"util {max(e.utilization_ratio or 0 for e in events):.2f}, "
        f"temp {max(e.temperature_celsius or 0 for e in events):.0f} C"
    )
    assert summary.total_memory_bytes == pytest.approx(smi_total * 2**20, rel=0.01)
    assert 30 < summary.mean_power_watts < 1500
    assert summary.energy_joules > 100
    assert summary.peak_allocated_bytes >= 2 * 8192 * 8192 * 4  # a and a @ a
    assert summary.peak_reserved_bytes >= summary.peak_allocated_bytes
    assert busy[-1].vram_used_bytes == pytest.approx(smi_used * 2**20, rel=0.1)
    assert max(e.utilization_ratio for e in events) > 0.5
