"""What DeepSpeed adds per engine mode, from calibration samples (`engine_figures`): the
medians of each mode's own samples, ZeRO-3's step less its refresh all-gathers at the mode's
median latency; worked by hand."""

from __future__ import annotations

import pytest

from dspark_ds.tune.calibrate import engine_figures
from dspark_ds.tune.cluster import ENGINE_MODES

MS, US = 1e-3, 1e-6


def sample(mode: int, step_ms: float, latency_us: float, refreshes: int, micro_ms=1.0) -> dict:
    engine = dict(micro=micro_ms * MS, step=step_ms * MS, fwd_call=0.0, bwd_call=0.0)
    engine.update(target_call=0.0, refreshes=float(refreshes))
    return {"mode": mode, "all_gather_latency_s": latency_us * US, "engine": engine}


def test_each_modes_median_and_zero3s_refreshes_at_the_median_latency():
    zero1, zero3 = ENGINE_MODES.index("zero1"), ENGINE_MODES.index("zero3+off+param")
    samples = [
        sample(zero1, 4.0, 300, 0, micro_ms=5.0),
        sample(zero1, 9.0, 2000, 0, micro_ms=4.0),
        sample(zero1, 5.0, 400, 0, micro_ms=6.0),
        # a 2.2 ms latency in one sample: its own step less 18 of it would be below 0
        sample(zero3, 26.2, 2229, 18),
        sample(zero3, 18.62, 240, 18),
        sample(zero3, 18.85, 318, 18),
        sample(zero3, 20.24, 410, 18),
    ]
    got = engine_figures(samples)
    assert got["engine_micro_s"][zero1] == pytest.approx(5.0 * MS)
    assert got["engine_step_s"][zero1] == pytest.approx(5.0 * MS)  # no refreshes below ZeRO-3
    # median step (18.85 + 20.24) / 2 less 18 x the median latency (318 + 410) / 2
    assert got["engine_step_s"][zero3] == pytest.approx((19.545 - 18 * 0.364) * MS)
    for mode in set(range(len(ENGINE_MODES))) - {zero1, zero3}:  # no samples: 0
        assert got["engine_micro_s"][mode] == got["engine_step_s"][mode] == 0.0


def test_the_step_never_goes_below_zero_and_one_rank_has_no_latency():
    zero3 = ENGINE_MODES.index("zero3")
    got = engine_figures([sample(zero3, 2.0, 500, 18)])
    assert got["engine_step_s"][zero3] == 0.0
    alone = sample(zero3, 2.0, 0, 18)
    del alone["all_gather_latency_s"]  # one rank: no collectives sampled
    assert engine_figures([alone])["engine_step_s"][zero3] == pytest.approx(2.0 * MS)
