"""The index of slot tiers as runs (tierkv.store.index_runs): replay, readers, compaction,
damage, and stores of the per-key format carried into runs, on real LMDB and O_DIRECT files."""

from __future__ import annotations

import logging
import os
import random
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import lmdb
import numpy as np
import pytest

from tests.conftest import make_config, page_data
from tierkv.config import StoreConfig
from tierkv.errors import TierIOError, TierUnavailableError
from tierkv.keys import KEY_BYTES, PageKey
from tierkv.store import manager as manager_mod
from tierkv.store.api import Store
from tierkv.store.index import RECORD_BYTES, IndexRecord, PersistentIndex, pack_run, run_events, run_key
from tierkv.store.index_runs import RunsView, live_records, replay, unpack_run
from tierkv.store.index_scan import RecordArrays, packed_blob
from tierkv.store.table import rows_of
from tierkv.tiers.base import TierId

TPP = 16
ROOT = Path(__file__).resolve().parents[2]
ARCHIVE = Path(__file__).parent / "data" / "stores-before-tier-names.tar.gz"


def prompt(seed: int, pages: int) -> np.ndarray:
    return np.random.default_rng(seed + 7000).integers(0, 50000, pages * TPP, dtype=np.int64)


def _key(i: int) -> bytes:
    return i.to_bytes(2, "little") * 8


def _records(keys: list[int], slots: list[int], sums: list[int]) -> tuple[bytes, bytes]:
    n = len(keys)
    arrays = RecordArrays(b"".join(_key(k) for k in keys), np.array(slots, dtype=np.uint64),
                          np.full(n, 100, dtype=np.uint32), np.array(sums, dtype=np.uint64),
                          bytes(KEY_BYTES * n), np.zeros(n, dtype=bool))
    return arrays.keys, packed_blob(arrays)


def _naive(events: list[list[tuple[str, int, int, int]]]) -> dict[bytes, tuple[int, int]]:
    """The pages a sequence of runs leaves, one event at a time: (op, key, slot, checksum)."""
    pages: dict[int, tuple[int, int]] = {}
    for run in events:
        for op, k, _, _ in run:
            if op == "del":
                pages.pop(k, None)
        for op, k, slot, checksum in run:
            if op == "put":
                for other, (s, _) in list(pages.items()):
                    if s == slot and other != k:
                        del pages[other]
                pages[k] = (slot, checksum)
    return {_key(k): v for k, v in pages.items()}


@pytest.mark.parametrize("seed", range(40))
def test_replay_and_a_readers_view_agree_with_applying_each_event_in_turn(seed: int) -> None:
    rng = random.Random(seed)
    events: list[list[tuple[str, int, int, int]]] = []
    runs = []
    raw: list[tuple[bytes, bytes]] = []
    for rid in range(rng.randint(1, 12)):
        dels = rng.sample(range(12), rng.randint(0, 3))
        puts = rng.sample(range(12), rng.randint(0, 5))            # distinct keys in a run
        slots = rng.sample(range(8), len(puts))                     # and distinct slots
        sums = [rng.randrange(1 << 60) for _ in puts]
        events.append([("del", k, 0, 0) for k in dels] + [("put", k, s, c) for k, s, c in zip(puts, slots, sums)])
        keys, values = _records(puts, slots, sums)
        key = run_key(rid)
        raw.append((key, pack_run(rid, [_key(k) for k in dels], [keys], [values])))
        run = unpack_run(*raw[-1])
        assert run is not None
        runs.append(run)
    want = _naive(events)
    live = replay(runs)
    got = {live.keys[i * KEY_BYTES:(i + 1) * KEY_BYTES]: (int(live.slot[i]), int(live.checksum[i]))
           for i in range(len(live))}
    assert got == want
    # A reader's view: the first runs replayed at once into its base, the rest one by one.
    for split in sorted({0, len(raw) // 2, len(raw)}):
        view = RunsView()
        view.rebuild(raw[:split], raw[0][0], raw[split - 1][0] if split else b"")
        for key, value in raw[split:]:
            view.add(unpack_run(key, value), key)
        seen = {k: (v[0], v[2]) for k in map(_key, range(12)) if (v := view.get(k)) is not None}
        assert seen == want and len(view) == len(want), split


def test_a_run_whose_bytes_change_fails_its_seal() -> None:
    keys, values = _records([1, 2], [0, 1], [5, 6])
    value = bytearray(pack_run(3, [_key(9)], [keys], [values]))
    assert unpack_run(run_key(3), bytes(value)) is not None
    assert unpack_run(run_key(4), bytes(value)) is None              # the seal covers the run's id
    for at in (0, 5, 14, len(value) - 20, len(value) - 1):
        broken = bytearray(value)
        broken[at] ^= 1
        assert unpack_run(run_key(3), bytes(broken)) is None
    assert unpack_run(run_key(3), bytes(value[:-1])) is None
    with pytest.raises(ValueError, match="16-byte keys"):
        pack_run(0, [], [keys], [values[:-1]])


def _fill(s: Store, seeds: range, pages: int = 3) -> dict[int, np.ndarray]:
    data = {}
    for seed in seeds:
        data[seed] = page_data(seed, pages)
        s.put(prompt(seed, pages), data[seed])
    return data


def _served(s: Store, data: dict[int, np.ndarray]) -> dict[int, int]:
    """Pages each prompt gets (its bytes checked)."""
    out = {}
    for seed, want in data.items():
        got = np.zeros_like(want)
        n = s.get(prompt(seed, len(want)), got).pages
        np.testing.assert_array_equal(got[:n], want[:n])
        out[seed] = n
    return out


def _compact_often(monkeypatch: pytest.MonkeyPatch, least: int, chunk: int) -> None:
    """Compaction at a few entries, a few at a time (a store's 65,536 and 262,144 in small)."""
    monkeypatch.setattr(manager_mod, "COMPACT_MIN", least)
    monkeypatch.setattr(manager_mod, "COMPACT_CHUNK", chunk)


def _index(cfg: StoreConfig) -> PersistentIndex:
    return PersistentIndex(Path(cfg.path), ["nvme"], read_only=True, runs=["nvme"])


def _table(s: Store, name: str = "nvme") -> dict[bytes, tuple[int, int]]:
    """The pages the writer's table holds on tier ``name``: key -> (slot, checksum)."""
    m = s._manager
    t, lvl = m.table, m.levels[TierId(name)]
    live = rows_of(t.core.live_rows())
    rows = live[(t.where[live] >> lvl) & 1 == 1]
    keys = t.core.keys(rows.tobytes())
    return {keys[i * KEY_BYTES:(i + 1) * KEY_BYTES]: (int(t.slot[lvl, r]) - 1, int(t.checksum[r]))
            for i, r in enumerate(rows.tolist())}


def _recorded(index: PersistentIndex, name: str = "nvme") -> dict[bytes, tuple[int, int]]:
    got = live_records(index, name)
    return {got.keys[i * KEY_BYTES:(i + 1) * KEY_BYTES]: (int(got.slot[i]), int(got.checksum[i]))
            for i in range(len(got))}


@pytest.mark.parametrize(("durability", "dram"), [("window", 2), ("put", 2), ("window", 0)])
def test_compaction_keeps_the_index_bounded_and_exactly_what_the_table_holds(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, durability: str, dram: int) -> None:
    _compact_often(monkeypatch, 8, 12)
    cfg = make_config(tmp_path / "s", dram_pages=dram, nvme_pages=16, durability=durability)
    data: dict[int, np.ndarray] = {}
    with Store.open(cfg) as s:
        reader = PersistentIndex(Path(cfg.path), ["nvme"], read_only=True, runs=["nvme"])  # shares the env
        try:
            for step in range(6):                      # 180 pages through 16 slots: evictions
                data.update(_fill(s, range(10 * step, 10 * step + 10)))
                s.flush()
                assert _recorded(reader) == _table(s)
                index = s._index
                # Compaction keeps up: twice the pages, COMPACT_MIN, a chunk and one window's
                # entries (60: the window is applied by the flush, compaction asked at the next commit).
                assert index is not None and index.events("nvme") <= 2 * 16 + 8 + 12 + 60
        finally:
            reader.close()
        assert s._manager.compactions > 0
        before = _served(s, data)
    with Store.open(cfg) as s:
        after = _served(s, data)
        held = _table(s)
        # Every page the NVMe tier holds is reachable (the DRAM tier's were written back at close).
        assert sum(after.values()) == len(held) > 0
        if not dram:
            assert after == before
    index = _index(cfg)
    try:
        assert _recorded(index) == held
    finally:
        index.close()


def test_a_reader_sees_the_writers_commits_across_compactions(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _compact_often(monkeypatch, 4, 6)
    cfg = make_config(tmp_path / "s", dram_pages=0, nvme_pages=8, durability="put")
    with Store.open(cfg) as w:
        _fill(w, range(2), pages=2)
        with Store.open(cfg, read_only=True) as r:
            for seed in range(2, 30):
                data = page_data(seed, 2)
                w.put(prompt(seed, 2), data)
                got = np.zeros_like(data)
                assert r.get(prompt(seed, 2), got).pages == 2      # the newest pages are there
                np.testing.assert_array_equal(got, data)
                for back in range(max(0, seed - 6), seed):           # what was evicted: gone for both
                    old = page_data(back, 2)
                    seen = r.get(prompt(back, 2), got).pages
                    np.testing.assert_array_equal(got[:seen], old[:seen])
                    assert seen == w.lookup(prompt(back, 2), count=False).cached_pages
        assert w._manager.compactions > 0


def _runs(path: Path) -> list[tuple[bytes, bytes]]:
    env = lmdb.open(str(path / "index.lmdb"), max_dbs=16, subdir=True, lock=False, readonly=True)
    try:
        with env.begin(db=env.open_db(b"nvme:runs", create=False)) as txn:
            return [(bytes(k), bytes(v)) for k, v in txn.cursor()]
    finally:
        env.close()


def test_a_damaged_run_drops_the_runs_up_to_it_and_nothing_is_served_wrong(tmp_path: Path) -> None:
    cfg = make_config(tmp_path / "s", dram_pages=0, nvme_pages=32, durability="put", verify_index="never")
    with Store.open(cfg) as s:
        data = _fill(s, range(6), pages=2)              # one run per put
    runs = _runs(tmp_path / "s")
    assert len(runs) == 6
    env = lmdb.open(str(tmp_path / "s" / "index.lmdb"), max_dbs=16, subdir=True)
    try:
        with env.begin(write=True, db=env.open_db(b"nvme:runs", create=False)) as txn:
            key, value = runs[2]
            broken = bytearray(value)
            broken[20] ^= 0xFF                            # inside the first record's key
            txn.put(key, bytes(broken))
    finally:
        env.close()
    with Store.open(cfg) as s:
        assert _served(s, data) == {0: 0, 1: 0, 2: 0, 3: 2, 4: 2, 5: 2}
    assert len(_runs(tmp_path / "s")) == 1             # the survivors, rewritten as one run
    with Store.open(cfg) as s:
        assert _served(s, data) == {0: 0, 1: 0, 2: 0, 3: 2, 4: 2, 5: 2}


def test_a_format_3_store_is_carried_into_runs_and_reopens_again(tmp_path: Path) -> None:
    with tarfile.open(ARCHIVE) as tar:
        tar.extractall(tmp_path, filter="data")
    from tests.store.test_reopen_compat import PLAIN_PAGES, configs, smooth_pages, tokens
    plain, _ = configs(tmp_path)
    want = smooth_pages(PLAIN_PAGES, 1)
    for _ in range(3):                                 # carried at the first open; the next ones read runs
        with Store.open(plain) as s:
            got = np.zeros_like(want)
            assert s.get(tokens(PLAIN_PAGES), got).pages == PLAIN_PAGES
            np.testing.assert_array_equal(got, want)
    runs = _runs(tmp_path / "plain")
    assert runs and all(len(v) > RECORD_BYTES for _, v in runs)


# -- what a review found (each failed before its fix) -------------------------------------

class _FailAtCommit:
    """A write transaction that fails when it commits (a full disk, say)."""

    def __init__(self, txn: lmdb.Transaction) -> None:
        self.txn = txn

    def __enter__(self) -> lmdb.Transaction:
        return self.txn.__enter__()

    def __exit__(self, et: Any, ev: Any, tb: Any) -> None:
        if et is None:
            self.txn.abort()
            raise lmdb.DiskError("No space left on device (injected at commit)")
        self.txn.__exit__(et, ev, tb)


class _Env:
    """The index's LMDB environment with failures injected: write transactions failing at
    commit, or read transactions of one database raising LMDB's damage error."""

    def __init__(self, env: lmdb.Environment) -> None:
        self.env, self.fail_writes = env, False
        self.damaged_db: object = None

    def begin(self, *args: Any, **kw: Any) -> Any:
        if self.damaged_db is not None and not kw.get("write") and kw.get("db") is self.damaged_db:
            raise lmdb.CorruptedError("MDB_CORRUPTED: Located page was wrong type (injected)")
        txn = self.env.begin(*args, **kw)
        return _FailAtCommit(txn) if kw.get("write") and self.fail_writes else txn

    def __getattr__(self, name: str) -> object:
        return getattr(self.env, name)


def _true_events(index: PersistentIndex) -> int:
    return sum(run_events(v) for _, v in index.read_runs("nvme", limit=10 ** 9))


@pytest.mark.parametrize("durability", ["put", "window"])
def test_failed_commits_are_not_counted_and_compaction_does_not_rewrite_in_circles(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, durability: str) -> None:
    _compact_often(monkeypatch, 8, 12)
    cfg = make_config(tmp_path / "s", dram_pages=0, nvme_pages=16, durability=durability)
    with Store.open(cfg) as s:
        index = s._index
        assert index is not None
        _fill(s, range(20), pages=2)
        s.flush()
        env = _Env(index._env)
        monkeypatch.setattr(index, "_env", env)
        env.fail_writes = True
        for seed in range(100, 130):                   # every commit fails: misses, retried deletes
            s.put(prompt(seed, 2), page_data(seed, 2))
        if durability == "window":                     # the windows' failure, raised once
            with pytest.raises(TierIOError):
                s.flush()
        env.fail_writes = False
        assert index.events("nvme") == _true_events(index)
        chunks = []
        real = s._manager._compact_chunk

        def counted(tier: Any) -> Any:
            chunks.append(1)
            return real(tier)

        monkeypatch.setattr(s._manager, "_compact_chunk", counted)
        _fill(s, range(200, 210), pages=2)
        s.flush()
        assert index.events("nvme") == _true_events(index)
        assert len(chunks) <= 10                       # was 172 chunks, rewriting the index again and again


def test_a_readers_view_survives_compactions_that_leave_no_run_and_clears(tmp_path: Path) -> None:
    for how in ("emptied", "clear"):
        (tmp_path / how).mkdir()
        w = PersistentIndex(tmp_path / how, ["nvme"], runs=["nvme"])
        r = PersistentIndex(tmp_path / how, ["nvme"], read_only=True, runs=["nvme"])   # shares the env
        try:
            def rec(i: int, slot: int) -> IndexRecord:
                return IndexRecord(PageKey(_key(i)), slot, 100, 1000 + i, None)
            for i in range(5):
                w.commit("nvme", put=[rec(i, i)])
            assert r.get_many("nvme", [rec(4, 4).key])[0] is not None
            if how == "clear":
                w.clear("nvme")
            else:                                      # a compaction that finds nothing live
                raw = w.read_runs("nvme", limit=10 ** 6)
                w.rewrite_runs("nvme", raw[-1][0], b"", b"", events=sum(run_events(v) for _, v in raw))
            assert w.has_runs("nvme")                  # an empty run keeps the next id: ids never reused
            for i in range(10, 13):
                w.commit("nvme", put=[rec(i, i - 10)])
            got = r.get_many("nvme", [rec(i, 0).key for i in (10, 11, 12, 0)])
            assert [g is not None for g in got] == [True, True, True, False]
        finally:
            r.close()
            w.close()


def test_a_damaged_index_met_by_compaction_leaves_the_put_done_and_compaction_off(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    _compact_often(monkeypatch, 8, 12)
    cfg = make_config(tmp_path / "s", dram_pages=0, nvme_pages=16, durability="put")
    with Store.open(cfg) as s:
        index = s._index
        assert index is not None
        data = _fill(s, range(10), pages=2)
        env = _Env(index._env)
        monkeypatch.setattr(index, "_env", env)
        env.damaged_db = index._runs["nvme"]
        with caplog.at_level(logging.ERROR):
            data.update(_fill(s, range(100, 140), pages=2))   # raised IndexDamaged out of put before
        assert "compaction is off" in caplog.text and s._manager._no_compaction == {"nvme"}
        env.damaged_db = None
        held = _table(s)
        served = _served(s, data)
    assert sum(served.values()) == len(held)
    with Store.open(cfg) as s:                         # the index replays to what the table held
        assert _table(s) == held


def test_compaction_waits_for_a_degraded_tier_without_a_sync_per_commit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _compact_often(monkeypatch, 8, 12)
    cfg = make_config(tmp_path / "s", dram_pages=0, nvme_pages=16, durability="window",
                      commit_window_s=30.0, commit_window_pages=100000)
    with Store.open(cfg) as s:
        _fill(s, range(40), pages=2)
        s.flush()
        index = s._index
        assert index is not None and index.group is not None
        nvme = next(t for t in s._manager.tiers if t.name == "nvme")
        refused = []

        def degraded() -> None:
            refused.append(1)
            raise TierUnavailableError("the fabric is down (injected)")

        monkeypatch.setattr(nvme, "flush", degraded)
        _fill(s, range(100, 140), pages=2)
        # One drain per COMPACT_CHUNK / 4 entries appended at most (was one per put: 40).
        assert len(refused) <= 40 * 4 // (12 // 4) // 4 + 1
        monkeypatch.undo()


def test_a_reader_of_a_format_3_store_follows_the_writer_that_carries_it_into_runs(tmp_path: Path) -> None:
    with tarfile.open(ARCHIVE) as tar:
        tar.extractall(tmp_path, filter="data")
    from tests.store.test_reopen_compat import PLAIN_PAGES, configs, smooth_pages, tokens
    plain, _ = configs(tmp_path)
    want = smooth_pages(PLAIN_PAGES, 1)
    got = np.zeros_like(want)
    with Store.open(plain, read_only=True) as r:
        seen = r.get(tokens(PLAIN_PAGES), got).pages
        assert seen > 0
        # The writer in another process (one process holds one LMDB environment per file).
        code = ("import sys; from pathlib import Path; from tests.store.test_reopen_compat import configs; "
                "from tierkv.store.api import Store; Store.open(configs(Path(sys.argv[1]))[0]).close()")
        subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, check=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
        assert r._index is not None and r._index.entries("nvme") == 0   # carried into runs
        got[:] = 0
        assert r.get(tokens(PLAIN_PAGES), got).pages == seen
        np.testing.assert_array_equal(got[:seen], want[:seen])


def test_a_carry_into_runs_that_fails_fails_the_open_and_loses_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Readers and compaction take the runs for the whole index once there are any, so an
    open may not go on with per-key records left beside them."""
    with tarfile.open(ARCHIVE) as tar:
        tar.extractall(tmp_path, filter="data")
    from tests.store.test_reopen_compat import PLAIN_PAGES, configs, smooth_pages, tokens
    plain, _ = configs(tmp_path)

    def full(*args: Any, **kw: Any) -> None:
        raise TierIOError("rewriting the nvme runs failed: No space left on device (injected)")

    with monkeypatch.context() as m:
        m.setattr(PersistentIndex, "rewrite_runs", full)
        with pytest.raises(TierIOError, match="No space left"):
            Store.open(plain)
    want = smooth_pages(PLAIN_PAGES, 1)
    with Store.open(plain) as s:
        got = np.zeros_like(want)
        assert s.get(tokens(PLAIN_PAGES), got).pages == PLAIN_PAGES
        np.testing.assert_array_equal(got, want)


def test_a_recount_that_fails_puts_compaction_off_without_turning_it_off(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _compact_often(monkeypatch, 8, 12)
    cfg = make_config(tmp_path / "s", dram_pages=0, nvme_pages=16, durability="put")
    with Store.open(cfg) as s:
        index = s._index
        assert index is not None
        real = index.count_events
        failing = [True]

        def readers_full(tier: str) -> int:
            if failing[0]:
                raise TierIOError("counting the nvme runs failed: MDB_READERS_FULL (injected)")
            return real(tier)

        monkeypatch.setattr(index, "count_events", readers_full)
        monkeypatch.setattr(index, "_events", {"nvme": 10 ** 6})   # over, and past one pass: a recount
        _fill(s, range(10), pages=2)
        assert not s._manager._no_compaction
        failing[0] = False
        _fill(s, range(10, 60), pages=2)
        s.flush()
        assert index.events("nvme") == _true_events(index) <= 2 * 16 + 8 + 12 + 6
