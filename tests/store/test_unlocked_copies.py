"""Large copies into and out of the DRAM tier run without the store's lock. A copy paused
half-way while other threads evict, drop and reuse slots must still deliver exactly the
bytes of its own pages, publish only what is still its own, and hold up nothing but a
close, which waits for it."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

import tierkv.store.api as api
from tests.conftest import PB, make_config, page_data
from tests.store.test_peering import secret_file
from tierkv.config import PeersConfig
from tierkv.keys import split_keys
from tierkv.store.api import Store
from tierkv.tiers.base import TierKind
from tierkv.tiers.dram import DramTier

TPP = 16


def prompt(seed: int, pages: int) -> np.ndarray:
    return np.random.default_rng(seed + 7000).integers(0, 50000, pages * TPP, dtype=np.int64)


@pytest.fixture(autouse=True)
def every_copy_unlocked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(api, "UNLOCKED_COPY_BYTES", 0)


class Pause:
    """Makes the next DRAM ``method`` on a thread that asks for it stop half-way until released."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, method: str) -> None:
        self.entered, self.release = threading.Event(), threading.Event()
        self.armed = False
        orig = getattr(DramTier, method)

        def paused(tier: DramTier, slots: list[int], buf: np.ndarray) -> None:
            if self.armed and threading.current_thread().name == "paused":
                self.armed = False
                self.entered.set()
                assert self.release.wait(30)
            orig(tier, slots, buf)
        monkeypatch.setattr(DramTier, method, paused)


def in_thread(fn: Callable[[], object]) -> tuple[threading.Thread, list[object]]:
    out: list[object] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:  # noqa: BLE001 - checked by the test
            out.append(exc)
    t = threading.Thread(target=run, name="paused")
    t.start()
    return t, out


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = Store.open(make_config(tmp_path / "s", 4, 0, policy="lru"))
    yield s
    s.close()


def test_a_slot_freed_during_a_copy_is_not_reused_until_it_ends() -> None:
    tier = DramTier(4, PB)
    try:
        slots = tier.allocate(4)
        token = tier.begin_copy(slots[:2])
        tier.free([slots[1], slots[2]])     # one the copy uses, one it does not
        assert tier.num_free == 1 and tier.held_back == 1
        assert tier.allocate(1) == [slots[2]]
        other = tier.begin_copy([slots[1]])  # a second copy of the same slot
        tier.end_copy(token)
        assert tier.held_back == 1 and tier.num_free == 0
        tier.end_copy(other)
        assert tier.held_back == 0 and tier.allocate(1) == [slots[1]]
    finally:
        tier.close()


def test_a_get_paused_mid_copy_returns_its_own_bytes_while_its_slots_are_reused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pause = Pause(monkeypatch, "_read")
    with Store.open(make_config(tmp_path / "s", 8, 0, policy="lru")) as store:
        mine, data = prompt(1, 4), page_data(1, 4)
        store.put(mine, data)
        out = np.zeros((4, PB), np.uint8)
        pause.armed = True
        t, got = in_thread(lambda: store.get(mine, out))
        assert pause.entered.wait(30)
        # While the get is stopped: its pages are evicted (their slots held back), and the
        # pages put after them come and go through the other slots.
        for i in range(2, 5):
            assert store.put(prompt(i, 4), page_data(i, 4)).stored == 4
        assert store.lookup(mine).cached_pages == 0
        st = store.stats().tiers["dram"]
        assert st.used_slots == 8 and store._fast is not None and store._fast.held_back == 4
        pause.release.set()
        t.join(30)
        assert got[0].pages == 4 and got[0].tiers == (TierKind.DRAM,) * 4   # type: ignore[attr-defined]
        assert np.array_equal(out, data)          # its own bytes, not the pages put meanwhile
        assert store._fast.held_back == 0 and store.stats().tiers["dram"].used_slots == 4
        assert store.put(prompt(5, 4), page_data(5, 4)).stored == 4   # the held slots are in use again
        assert store.get(prompt(5, 4), out).pages == 4 and np.array_equal(out, page_data(5, 4))
        store._manager.check()


def test_a_put_paused_mid_copy_publishes_only_pages_still_its_own(store: Store,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    pause = Pause(monkeypatch, "_write")
    head, data = prompt(1, 4), page_data(1, 4)
    store.put(head[:TPP], data[:1])
    pause.armed = True
    t, got = in_thread(lambda: store.put(head, data))   # 3 new pages, the first cached already
    assert pause.entered.wait(30)
    store._manager.forget(store._manager.snapshots()[0].key)   # the cached first page fails, say
    pause.release.set()
    t.join(30)
    assert got[0].stored == 0                        # type: ignore[attr-defined]
    assert store.lookup(head).cached_pages == 0      # nothing published without its prefix
    store._manager.check()
    assert store.stats().tiers["dram"].used_slots == 0
    assert store.put(head, data).stored == 4         # and their slots are free again
    out = np.zeros((4, PB), np.uint8)
    assert store.get(head, out).pages == 4 and np.array_equal(out, data)


def _counting_checks(store: Store, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Each still_placed and drop_orphans call the manager makes from now on, by name."""
    calls: list[str] = []
    m = store._manager
    for name in ("still_placed", "drop_orphans"):
        real = getattr(m, name)

        def counted(*args: object, _real: Callable[..., object] = real, _name: str = name) -> object:
            calls.append(_name)
            return _real(*args)
        monkeypatch.setattr(m, name, counted)
    return calls


def test_a_put_rechecks_its_pages_only_where_a_copy_was_removed_meanwhile(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where nothing removed a copy between the plan and the publish, no slot can have
    changed hands and no parent left: the put publishes without the checks. An eviction
    by another thread meanwhile brings them back, and the put still stores its pages."""
    calls = _counting_checks(store, monkeypatch)
    first, data = prompt(1, 2), page_data(1, 2)
    assert store.put(first, data).stored == 2
    assert calls == []
    pause = Pause(monkeypatch, "_write")
    pause.armed = True
    second, more = prompt(2, 2), page_data(2, 2)
    t, got = in_thread(lambda: store.put(second, more))
    assert pause.entered.wait(30)
    store.put(prompt(3, 2), page_data(3, 2))    # the DRAM tier holds 4: this evicts the first prompt
    calls.clear()                                 # (its own publish checks for orphans: it dropped pages)
    pause.release.set()
    t.join(30)
    assert got[0].stored == 2                     # type: ignore[attr-defined]
    assert calls == ["still_placed", "drop_orphans"]
    out = np.zeros((2, PB), np.uint8)
    assert store.get(second, out).pages == 2 and np.array_equal(out, more)
    store._manager.check()


def test_close_waits_for_a_copy_in_flight(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    pause = Pause(monkeypatch, "_read")
    mine, data = prompt(1, 3), page_data(1, 3)
    store.put(mine, data)
    out = np.zeros((3, PB), np.uint8)
    pause.armed = True
    t, got = in_thread(lambda: store.get(mine, out))
    assert pause.entered.wait(30)
    closer = threading.Thread(target=store.close)
    closer.start()
    closer.join(0.3)
    assert closer.is_alive()                  # waiting for the copy, not releasing the tier under it
    pause.release.set()
    t.join(30)
    closer.join(30)
    assert not closer.is_alive()
    assert got[0].pages == 3 and np.array_equal(out, data)   # type: ignore[attr-defined]


def test_two_threads_copy_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    inside, most = [0], [0]
    both = threading.Barrier(2, timeout=10)
    orig = DramTier._read
    guard = threading.Lock()

    def counted(tier: DramTier, slots: list[int], buf: np.ndarray) -> None:
        with guard:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        try:
            both.wait()        # both threads are inside a copy at the same moment, or this times out
        except threading.BrokenBarrierError:
            pass
        orig(tier, slots, buf)
        with guard:
            inside[0] -= 1
    with Store.open(make_config(tmp_path / "s", 8, 0)) as s:
        a, b = (prompt(1, 4), page_data(1, 4)), (prompt(2, 4), page_data(2, 4))
        s.put(*a)
        s.put(*b)
        monkeypatch.setattr(DramTier, "_read", counted)
        outs = [np.zeros((4, PB), np.uint8) for _ in range(2)]
        threads = [threading.Thread(target=s.get, args=(t, o)) for (t, _), o in zip((a, b), outs)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(30)
        assert most[0] == 2
        assert np.array_equal(outs[0], a[1]) and np.array_equal(outs[1], b[1])


def test_pages_a_get_fetches_from_a_peer_are_not_kept_without_their_prefix(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A get copies its leading DRAM pages without the lock and fetches the rest from a
    peer; if a leading page left meanwhile, the fetched pages must not stay here without
    their parent, where no lookup could reach them and they would only take room."""
    tokens, data = prompt(20, 4), page_data(20, 4)
    serving = PeersConfig(serve="127.0.0.1:0", transport="tcp", secret_file=secret_file(tmp_path))
    with Store.open(make_config(tmp_path / "prefill", 8, 0, peers=serving)) as prefill:
        prefill.put(tokens, data)
        host, port = prefill.peer_address or ("", 0)
        fetching = PeersConfig(fetch=(f"{host}:{port}",), transport="tcp", timeout_s=5.0,
                               secret_file=secret_file(tmp_path))
        with Store.open(make_config(tmp_path / "decode", 8, 0, policy="lru", peers=fetching)) as decode:
            decode.put(tokens[:2 * TPP], data[:2])
            keys = split_keys(decode._keys(tokens, ""))
            pause = Pause(monkeypatch, "_read")
            out = np.zeros((4, PB), np.uint8)
            pause.armed = True
            t, got = in_thread(lambda: decode.get(tokens, out))
            assert pause.entered.wait(30)
            with decode._lock:                 # page 1 leaves (it failed its checksum elsewhere, say)
                decode._manager.forget(keys[1])
            pause.release.set()
            t.join(30)
            assert got[0].pages == 4 and np.array_equal(out, data)   # type: ignore[attr-defined]
            assert decode._manager.held(b"".join(keys)) == [True, False, False, False]
            decode._manager.check()


def test_a_get_the_unlocked_copy_serves_whole_or_in_part_counts_what_it_served(tmp_path: Path) -> None:
    """A get all of whose pages lie in DRAM ends with the unlocked copy; one whose leading
    DRAM pages are followed by NVMe ones reads the rest under the lock. Either way the
    result names each page's tier and the stats count the pages asked for and served."""
    with Store.open(make_config(tmp_path / "s", 4, 16, policy="lru")) as s:
        part = prompt(2, 6)
        s.put(part, page_data(2, 6))               # pages 0-3 in DRAM, 4 and 5 in NVMe
        want = page_data(2, 6)
        out = np.zeros((6, PB), dtype=np.uint8)
        before = s.stats()
        got = s.get(part[:2 * TPP], out[:2], requested=3)     # all in DRAM
        assert got.pages == 2 and got.tiers == (TierKind.DRAM,) * 2 and np.array_equal(out[:2], want[:2])
        mid = s.stats()
        assert (mid.pages_requested - before.pages_requested, mid.pages_hit - before.pages_hit) == (3, 2)
        got = s.get(part[:5 * TPP], out[:5])       # four DRAM pages, then one from NVMe
        assert got.pages == 5 and got.tiers == (TierKind.DRAM,) * 4 + (TierKind.NVME,)
        assert np.array_equal(out[:5], want[:5])
        got = s.get(part, out)
        assert got.pages == 6 and np.array_equal(out, want) and got.tiers[0] == TierKind.DRAM
        after = s.stats()
        assert (after.pages_requested - mid.pages_requested, after.pages_hit - mid.pages_hit) == (11, 11)
