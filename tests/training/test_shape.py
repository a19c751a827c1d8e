"""The step shape from the memory free now, and the speed of the shape used (CPU: a fake NVML)."""

import json
from types import SimpleNamespace

import pytest

from jobs.contract import CalibrationRecord, MemoryModel, ShapeRate, StepShape
from jobs.training.config import TrainConfig
from jobs.training.shape import (
    CKPT_SPEED_RATIO,
    history_for_shape,
    rate_for_shape,
    resolve_step,
)
from tests.conftest import alpaca, run, write_jsonl

AUTO = TrainConfig(batching="packed", tokens_per_step="auto", gradient_checkpointing="auto", max_seq_length=128)


def record(**over) -> CalibrationRecord:
    base = dict(tokens_per_step=2048, gradient_checkpointing=False,
                memory=MemoryModel(static_gb=6.0, mb_per_token=3.5), tokens_per_second={"alpaca": 6000, "wiki": 5500},
                max_vram_gb=40, device="cpu")
    return CalibrationRecord(**{**base, **over})


def test_the_calibrated_shape_when_the_card_has_room():
    s = resolve_step(AUTO, record(), free_vram_gb=70.0, headroom_gb=3.0)
    assert (s.tokens_per_step, s.gradient_checkpointing) == (2048, False)
    assert "calibrated" in s.basis and s.free_vram_gb == 70.0 and s.limit_gb == 37.0
    assert s.predicted_peak_gb == pytest.approx(6 + 3.5 * 2.048, abs=0.01)


def test_the_step_shrinks_when_less_is_free_than_calibrated():
    # 6 GB static + 3 GB headroom + 3.5 MB x 1,024 tokens: the calibrated 2,048 no longer fit
    s = resolve_step(AUTO, record(), free_vram_gb=12.6, headroom_gb=3.0)
    assert (s.tokens_per_step, s.gradient_checkpointing) == (1024, False)
    assert "shrunk from the calibrated 2,048 to 1,024" in s.basis and "12.6 GB free" in s.basis
    assert s.predicted_peak_gb <= s.limit_gb


def test_checkpointing_only_when_not_even_max_seq_length_fits_without_it():
    s = resolve_step(AUTO, record(), free_vram_gb=9.3, headroom_gb=3.0)  # 0.3 GB for activations
    assert s.gradient_checkpointing and 128 <= s.tokens_per_step < 2048
    assert "checkpointing on" in s.basis and "estimated" in s.basis  # no probed checkpointing line
    probed = record(checkpointing_memory=MemoryModel(static_gb=6.0, mb_per_token=0.5), checkpointing_measured=True)
    s2 = resolve_step(AUTO, probed, free_vram_gb=9.3, headroom_gb=3.0)
    assert s2.gradient_checkpointing and s2.tokens_per_step == 512 and "measured" in s2.basis
    # a config that forbids checkpointing gets the smallest step, and says why
    no_ckpt = AUTO.model_copy(update={"gradient_checkpointing": False})
    s3 = resolve_step(no_ckpt, record(), free_vram_gb=9.3, headroom_gb=3.0)
    assert not s3.gradient_checkpointing and s3.tokens_per_step == 128 and "nothing fits" in s3.basis


def test_the_cap_still_wins_over_free_memory_and_config_sizes_are_kept():
    s = resolve_step(AUTO, record(), free_vram_gb=90.0, max_vram_gb=12.6, headroom_gb=3.0)
    assert s.tokens_per_step == 1024
    fixed = AUTO.model_copy(update={"tokens_per_step": 4096})
    s2 = resolve_step(fixed, record(), free_vram_gb=12.6, headroom_gb=3.0)
    assert s2.tokens_per_step == 4096 and s2.gradient_checkpointing and "from config" in s2.basis
    assert resolve_step(AUTO, None, free_vram_gb=12.6).basis.endswith("(run `nightshift calibrate`)")


def test_the_speed_of_the_shape_used_measured_or_scaled():
    rates = [ShapeRate(tokens_per_step=8192, gradient_checkpointing=False, tokens_per_second=15000),
             ShapeRate(tokens_per_step=4096, gradient_checkpointing=False, tokens_per_second=14000)]
    assert rate_for_shape(rates, 4096, False) == (14000, "timed by calibrate", True)
    # seconds/step = c + n / r through the two sizes: 2,048 tokens are slower still, 16,384 not faster
    tps, how, measured = rate_for_shape(rates, 2048, False)
    assert tps < 14000 and "scaled" in how and not measured
    assert rate_for_shape(rates, 16384, False)[0] <= 15000
    tps, how, _ = rate_for_shape(rates, 8192, True)
    assert tps == pytest.approx(15000 * CKPT_SPEED_RATIO) and "checkpointing" in how


def row(origin, tps, detail, tokens=10_000):
    return {"origin": origin, "tokens_per_second": tps, "tokens": tokens, "seconds": tokens / tps,
            "overhead_seconds": 5.0, "detail": json.dumps(detail)}


class Row(dict):
    def keys(self):
        return list(super().keys())


def test_history_uses_rows_of_the_same_shape_or_scales_the_others_and_says_so():
    cal = record()
    cal_row = Row(row("calibrate", 5500, cal.model_dump(mode="json")))
    night = Row(row("run", 5000, {"tokens_per_step": 1024, "gradient_checkpointing": False}))
    small = StepShape(tokens_per_step=1024, gradient_checkpointing=False, basis="x")
    rows, note = history_for_shape([night, cal_row], small, cal)
    assert rows == [dict(night)] and "measured at this shape" in note  # a night measured this very shape
    ckpt = StepShape(tokens_per_step=2048, gradient_checkpointing=True, basis="x")
    rows, note = history_for_shape([cal_row], ckpt, cal)
    assert rows[0]["tokens_per_second"] == pytest.approx(5500 * CKPT_SPEED_RATIO)
    assert rows[0]["origin"].startswith("calibrate scaled x0.70") and "scaled to this shape" in note


class FakeNvml(SimpleNamespace):
    """NVML as jobs.gpu.telemetry.free_vram_gb reads it: a card with `free_gb` free."""

    def __init__(self, free_gb):
        super().__init__(free=free_gb * 1e9)

    def nvmlInit(self):
        pass

    def nvmlShutdown(self):
        pass

    def nvmlDeviceGetHandleByIndex(self, i):
        return f"card{i}"

    def nvmlDeviceGetHandleByUUID(self, uuid):
        return uuid

    def nvmlDeviceGetMemoryInfo(self, h, version=None):
        return SimpleNamespace(free=self.free, used=80e9 - self.free, total=80e9)


def test_a_night_shrinks_its_step_when_the_card_has_less_free_than_calibrated(night_env, monkeypatch):
    """The whole path: calibrate's record in the ledger, a fake NVML with 12.6 GB free; the plan
    predicts with the speed of the shape used (scaled, and says so); manifest and summary record why."""
    from jobs.gpu import telemetry as gpu
    from jobs.night.model import model_fingerprint, throughput_key
    from jobs.store.ledger import Ledger

    monkeypatch.setattr(gpu, "load_nvml", lambda: FakeNvml(12.6))
    inbox, make = night_env
    write_jsonl(inbox / "a.jsonl", [alpaca(i) for i in range(40)])
    cfg = make(train={"batching": "packed", "tokens_per_step": "auto", "gradient_checkpointing": "auto"},
               plan={"heldout_share": 0})
    cal = record(rates=[ShapeRate(tokens_per_step=1024, gradient_checkpointing=False, tokens_per_second=4000)])
    led = Ledger(cfg.state_dir / "ledger.sqlite")
    led.record_calibration(throughput_key(cfg, model_fingerprint(cfg.model.path), "hf", "cpu"), cal,
                           tokens=11_000, seconds=2.0)
    led.close()
    s = run(cfg)
    assert s["outcome"] in ("succeeded", "rejected"), s["error"]
    shape = s["step_shape"]
    assert shape["tokens_per_step"] == 1024 and shape["free_vram_gb"] == pytest.approx(12.6)
    assert "shrunk" in shape["basis"]
    # the speed calibrate timed for 1,024 tokens (of its slower profile), at these short samples' profile
    assert s["plan"]["tokens_per_second"] == pytest.approx(4000 * 6000 / 5500)
    assert "scaled to this shape (1,024 tok/step" in s["plan_basis"]
    assert s["plan"]["step_shape"]["tokens_per_step"] == 1024
    manifest = json.loads((cfg.state_dir / "adapters" / "tiny-v0001" / "manifest.json").read_text())
    assert manifest["training"]["step_shape"]["basis"] == shape["basis"]
    assert manifest["training"]["tokens_per_step"] == 1024
