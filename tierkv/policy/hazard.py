"""Reuse statistics per page class, turned into an eviction index: the Gittins-style hit density.

:class:`ReuseModel` learns, for each class of page, how long after an access the page
is accessed again. It is fed every access of every request (cached or not), so what
it learns does not depend on what the cache happened to keep. From the observed reuse
ages it estimates a discrete hazard with Kaplan-Meier at-risk counts (a page seen 50
requests ago that has not come back yet is *censored*, not a page that never comes
back), and from the hazard the index

    index(class, age) = max over T > age of  P(reuse in (age, T] | alive at age)
                                           / E[page-time held from age until reuse or T]

that is, the best hits per slot per unit of time that keeping the page can still
earn. Evicting the lowest index is the hit-density rule of LHD (Beckmann et al.,
NSDI'18) with the horizon chosen optimally, which is what lets a page sit through a
think time in which it is certain not to be used. Ages are measured in whatever clock
the caller uses (the policies use requests); bins are geometric.

Used by :mod:`tierkv.policy.gittins`. Pure computation, no I/O; not thread-safe.
"""

from __future__ import annotations

import math
import os

import numpy as np

try:  # the compiled histogram updates; optional so that a machine without a compiler still works
    from tierkv.policy._ghost import record as _record  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover - exercised where the extension is absent
    _record = None
try:  # the compiled index table (an extension built before it lacks it: numpy then)
    from tierkv.policy._ghost import gittins_index as _gittins_index  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover - exercised where the extension is absent
    _gittins_index = None
if os.environ.get("TIERKV_PURE_POLICY") == "1":
    _record = _gittins_index = None

#: What :meth:`ReuseModel.record_many` takes: bytes or a numpy array.
Buffer = bytes | np.ndarray

#: Geometric growth of the age bins: bin b covers ages [GROWTH**b - 1, GROWTH**(b+1) - 1).
GROWTH = 1.1
#: Number of age bins; the last one covers ages beyond about 190,000 clock units.
BINS = 128
_LOG_GROWTH = math.log(GROWTH)
_EDGES = np.array([math.expm1(b * _LOG_GROWTH) for b in range(BINS + 1)])
_MIDS = (_EDGES[:-1] + _EDGES[1:]) / 2
#: Unresolved pages are counted per bucket of this many clock units of their last access.
_BUCKET = 8
_RING = 1 << 15
#: Oldest age the model tracks; older unresolved pages must be censored by the caller.
MAX_AGE = float(_BUCKET * (_RING - 2))
#: Kinds of observation in :meth:`ReuseModel.record_many`: :meth:`~ReuseModel.start`,
#: :meth:`~ReuseModel.reuse`, :meth:`~ReuseModel.censor`.
START, REUSE, CENSOR = 0, 1, 2


def age_bin(age: float) -> int:
    """The bin of an age (clock units); ages <= 0 fall in bin 0."""
    if age <= 0.0:
        return 0
    b = int(math.log1p(age) / _LOG_GROWTH)
    return b if b < BINS else BINS - 1


#: Memories past the weight reference after which :meth:`ReuseModel.advance` rebases
#: (refresh rebases after 64; e^128 times any count stays far inside a double).
_ADVANCE_MEMORIES = 128


class ReuseModel:
    """Reuse-age histograms for ``classes`` classes and the index table derived from them.

    ``memory`` is the time constant (clock units) over which old observations fade, so
    the model follows a changing workload; ``prior`` is how many observations' worth a
    class's hazard is pulled toward the hazard of all classes pooled (sparse classes and
    old ages borrow strength). ``index[c][b]`` and ``support[c][b]`` (the weight of reuses
    observed at ages from bin ``b`` on, which sets the index's relative error at about
    ``1/sqrt(support)``) are refreshed by :meth:`refresh`.
    """

    def __init__(self, classes: int, memory: float = 4096.0, prior: float = 4.0) -> None:
        if classes < 1 or memory <= 0 or prior < 0:
            raise ValueError(f"ReuseModel needs classes >= 1, memory > 0, prior >= 0; "
                             f"got {classes}, {memory}, {prior}")
        self.classes = classes
        self._memory = memory
        self._prior = prior
        self._t_ref = 0.0
        self._reuses = np.zeros((classes, BINS))
        self._resolved = np.zeros((classes, BINS + 1))   # difference array of at-risk counts
        self._open = np.zeros((classes, _RING))           # unresolved pages by bucket of last access
        # Before any data: evict the oldest first, as LRU would.
        self.index: list[list[float]] = [list(1.0 / (1.0 + _MIDS)) for _ in range(classes)]
        self.support: list[list[float]] = [[0.0] * BINS for _ in range(classes)]
        self._tables: tuple[bytes, bytes] | None = None
        self._observed = False   # any observation yet: until one, a rebase has nothing to scale

    def _weight(self, t: float) -> float:
        return math.exp((t - self._t_ref) / self._memory)

    def advance(self, now: float) -> None:
        """Rebase the weights on ``now`` before observations or a refresh at ``now`` if the
        clock ran far past the reference without a refresh (a reopen inserts its pages
        with no request between them, and the clock moves one a page): otherwise the
        weights overflow a double beyond about 709 memories. In steady use each refresh
        rebases after 64 memories, so this never fires and changes no bit."""
        if now - self._t_ref > _ADVANCE_MEMORIES * self._memory:
            self._rebase(now)

    def start(self, cls: int, t: float) -> None:
        """A page of class ``cls`` was accessed at ``t``: it is now waiting for its next access."""
        self._observed = True
        self._open[cls, int(t) // _BUCKET % _RING] += self._weight(t)

    def reuse(self, cls: int, t0: float, now: float) -> None:
        """The page that started waiting at ``t0`` in class ``cls`` was accessed again at ``now``."""
        self._close(cls, t0, now, hit=True)

    def censor(self, cls: int, t0: float, now: float) -> None:
        """The page that started waiting at ``t0`` is no longer followed (forgotten) at ``now``."""
        self._close(cls, t0, now, hit=False)

    def _close(self, cls: int, t0: float, now: float, hit: bool) -> None:
        self._observed = True
        w = self._weight(t0)
        b = age_bin(now - t0)
        self._open[cls, int(t0) // _BUCKET % _RING] -= w
        self._resolved[cls, 0] += w
        self._resolved[cls, b + 1] -= w
        if hit:
            self._reuses[cls, b] += w

    def record_many(self, kinds: Buffer, classes: Buffer, times: Buffer, now: float) -> None:
        """Observations ``i`` in order: ``kinds[i]`` (:data:`START`, :data:`REUSE` or
        :data:`CENSOR`) of class ``classes[i]`` at ``times[i]`` (the access for a start, the
        last access ``t0`` otherwise), all resolved ones at ``now``. ``kinds`` and
        ``classes`` hold uint8, ``times`` float64 (bytes or arrays).

        The same as the calls one by one, to the bit: every histogram cell gets its
        additions in the same order, and the weights and age bins come from the same
        C library functions. Compiled (``tierkv.policy._ghost.record``) where built;
        otherwise numpy (``np.add.at`` applies additions in index order; ``math`` computes
        each distinct weight and age bin).
        """
        self._observed = self._observed or len(kinds) > 0
        if _record is not None:
            _record(self._open, self._resolved, self._reuses, kinds, classes, times, now, self._t_ref,
                    self._memory, _LOG_GROWTH, _BUCKET, _RING)
            return
        kind = np.frombuffer(kinds, np.uint8)
        if len(kind) == 0:
            return
        cls = np.frombuffer(classes, np.uint8).astype(np.intp)
        t = np.frombuffer(times, np.float64)
        ref, memory = self._t_ref, self._memory
        uniq, inv = np.unique(t, return_inverse=True)
        w = np.array([math.exp((u - ref) / memory) for u in uniq.tolist()])[inv]
        bucket = t.astype(np.int64) // _BUCKET % _RING
        closed = kind != START
        np.add.at(self._open, (cls, bucket), np.where(closed, -w, w))
        if not closed.any():
            return
        c_cls, c_w = cls[closed], w[closed]
        ages, a_inv = np.unique(now - t[closed], return_inverse=True)
        bins = np.array([age_bin(a) for a in ages.tolist()], dtype=np.intp)[a_inv]
        np.add.at(self._resolved, (c_cls, 0), c_w)
        np.add.at(self._resolved, (c_cls, bins + 1), -c_w)
        hit = kind[closed] == REUSE
        np.add.at(self._reuses, (c_cls[hit], bins[hit]), c_w[hit])

    def refresh(self, now: float) -> None:
        """Recompute ``index`` and ``support`` from the observations up to ``now``."""
        self.advance(now)
        scale = 1.0 / self._weight(now)
        at_risk = self._at_risk(now) * scale
        reuses = self._reuses * scale
        k = np.ones(5)
        r_s = np.array([np.convolve(r, k, mode="same") for r in reuses])
        a_s = np.array([np.convolve(a, k, mode="same") for a in at_risk])
        pooled = r_s.sum(0) / np.maximum(a_s.sum(0), 1e-12)
        support = np.cumsum(reuses[:, ::-1], axis=1)[:, ::-1]
        hazards = np.empty((self.classes, BINS))
        for c in range(self.classes):
            # Proportional hazards: where a class has little data it keeps its overall level.
            level = (r_s[c].sum() + 1.0) / ((a_s[c] * pooled).sum() + 1.0)
            hazards[c] = np.clip((r_s[c] + self._prior * level * pooled) / (a_s[c] + self._prior), 0.0, 1.0)
            self.support[c] = list(support[c])
        index = index_table(hazards)
        for c in range(self.classes):
            self.index[c] = list(index[c])
        self._tables = None
        if now - self._t_ref > 64 * self._memory:
            self._rebase(now)

    def tables(self) -> tuple[bytes, bytes]:
        """``index`` and ``support`` as float64 ``[classes][bins]`` bytes, for the compiled
        victims loop; built once per refresh, not per victims call."""
        if self._tables is None:
            self._tables = (np.asarray(self.index, dtype=np.float64).tobytes(),
                            np.asarray(self.support, dtype=np.float64).tobytes())
        return self._tables

    def _at_risk(self, now: float) -> np.ndarray:
        """Weight of pages that reached each age bin: resolved ones plus those still waiting."""
        at_risk = np.cumsum(self._resolved, axis=1)[:, :BINS]
        bins = _ring_bins(now)
        # Only the ring's buckets holding waiting pages add anything (a few hundred of its
        # 32,768): bincount adds them per class and bin in slot order from zero, as
        # np.add.at over every bucket did (a zero added to a sum leaves it as it was), so
        # the sums have the same bits, at a fifth of the time.
        live = np.flatnonzero(self._open.any(axis=0))
        waiting = self._open[:, live]
        cls, j = np.nonzero(waiting)
        width = BINS + 1
        diff = np.bincount(cls * width + bins[live[j]] + 1, weights=-waiting[cls, j],
                           minlength=self.classes * width).reshape(self.classes, width)
        diff[:, 0] += self._open.sum(axis=1)
        return at_risk + np.cumsum(diff, axis=1)[:, :BINS]

    def _rebase(self, now: float) -> None:
        """Move the weight reference to ``now`` so that weights stay finite. Before any
        observation every cell is zero: only the reference moves (the first request after
        a reopen would otherwise scale 2 MB of zeros, most of them never touched before)."""
        if not self._observed:
            self._t_ref = now
            return
        f = math.exp(-(now - self._t_ref) / self._memory)
        self._reuses *= f
        self._resolved *= f
        self._open *= f
        self._t_ref = now


#: Age bins of the ring's buckets counted back from the latest one, by the clock's offset
#: into the latest bucket (whole clock values only: their ages are whole numbers too).
_RING_BINS: dict[float, np.ndarray] = {}


def _ring_bins(now: float) -> np.ndarray:
    """The age bin at ``now`` of each bucket of the ring of waiting pages, by slot."""
    latest = int(now) // _BUCKET
    offset = now - latest * _BUCKET
    whole = offset == int(offset) and abs(now) < 2.0 ** 52
    back = _RING_BINS.get(offset) if whole else None
    if back is None:   # the bucket ``d`` before the latest waits since (latest - d) * B + B / 2
        bucket = latest - np.arange(_RING)
        ages = np.maximum(now - (bucket * _BUCKET + _BUCKET / 2), 0.0)
        back = np.minimum((np.log1p(ages) / _LOG_GROWTH).astype(np.int64), BINS - 1).astype(np.int16)
        if whole:
            _RING_BINS[offset] = back
    # Slot s lies (latest - s) mod RING buckets back: the table reversed, then rotated.
    return np.roll(back[::-1], latest % _RING + 1)


def index_table(hazards: np.ndarray) -> np.ndarray:
    """:func:`_gittins` of each row of ``hazards`` (``[classes][BINS]``): compiled where
    the extension is built (the same operations in the same order: the same bits)."""
    hazards = np.ascontiguousarray(hazards, dtype=np.float64)
    if hazards.ndim != 2 or hazards.shape[1] != BINS:
        raise ValueError(f"index_table: hazards of [classes][{BINS}], got shape {hazards.shape}")
    if _gittins_index is None:
        return np.array([_gittins(h) for h in hazards]).reshape(hazards.shape)
    out = np.empty_like(hazards)
    _gittins_index(hazards, _EDGES, _MIDS, out)
    return out


def _gittins(hazard: np.ndarray) -> np.ndarray:
    """Index per age bin from a per-bin hazard; made non-increasing past its peak."""
    survive = np.concatenate([[1.0], np.cumprod(1.0 - hazard)])
    p = survive[:-1] * hazard                      # P(reuse in bin x), from age 0
    never = survive[-1]
    cp = np.concatenate([[0.0], np.cumsum(p)])     # cp[x] = P(reuse before bin x)
    cq = np.concatenate([[0.0], np.cumsum(p * _MIDS)])
    b = np.arange(BINS)[:, None]                   # current bin
    t = np.arange(BINS)[None, :]                   # horizon: keep until the end of bin t
    start = _EDGES[:-1][:, None]
    hits = cp[t + 1] - cp[b]
    alive = cp[BINS] - cp[b] + never
    cost = (cq[t + 1] - cq[b]) - start * hits + (alive - hits) * (_EDGES[t + 1] - start)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where((t >= b) & (cost > 0), hits / cost, 0.0)
    index = ratio.max(axis=1)
    peak = int(np.argmax(index))
    index[peak:] = np.minimum.accumulate(index[peak:])
    return index
