"""A failing index transaction (a full disk, an I/O error in LMDB) and a failing close.

An index commit that fails must cost the pages it was committing (misses), never serve
wrong bytes, never leak their slots, and never lose the deletes it carried. A close whose
write-back fails must still release the tiers, the index and the writer lock. The LMDB
failure is injected into ``PersistentIndex.commit`` exactly as it surfaces there
(``TierIOError``); everything else is the real store on an O_DIRECT file.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
import threading
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import PB, make_config
from tierkv.store.api import Store
from tierkv.errors import StoreClosedError, TierIOError
from tierkv.store.index import IndexRecord, PersistentIndex
from tierkv.keys import PageKey, split_keys
from tierkv.tiers.base import TierKind
from tierkv.store.transfer import Transfers


def toks(i: int, pages: int = 1) -> np.ndarray:
    return np.arange(16 * pages, dtype=np.int64) + 1000 * (i + 1)


def data(i: int, pages: int = 1) -> np.ndarray:
    return np.full((pages, PB), i + 1, np.uint8)  # prompt i's pages are all byte i+1


class FailingCommits:
    """Makes the next ``n`` index commits that match ``when`` raise as LMDB errors do."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.n = 0
        self.when: Callable[[list[IndexRecord], list[PageKey]], bool] = lambda put, delete: True
        real = PersistentIndex.commit

        def commit(index: PersistentIndex, tier: str, put: Sequence[IndexRecord] = (),
                   delete: Sequence[PageKey] = ()) -> None:
            put, delete = list(put), list(delete)
            if self.n and self.when(put, delete):
                self.n -= 1
                raise TierIOError(f"store index commit for the {tier} tier failed: MDB_MAP_FULL (injected)")
            real(index, tier, put, delete)

        monkeypatch.setattr(PersistentIndex, "commit", commit)


@pytest.fixture
def failing(monkeypatch: pytest.MonkeyPatch) -> FailingCommits:
    return FailingCommits(monkeypatch)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = Store.open(make_config(tmp_path / "s", dram_pages=2, nvme_pages=16, policy="lru"))
    yield s
    s.close()


def consistent(store: Store) -> None:
    """Every used slot belongs to exactly one entry, and every entry is known to its tiers' policies."""
    m = store._manager
    for tier in m.tiers:
        owners = [e.slots[tier.name] for e in m.snapshots() if tier.name in e.slots]
        assert len(owners) == len(set(owners)) == m.used_slots(tier.name), tier.name
        assert len(m._policies[tier.name]) == len(owners), tier.name


def read(store: Store, i: int, pages: int = 1) -> tuple[int, np.ndarray]:
    out = np.zeros((pages, PB), np.uint8)
    return store.get(toks(i, pages), out).pages, out


def test_failed_commit_during_promotion_never_serves_the_victims_bytes(store: Store,
                                                                       failing: FailingCommits) -> None:
    for i in range(6):
        store.put(toks(i), data(i))
    cold = next(i for i in range(6) if store.lookup(toks(i)).tiers == (TierKind.NVME,))
    failing.n, failing.when = 1, lambda put, delete: bool(put)   # the DRAM victim's demotion
    got, out = read(store, cold)           # promotes the cold page over a DRAM victim
    assert got == 1 and (out[0] == cold + 1).all()
    consistent(store)
    for _ in range(2):                     # now from DRAM: the promoted bytes, not the victim's
        got, out = read(store, cold)
        assert got == 1 and (out[0] == cold + 1).all()
    for i in range(6):                     # every page is its own bytes or a miss
        got, out = read(store, i)
        assert got == 0 or (out[0] == i + 1).all()
    consistent(store)


def test_failed_commit_during_put_drops_the_pages_and_leaks_nothing(tmp_path: Path,
                                                                    failing: FailingCommits) -> None:
    cfg = make_config(tmp_path / "s", dram_pages=0, nvme_pages=8)
    with Store.open(cfg) as store:
        failing.n = 1
        r = store.put(toks(0, 2), data(0, 2))
        assert (r.stored, r.dropped) == (0, 2)
        assert store.lookup(toks(0, 2)).cached_pages == 0
        consistent(store)
        r = store.put(toks(0, 2), data(0, 2))            # the fault has cleared: stored now
        assert (r.stored, r.already_present) == (2, 0)
        for i in range(1, 12):                          # churn: every slot is reusable
            store.put(toks(i, 2), data(i, 2))
        consistent(store)
    with Store.open(cfg) as store:
        for i in range(12):
            got, out = read(store, i, 2)
            assert (out[:got] == i + 1).all()


def test_a_failed_delete_is_carried_by_the_next_commit(tmp_path: Path, failing: FailingCommits) -> None:
    cfg = make_config(tmp_path / "s", dram_pages=0, nvme_pages=2, policy="lru")
    with Store.open(cfg) as store:
        store.put(toks(0, 2), data(0, 2))
        evicted = split_keys(store._keys(toks(0, 2), ""))
        # Evicting prompt 0 for prompt 1: the transaction that deletes its records fails.
        failing.n, failing.when = 1, lambda put, delete: bool(delete)
        store.put(toks(1, 2), data(1, 2))
        assert store.lookup(toks(1, 2)).cached_pages == 0   # that transaction carried its records too
        assert store.put(toks(1, 2), data(1, 2)).stored == 2
        index = store._index
        assert index is not None
        assert index.get_many("nvme", evicted) == [None, None]
        consistent(store)
    with Store.open(cfg) as store:
        assert read(store, 0, 2)[0] == 0
        got, out = read(store, 1, 2)
        assert got == 2 and (out == 2).all()


def test_close_releases_everything_when_the_write_back_fails(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = make_config(tmp_path / "s", dram_pages=4, nvme_pages=8)
    store = Store.open(cfg)
    store.put(toks(0, 2), data(0, 2))
    store.put(toks(1, 4), data(1, 4))      # fills DRAM: prompt 0 is demoted to NVMe and committed
    real_run = Transfers.run

    def run(self: Transfers, plan: object, *args: object, **kw: object) -> int:
        raise OSError("injected: the write-back could not run")

    monkeypatch.setattr(Transfers, "run", run)
    with pytest.raises(OSError, match="injected"):
        store.close()
    store.close()                          # a second close is a no-op
    monkeypatch.setattr(Transfers, "run", real_run)
    with Store.open(cfg) as again:         # the lock was released; committed pages survive
        got, out = read(again, 0, 2)
        assert got == 2 and (out == 1).all()


def test_close_from_a_prefetch_callback(tmp_path: Path) -> None:
    cfg = make_config(tmp_path / "s")
    store = Store.open(cfg)
    store.put(toks(0, 2), data(0, 2))
    closed: list[BaseException | None] = []
    done = threading.Event()

    def close(_: Future[int]) -> None:
        try:
            store.close()
            closed.append(None)
        except BaseException as exc:  # noqa: BLE001 - recorded for the assertion below
            closed.append(exc)
        done.set()

    with store._lock:                      # the job waits for the lock: the callback runs on the worker
        store.prefetch(toks(0, 2)).add_done_callback(close)
    assert done.wait(30)
    assert closed == [None]
    store.close()
    with Store.open(cfg) as again:
        assert again.lookup(toks(0, 2)).cached_pages == 2


def test_prefetch_racing_close_says_closed(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    submit = store._prefetcher.submit

    def close_first(*args: object, **kw: object) -> object:
        store.close()                      # a close between prefetch's check and its submit
        return submit(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(store._prefetcher, "submit", close_first)
    with pytest.raises(StoreClosedError):
        store.prefetch(toks(0))


def test_a_close_whose_write_back_fails_says_how_many_pages_it_lost(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 28 item 3: with the disk full, close() returned normally after failing to persist."""
    cfg = make_config(tmp_path / "s", dram_pages=4, nvme_pages=8)
    store = Store.open(cfg)
    store.put(toks(0, 2), data(0, 2))
    store.put(toks(1, 4), data(1, 4))      # fills DRAM: prompt 0 is demoted to NVMe and committed
    nvme = next(t for t in store._manager.tiers if t.persistent)

    def full(*args: object, **kw: object) -> object:
        raise TierIOError(f"nvme tier {nvme.name}: write failed: [Errno 28] No space left on device")

    monkeypatch.setattr(nvme, "write", full)
    with pytest.raises(TierIOError, match=r"close: 4 of the 4 pages held only in volatile tiers could not be written "
                                          r"back to nvme .* they are lost, every page written before is durable"):
        store.close()
    monkeypatch.undo()
    with Store.open(cfg) as again:         # released; what was durable before the close is there
        got, out = read(again, 0, 2)
        assert got == 2 and (out == 1).all()
        assert again.lookup(toks(1, 4)).cached_pages == 0
        again.put(toks(2, 2), data(2, 2))  # and the store works
        assert read(again, 2, 2)[0] == 2
    with Store.open(cfg) as clean:         # a close that wrote everything back raises nothing
        assert clean.lookup(toks(2, 2)).cached_pages == 2
