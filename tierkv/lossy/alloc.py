"""Bit allocation for lossy pages: rate-distortion (RDKV) and uniform, under a budget.

The distortion model is first order in the attention output of each layer, each KV
head (``a2``: the mean squared attention a token receives from the scoring window's
queries; ``qe``: the mean squared query per key channel; ``vdev``: how far a token's
value is from the page's mean value):

- a value group (layer ``l``, token ``t``) at width ``b``: ``sV[l] * sum_h a2[l,h,t] * err``;
- a key group (layer ``l``, head ``h``, channel ``c``) at width ``b``:
  ``sK[l] * qe[l,h,c] / dim * sum_t a2[l,h,t] * vdev[l,h,t] * err[t]`` (a key error moves
  the logit by ``q . e / sqrt(dim)`` and the output by that times ``v - o``);
- an evicted token: ``sV[l] * sum_h a2[l,h,t] * vdev[l,h,t]``, summed over layers;

where ``err`` is the exact squared error the format's quantization makes at that width
(:func:`tierkv.lossy.quant.errors`) and ``sK``, ``sV`` the per-layer sensitivities a
calibration measured (:class:`Calibration`; 1 where none). The allocation minimizes the
sum of distortions plus ``lambda`` times the blob's bits, each group (and each token's
keep-or-evict) on its own, with ``lambda`` bisected until the blob fits the budget
(:func:`tierkv.lossy.format.size_bits`, header and parameters included).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tierkv.errors import ConfigError, InputError
from tierkv.lossy.format import Allocation, quant_params, size_bits
from tierkv.lossy.quant import BITS, roundtrip

_QWIDTHS = (2, 4, 8, 16)


@dataclass(frozen=True)
class Importance:
    """What the allocation weighs errors by, for one page: ``a2[layer, head, token]``
    (mean squared attention each token receives) and ``qe[layer, head, channel]`` (mean
    squared query per channel). :meth:`flat` where nothing is known."""

    a2: np.ndarray
    qe: np.ndarray

    @classmethod
    def flat(cls, layers: int, tokens: int, heads: int, dim: int) -> Importance:
        return cls(np.full((layers, heads, tokens), 1.0 / tokens, np.float64), np.ones((layers, heads, dim)))

    def check(self, layers: int, tokens: int, heads: int, dim: int) -> None:
        if self.a2.shape != (layers, heads, tokens) or self.qe.shape != (layers, heads, dim):
            raise InputError(f"importance for {layers} layers, {heads} heads, {tokens} tokens, {dim} channels: "
                             f"got a2 {self.a2.shape}, qe {self.qe.shape}")
        for name, v in (("a2", self.a2), ("qe", self.qe)):
            if not np.isfinite(v).all() or (v < 0).any():
                raise InputError(f"importance {name} must be finite and >= 0")


@dataclass(frozen=True)
class Calibration:
    """Per-layer sensitivities of a model's loss to the modelled distortion of its keys
    (``key``) and values (``value``), as ``tierkv calibrate`` measured them; saved as JSON.

    ``query_energy`` (``[layer, head, channel]``, optional): the mean squared query per key
    channel on the calibration text, which stands in for :attr:`Importance.qe` where a
    page comes without importance (a lossy tier's conversions): a property of the model
    more than of the text, and what most separates key channels' worth."""

    model_id: str
    key: tuple[float, ...]
    value: tuple[float, ...]
    query_energy: np.ndarray | None = field(default=None, compare=False)

    @classmethod
    def neutral(cls, layers: int, model_id: str = "") -> Calibration:
        return cls(model_id, (1.0,) * layers, (1.0,) * layers)

    def save(self, path: str | Path) -> None:
        doc: dict[str, object] = {"format": 1, "model_id": self.model_id, "key": list(self.key),
                                  "value": list(self.value)}
        if self.query_energy is not None:
            doc["query_energy"] = [[[float(f"{x:.6g}") for x in ch] for ch in head] for head in self.query_energy]
        Path(path).write_text(json.dumps(doc, indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        try:
            doc = json.loads(Path(path).read_text())
            qe = doc.get("query_energy")
            cal = cls(str(doc["model_id"]), tuple(float(x) for x in doc["key"]), tuple(float(x) for x in doc["value"]),
                      None if qe is None else np.asarray(qe, np.float64))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ConfigError(f"{path} is not a tierkv calibration file (tierkv calibrate writes one): {exc}") from None
        if doc.get("format") != 1 or len(cal.key) != len(cal.value) or not all(
                np.isfinite(x) and x >= 0 for x in cal.key + cal.value):
            raise ConfigError(f"{path}: a calibration of format 1 with one finite sensitivity >= 0 per layer for "
                              "keys and for values")
        q = cal.query_energy
        if q is not None and (q.ndim != 3 or q.shape[0] != len(cal.key) or not q.size or not np.isfinite(q).all()
                              or (q < 0).any()):
            raise ConfigError(f"{path}: query_energy must be finite numbers >= 0, [layers][heads][channels] with "
                              f"{len(cal.key)} layers, got shape {q.shape}")
        return cal


@dataclass(frozen=True)
class _Tables:
    """Distortion of every group at every width (the search's lookup tables)."""

    dv: np.ndarray      # [4 widths, L, T]: value groups at 2, 4, 8, 16 bits
    dk: np.ndarray      # [5 widths, L, H, D]: key groups at 0, 2, 4, 8, 16 bits
    devict: np.ndarray  # [T]


def _tables(page: np.ndarray, imp: Importance, cal: Calibration) -> _Tables:
    L, _, T, H, D = page.shape
    sk = np.asarray(cal.key, np.float64)[:, None, None]
    sv = np.asarray(cal.value, np.float64)[:, None]
    keys = page[:, 0].transpose(0, 2, 3, 1)                    # [L, H, D, T]
    vals = page[:, 1]                                          # [L, T, H, D]
    vdev = ((vals - vals.mean(axis=1, keepdims=True)) ** 2).sum(axis=-1).transpose(0, 2, 1)   # [L, H, T]
    weight = imp.a2 * vdev                                     # [L, H, T]
    with np.errstate(invalid="ignore", over="ignore"):
        dv = np.stack([sv * (imp.a2.transpose(0, 2, 1) * ((roundtrip(vals, b) - vals) ** 2).sum(axis=-1)).sum(axis=-1)
                       for b in _QWIDTHS])                      # [4, L, T]
        dk = np.stack([sk * imp.qe / D * (((roundtrip(keys, b) - keys) ** 2) * weight[:, :, None, :]).sum(axis=-1)
                       for b in BITS])                          # [5, L, H, D]
    devict = (sv * weight.sum(axis=1)).sum(axis=0)             # [T]
    # A width whose parameters float16 cannot hold has infinite error (never chosen), also
    # where its weight is 0 (inf * 0).
    return _Tables(np.nan_to_num(dv, nan=np.inf), np.nan_to_num(dk, nan=np.inf), devict)


def _choose(t: _Tables, lam: float, kept_tokens: int, heads: int, dim: int, evict: bool) -> Allocation:
    """The allocation minimizing distortion + ``lam`` x bits, the keys sized for
    ``kept_tokens`` (the previous round's count)."""
    n = max(kept_tokens, 1)
    kcost = np.array([n * b + 8 * quant_params(b) for b in BITS], np.float64)
    kidx = np.argmin(t.dk + lam * kcost[:, None, None, None], axis=0)
    key_bits = np.array(BITS)[kidx]
    vcost = np.array([heads * (dim * b + 8 * quant_params(b)) + 8 for b in _QWIDTHS], np.float64)
    vj = t.dv + lam * vcost[:, None, None]
    vidx = np.argmin(vj, axis=0)
    value_bits = np.array(_QWIDTHS)[vidx]
    if evict:
        keep_cost = vj.min(axis=0).sum(axis=0) + lam * float(key_bits.sum())   # per token: its values and keys
        kept = keep_cost <= t.devict
        value_bits = np.where(kept[None, :], value_bits, 0)
    return Allocation(key_bits, value_bits)


def allocate(page: np.ndarray, budget: float, importance: Importance | None = None,
             calibration: Calibration | None = None, *, evict: bool = True) -> Allocation:
    """The rate-distortion allocation of ``page`` (float32 ``[layers, 2, tokens, heads, dim]``)
    whose blob is at most ``budget`` average bits per element (every section counted);
    ``evict=False`` keeps every token (for engines that cannot drop one). InputError where
    the budget is below what the format needs at its narrowest."""
    L, _, T, H, D = page.shape
    if not np.isfinite(page).all():
        raise InputError("a lossy page codes finite values only; this page holds NaN or infinity")
    if min(L, T, H, D) < 1:
        raise InputError(f"a page has at least one of everything, got shape {page.shape}")
    cal = calibration if calibration is not None else Calibration.neutral(L)
    if len(cal.key) != L:
        raise InputError(f"the calibration has {len(cal.key)} layers, the page {L}")
    if importance is not None:
        imp = importance
    elif cal.query_energy is not None:   # no attention statistics: flat over tokens, the model's channels
        if cal.query_energy.shape != (L, H, D):
            raise InputError(f"the calibration's query energy is for {cal.query_energy.shape[1]} heads of "
                             f"{cal.query_energy.shape[2]} channels, the page has {H} of {D}")
        imp = Importance(Importance.flat(L, T, H, D).a2, cal.query_energy)
    else:
        imp = Importance.flat(L, T, H, D)
    imp.check(L, T, H, D)
    limit = budget * page.size
    tables = _tables(np.asarray(page, np.float32), imp, cal)

    def at(lam: float) -> Allocation:
        a = _choose(tables, lam, T, H, D, evict)
        return _choose(tables, lam, int(a.kept.sum()), H, D, evict)   # keys costed for the tokens kept

    lo, hi = 0.0, 1.0
    best = at(hi)
    while size_bits(best, H, D) > limit:
        hi *= 16
        if hi > 1e30:
            floor = size_bits(best, H, D) / page.size
            raise InputError(f"a budget of {budget} bits per element is below what this page needs at its "
                             f"narrowest ({floor:.3f})")
        best = at(hi)
    if size_bits(at(0.0), H, D) <= limit:
        return at(0.0)
    for _ in range(48):   # bisect lambda (geometric): the cheapest allocation that fits
        mid = (lo * hi) ** 0.5 if lo > 0 else hi / 1024
        a = at(mid)
        if size_bits(a, H, D) <= limit:
            best, hi = a, mid
        else:
            lo = mid
        if lo > 0 and hi / lo < 1.0005:
            break
    return _fill(best, tables, limit, H, D)


def _fill(a: Allocation, t: _Tables, limit: float, heads: int, dim: int) -> Allocation:
    """``a`` with groups moved one width up, most distortion saved per bit first, while the
    blob still fits ``limit`` bits (what the bisection left: widths are discrete). Each
    code stream is padded to a byte, which moving groups between streams changes: 32 bits
    are held back for that, and the result is checked against the exact size."""
    slack = limit - size_bits(a, heads, dim) - 32
    kept = a.kept
    n = int(kept.sum())
    if slack <= 0 or not n:
        return a
    up = {2: 4, 4: 8, 8: 16}
    pbits = {2: 32, 4: 32, 8: 32, 16: 0}
    cands: list[tuple[float, float, str, tuple[int, ...]]] = []
    kb, vb = a.key_bits.copy(), a.value_bits.copy()
    for (layer, h, c), b in np.ndenumerate(kb):
        if b in up:
            cost = n * (up[b] - b) + pbits[up[b]] - pbits[b]
            gain = t.dk[BITS.index(b), layer, h, c] - t.dk[BITS.index(up[b]), layer, h, c]
            if gain > 0:
                cands.append((gain / max(cost, 1), cost, "k", (layer, h, c)))
    for (layer, tok), b in np.ndenumerate(vb):
        if b in up:
            cost = heads * (dim * (up[b] - b) + pbits[up[b]] - pbits[b])
            gain = t.dv[_QWIDTHS.index(b), layer, tok] - t.dv[_QWIDTHS.index(up[b]), layer, tok]
            if gain > 0:
                cands.append((gain / max(cost, 1), cost, "v", (layer, tok)))
    cands.sort(key=lambda c: -c[0])
    for _, cost, kind, at in cands:
        if cost <= slack:
            if kind == "k":
                kb[at] = up[int(kb[at])]
            else:
                vb[at] = up[int(vb[at])]
            slack -= cost
    filled = Allocation(kb, vb)
    return filled if size_bits(filled, heads, dim) <= limit else a


def uniform(page_shape: tuple[int, ...], budget: float) -> Allocation:
    """The importance-blind baseline: every token kept, every group at the largest of 2,
    4, 8, 16 bits that fits, and groups in a fixed stride moved to the next width up as
    far as the budget goes (so it uses the same budget)."""
    L, _, T, H, D = page_shape
    limit = budget * float(np.prod(page_shape))
    widths = [b for b in _QWIDTHS if size_bits(Allocation(np.full((L, H, D), b), np.full((L, T), b)), H, D) <= limit]
    if not widths:
        raise InputError(f"a budget of {budget} bits per element is below uniform 2-bit coding of this page")
    b = widths[-1]
    if b == 16:
        return Allocation(np.full((L, H, D), 16), np.full((L, T), 16))
    up = _QWIDTHS[_QWIDTHS.index(b) + 1]
    nk, nv = L * H * D, L * T

    def mix(f: float) -> Allocation:
        kb = np.full(nk, b)
        vb = np.full(nv, b)
        kb[_spread(nk, f)] = up
        vb[_spread(nv, f)] = up
        return Allocation(kb.reshape(L, H, D), vb.reshape(L, T))

    lo, hi = 0.0, 1.0
    for _ in range(30):
        mid = (lo + hi) / 2
        if size_bits(mix(mid), H, D) <= limit:
            lo = mid
        else:
            hi = mid
    return mix(lo)


def _spread(n: int, fraction: float) -> np.ndarray:
    """``round(n * fraction)`` indices of ``range(n)`` spread evenly (importance-blind)."""
    k = int(n * fraction)
    return np.unique((np.arange(k) * (n / k)).astype(np.int64)) if k else np.zeros(0, np.int64)
