"""jobs/gpu/cards.py: a night on several cards reports their sums, and each card's own reading."""

from jobs.gpu.cards import CardsSampler
from tests.test_gpu import GIB, Clock, FakeNvml


def test_two_cards_are_summed_and_each_is_reported_with_its_label() -> None:
    nvml = FakeNvml([250_000], [1_000_000, 1_100_000, 1_200_000, 1_300_000, 1_400_000, 1_500_000], devices=2)
    events = []
    s = CardsSampler(events.append, devices=[0, 1], labels=["2", "3"], nvml=nvml, clock=Clock(),
                     peak_memory=lambda: (10 * GIB, 12 * GIB))
    assert s.start(background=False)
    s.sample()
    summary = s.stop()
    first = events[0]
    assert first.power_watts == 500.0 and [c.power_watts for c in first.cards] == [250.0, 250.0]
    assert [c.gpu for c in first.cards] == ["2", "3"]
    assert first.vram_used_bytes == 2 * 30 * GIB and first.vram_total_bytes == 2 * 96 * GIB
    assert first.utilization_ratio == 0.87 and first.temperature_celsius == 64.0
    assert summary is not None and summary.total_memory_bytes == 2 * 96 * GIB
    assert summary.name == "2x Fake GPU 96GB" and summary.peak_reserved_bytes == 12 * GIB
    assert summary.energy_joules is not None and summary.energy_joules > 0


def test_no_card_opens_is_no_gpu() -> None:
    s = CardsSampler(lambda _: None, devices=[0, 1], labels=["0", "1"], nvml=FakeNvml([1], [1], init_error=True))
    assert not s.start(background=False) and s.sample() is None
