import math
import random

import pytest

from scheduler import BatchShape, CostModel, Drift
from scheduler.cost import COEFFS


def test_serial_weight_prices_steps_not_tokens():
    """Same token count: 32 segments of 64 tokens cost 1 serial step, one 2048-token segment 32."""
    c = CostModel(c0=1e-3, c_tok=1e-5, c_serial=2e-4, chunk=64)
    many = BatchShape([(0, 64)] * 32)
    one = BatchShape([(0, 2048)])
    assert many.tokens == one.tokens == 2048
    assert c.step_time(many) == pytest.approx(1e-3 + 1e-5 * 2048 + 2e-4 * 1)
    assert c.step_time(one) == pytest.approx(1e-3 + 1e-5 * 2048 + 2e-4 * 32)
    assert c.step_time(BatchShape([(0, 65)])) - c.step_time(BatchShape([(0, 64)])) == pytest.approx(1e-5 + 2e-4)


def test_attention_and_decode_terms():
    """Attention pairs sum extend * (prefix + extend / 2) per layer; decode rows pay their context."""
    c = CostModel(c_attn=1e-9, c_dec_attn=1e-8, c_dec=1e-4, attn_layers=3)
    shape = BatchShape([(100, 50), (0, 10)], decode=[1000, 2000])
    attn = (50 * (100 + 25) + 10 * 5) * 3 * 1e-9
    assert c.step_time(shape) == pytest.approx(attn + 3000 * 3 * 1e-8 + 2 * 1e-4)
    assert c.step_time(BatchShape()) == 0.0


def test_fit_recovers_coefficients():
    """Least squares on timed forwards recovers the generating coefficients within 2%."""
    truth = CostModel(c0=2e-3, c_tok=2e-5, c_attn=3e-10, c_prefix=3e-8, c_dec_attn=4e-9, c_serial=1.5e-4,
                      c_dec=5e-5, attn_layers=2)
    rng = random.Random(0)
    samples = []
    for _ in range(300):
        pre = [(rng.choice([0, 512, 4096]), rng.randint(1, 3000)) for _ in range(rng.randint(0, 3))]
        dec = [rng.randint(100, 8000) for _ in range(rng.randint(0 if pre else 1, 32))]
        shape = BatchShape(pre, dec)
        samples.append((shape, truth.step_time(shape) * (1 + rng.gauss(0, 0.005))))
    fit = CostModel.fit(samples, attn_layers=2)
    for name in COEFFS:
        assert getattr(fit, name) == pytest.approx(getattr(truth, name), rel=0.02), name


def test_profile_json_round_trip_and_shipped(tmp_path):
    """Profiles round-trip through JSON; the shipped H200 profile loads and documents its sources."""
    c = CostModel(c0=1.0, c_serial=2.0, chunk=128, attn_layers=4, meta={"source": "test"})
    c.to_json(tmp_path / "p.json")
    assert CostModel.load(tmp_path / "p.json") == c
    h200 = CostModel.load("kimi_linear_48b_h200")
    assert h200.attn_layers == 7 and h200.c_serial > 0 and "c_serial" in h200.meta["derivation"]
    one_m = h200.step_time(BatchShape([(0, 1 << 20)]))
    assert 100 < one_m < 200 and math.isfinite(one_m)


def test_bad_profiles_are_named(tmp_path):
    """A negative coefficient, an unknown field or an unknown profile name is a clear error."""
    with pytest.raises(ValueError, match="c_tok"):
        CostModel(c_tok=-1.0)
    (tmp_path / "bad.json").write_text('{"c0": 1.0, "c_flux": 2.0}')
    with pytest.raises(ValueError, match="c_flux"):
        CostModel.load(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="kimi_linear_48b_h200"):
        CostModel.load("no_such_profile")


def test_drift_is_the_median_ratio_of_a_full_window_of_long_enough_rounds():
    """Drift answers only once `window` rounds predicted at min_predicted or more are recorded
    (shorter ones are skipped), then the median measured / predicted over the last `window`."""
    d = Drift(window=3, min_predicted=0.01)
    assert d.observe(0.02, 0.04) is None and d.observe(0.001, 1.0) is None  # the short one is not counted
    assert d.observe(0.02, 0.02) is None
    assert d.observe(0.02, 0.10) == 2.0  # ratios 2, 1, 5
    assert d.observe(0.02, 0.10) == 5.0  # 1, 5, 5: the first left the window
