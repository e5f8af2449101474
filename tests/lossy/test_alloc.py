"""The allocations (tierkv.lossy.alloc): they fit their budget, spend bits where the
importance says errors cost most, evict only what is cheap to lose, and beat the
uniform allocation at the same budget on the distortion they model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tierkv.errors import ConfigError, InputError
from tierkv.lossy.alloc import Calibration, Importance, _tables, allocate, uniform
from tierkv.lossy.format import decode, encode, size_bits

L, T, H, D = 4, 128, 2, 64   # pages as the bench codes them (parameters 0.25 + 0.5 bits an element)


def page(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((L, 2, T, H, D)).astype(np.float32)


def peaked(seed: int = 0) -> Importance:
    """Attention on a few tokens (as real models put it: the first, and some others)."""
    rng = np.random.default_rng(seed)
    a = rng.exponential(1.0, (L, H, T)) ** 4
    a[:, :, 0] += a.sum(axis=-1) * 2
    a /= a.sum(axis=-1, keepdims=True)
    return Importance(a ** 2, rng.exponential(1.0, (L, H, D)))


def modelled(x: np.ndarray, imp: Importance, dec_page: np.ndarray, kept: np.ndarray) -> float:
    """The distortion the allocator models, of a decoded page (evicted tokens at their cost)."""
    vals, keys = x[:, 1], x[:, 0]
    vdev = ((vals - vals.mean(axis=1, keepdims=True)) ** 2).sum(axis=-1).transpose(0, 2, 1)
    ev = ((dec_page[:, 1] - vals) ** 2).sum(axis=-1).transpose(0, 2, 1)          # [L, H, T]
    ek = ((dec_page[:, 0] - keys) ** 2).transpose(0, 2, 3, 1)                    # [L, H, D, T]
    dv = (imp.a2 * ev)[:, :, kept].sum()
    dk = (imp.qe[..., None] / D * ek * (imp.a2 * vdev)[:, :, None, :])[..., kept].sum()
    devict = (imp.a2 * vdev)[:, :, ~kept].sum()
    return float(dv + dk + devict)


@pytest.mark.parametrize("budget", [2.5, 3.0, 4.0, 8.0])
def test_allocations_fit_the_budget(budget: float) -> None:
    x = page()
    for a in (allocate(x, budget, peaked()), allocate(x, budget), allocate(x, budget, evict=False),
              uniform(x.shape, budget)):
        bits = size_bits(a, H, D)
        assert bits <= budget * x.size and bits == 8 * len(encode(x, a, "fp32", budget))
        assert bits >= 0.9 * budget * x.size     # and use most of it


def test_rd_beats_uniform_on_the_distortion_it_models_and_evicts_the_unattended() -> None:
    x, imp = page(3), peaked(3)
    for budget in (2.5, 4.0):
        rd = decode(encode(x, allocate(x, budget, imp), "fp32", budget))
        un = decode(encode(x, uniform(x.shape, budget), "fp32", budget))
        assert un.kept.all()
        assert modelled(x, imp, rd.page, rd.kept) < modelled(x, imp, un.page, un.kept)
    a = allocate(x, 2.5, imp)
    attention = imp.a2.sum(axis=(0, 1))
    assert a.kept[0] and not a.kept.all()                         # the sink stays; some tokens go
    assert attention[a.kept].mean() > attention[~a.kept].mean()    # what goes is what was least attended
    # Of the tokens kept, the most attended get wider values than the least.
    kept = np.flatnonzero(a.kept)
    order = kept[np.argsort(attention[kept])]
    assert order.size >= 8
    assert a.value_bits[:, order[-4:]].mean() > a.value_bits[:, order[:order.size // 2]].mean()
    assert allocate(x, 2.5, imp, evict=False).kept.all()


@pytest.mark.parametrize("shape", [(2, 2, 69, 3, 2), (3, 2, 127, 1, 33), (1, 2, 200, 2, 5), (2, 2, 17, 2, 64)])
def test_odd_shapes_fit_the_budget_to_the_bit(shape: tuple[int, ...]) -> None:
    """Code streams are padded to bytes: odd token and channel counts must still fit."""
    rng = np.random.default_rng(sum(shape))
    for seed in range(20):
        x = rng.standard_normal(shape).astype(np.float32)
        for budget in (3.0, 5.0, 9.5):
            for evict in (True, False):
                try:
                    a = allocate(x, budget, evict=evict)
                except InputError:      # a budget below what this small page needs at its narrowest
                    continue
                assert size_bits(a, shape[3], shape[4]) <= budget * x.size, (seed, budget, evict)


def test_a_budget_below_the_narrowest_coding_is_refused() -> None:
    with pytest.raises(InputError, match="below uniform 2-bit"):
        uniform(page().shape, 1.0)
    with pytest.raises(InputError, match="below what this page needs"):
        allocate(page(), 0.01, evict=False)


def test_importance_and_calibration_are_checked(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="importance for"):
        allocate(page(), 4.0, Importance(np.ones((L, H, T + 1)), np.ones((L, H, D))))
    with pytest.raises(InputError, match="finite and >= 0"):
        allocate(page(), 4.0, Importance(-np.ones((L, H, T)), np.ones((L, H, D))))
    with pytest.raises(InputError, match="calibration has 3 layers"):
        allocate(page(), 4.0, calibration=Calibration.neutral(3))
    cal = Calibration("m", (1.0, 2.0, 0.5, 0.0), (0.1, 0.2, 0.3, 0.4))
    cal.save(tmp_path / "c.json")
    assert Calibration.load(tmp_path / "c.json") == cal
    (tmp_path / "bad.json").write_text('{"format": 1, "model_id": "m", "key": [1, -1], "value": [1, 1]}')
    with pytest.raises(ConfigError, match="finite sensitivity"):
        Calibration.load(tmp_path / "bad.json")
    with pytest.raises(ConfigError, match="not a tierkv calibration"):
        Calibration.load(tmp_path / "missing.json")


def test_a_layer_the_calibration_says_is_sensitive_gets_more_bits() -> None:
    x, imp = page(5), peaked(5)
    cal = Calibration("m", (1.0,) * L, (1.0, 1.0, 1.0, 1000.0))
    a = allocate(x, 3.0, imp, cal, evict=False)
    assert a.value_bits[3].mean() > a.value_bits[:3].mean()
    t, n = _tables(x, imp, cal), _tables(x, imp, Calibration.neutral(L))
    assert np.allclose(t.dv[:, 3], 1000 * n.dv[:, 3]) and np.array_equal(t.dv[:, :3], n.dv[:, :3])
    assert np.array_equal(t.dk, n.dk)


def test_a_calibrations_query_energy_stands_in_where_no_importance_comes(tmp_path: Path) -> None:
    qe = np.ones((L, H, D))
    qe[:, :, :4] = 1000.0                  # four channels the model's queries lean on
    cal = Calibration("m", (1.0,) * L, (1.0,) * L, qe)
    cal.save(tmp_path / "c.json")
    back = Calibration.load(tmp_path / "c.json")
    assert back == cal and back.query_energy is not None and np.allclose(back.query_energy, qe)
    x = page(6)
    a = allocate(x, 3.0, None, cal, evict=False)
    assert a.key_bits[:, :, :4].mean() > a.key_bits[:, :, 4:].mean()
    same = allocate(x, 3.0, Importance(Importance.flat(L, T, H, D).a2, qe), cal, evict=False)
    blind = allocate(x, 3.0, None, Calibration("m", (1.0,) * L, (1.0,) * L), evict=False)
    assert np.array_equal(a.key_bits, same.key_bits) and np.array_equal(a.value_bits, same.value_bits)
    assert not np.array_equal(a.key_bits, blind.key_bits)
    with pytest.raises(InputError, match=f"query energy is for {H + 1} heads"):
        allocate(x, 3.0, None, Calibration("m", (1.0,) * L, (1.0,) * L, np.ones((L, H + 1, D))))
    for bad in ("[[1, 2]]", "[[[-1]]]", '"x"'):
        (tmp_path / "q.json").write_text('{"format": 1, "model_id": "m", "key": [1], "value": [1], '
                                         f'"query_energy": {bad}}}')
        with pytest.raises(ConfigError, match="query_energy|not a tierkv calibration"):
            Calibration.load(tmp_path / "q.json")


@pytest.mark.parametrize("shape", [(2, 16, 8, 7), (2, 512, 2, 7), (4, 16, 8, 128), (2, 1, 8, 128), (1, 7, 2, 64),
                                   (1, 3, 1, 64), (2, 3, 2, 7), (30, 128, 3, 64)])
def test_min_budget_is_the_floor_of_an_allocation_keeping_every_token(shape: tuple[int, int, int, int]) -> None:
    """What a lossy tier's config checks its budget against: allocate(evict=False) fits
    there and not below (the rate model once counted parameters eight times over, and
    its floor was not this)."""
    from tierkv.lossy.format import min_budget

    layers, tokens, heads, dim = shape
    floor = min_budget(layers, tokens, heads, dim)
    x = np.random.default_rng(3).standard_normal((layers, 2, tokens, heads, dim)).astype(np.float32)
    if floor * (1 + 1e-9) < 16:
        allocate(x, floor * (1 + 1e-9), evict=False)
    with pytest.raises(InputError, match="below what this page needs"):
        allocate(x, floor * (1 - 1e-3), evict=False)

