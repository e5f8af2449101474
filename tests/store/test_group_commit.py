"""Group commit (``[store] durability = "window"``): one data sync and one index commit per
window; ``flush()`` is the barrier; failures surface from ``flush``/``close`` and never let a
record name bytes that were not synced. Real O_DIRECT files and a real LMDB index."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import PB, make_config, page_data
from tests.polling import wait_for
from tierkv.config import StoreConfig, config_from_dict
from tierkv.errors import ConfigError, TierIOError, TierUnavailableError
from tierkv.store.api import Store
from tierkv.store.commits import GroupCommit
from tierkv.tiers.base import Tier

ROOT = Path(__file__).resolve().parents[2]
LONG = 60.0  # a window that never closes by itself within a test


def prompt(seed: int, pages: int) -> np.ndarray:
    return np.random.default_rng(seed + 500).integers(0, 50000, pages * 16, dtype=np.int64)


def window(path: Path, nvme_pages: int = 32, dram_pages: int = 0, **kw: object) -> StoreConfig:
    kw.setdefault("commit_window_s", LONG)
    return make_config(path, dram_pages, nvme_pages, durability="window", **kw)


def group(store: Store) -> GroupCommit:
    g = store._index.group if store._index is not None else None
    assert g is not None
    return g


def served(cfg: StoreConfig, seed: int, pages: int, *, read_only: bool = False) -> int:
    """Pages of prompt ``seed`` a fresh open serves; every one must hold its own bytes."""
    with Store.open(cfg, read_only=read_only) as s:
        return check(s, seed, pages)


def check(s: Store, seed: int, pages: int) -> int:
    out = np.zeros((pages, PB), dtype=np.uint8)
    n = s.get(prompt(seed, pages), out).pages
    assert np.array_equal(out[:n], page_data(seed, pages)[:n]), f"prompt {seed}: wrong bytes"
    return n


def count_flushes(monkeypatch: pytest.MonkeyPatch, tier: Tier, fail: int = 0) -> list[int]:
    """Count ``tier.flush`` calls; the first ``fail`` of them raise TierIOError (as EIO would)."""
    calls = [0]
    real = tier.flush

    def flush() -> None:
        calls[0] += 1
        if calls[0] <= fail:
            raise TierIOError("fdatasync failed: [Errno 5] Input/output error (injected)")
        real()
    monkeypatch.setattr(tier, "flush", flush)
    return calls


def test_config_checks_durability_and_window() -> None:
    base = {"store": {"path": "/tmp/x", "model_id": "m"}, "layout": {
        "num_layers": 1, "num_kv_heads": 1, "head_dim": 64, "dtype": "bf16", "tokens_per_page": 16},
        "tiers": {"nvme": {"capacity_bytes": "1MiB"}}}
    cfg = config_from_dict(base)
    assert cfg.durability == "window"
    for bad in ({"durability": "never"}, {"durability": True}, {"commit_window_s": 0},
                {"commit_window_s": float("inf")}, {"commit_window_pages": 0}, {"commit_window_pages": 1.5}):
        with pytest.raises(ConfigError, match="store"):
            config_from_dict({**base, "store": {**base["store"], **bad}})  # type: ignore[dict-item]


def test_puts_in_a_window_share_one_sync_and_one_commit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = window(tmp_path / "s")
    with Store.open(cfg) as s:
        nvme = s._manager.tiers[0]
        calls = count_flushes(monkeypatch, nvme)
        for i in range(5):
            assert s.put(prompt(i, 3), page_data(i, 3)).stored == 3
        assert calls[0] == 0 and group(s).pending == 15 and group(s).windows == 0
        assert served(cfg, 0, 3, read_only=True) == 0  # readers see committed windows only
        assert check(s, 4, 3) == 3                      # the writer serves its pages at once
        s.flush()
        assert calls[0] == 1 and group(s).pending == 0 and group(s).windows == 1
        for i in range(5):
            assert served(cfg, i, 3, read_only=True) == 3
        s.flush()                                       # nothing new: no sync, no commit
        assert calls[0] == 1 and group(s).windows == 1


def test_put_mode_syncs_and_commits_every_put(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = make_config(tmp_path / "s", 0, 32, durability="put")
    with Store.open(cfg) as s:
        assert s._index is not None and not s._index.deferred
        calls = count_flushes(monkeypatch, s._manager.tiers[0])
        for i in range(3):
            s.put(prompt(i, 2), page_data(i, 2))
            assert served(cfg, i, 2, read_only=True) == 2
        assert calls[0] == 3
        s.flush()


def test_a_window_closes_on_its_deadline_and_on_its_page_count(tmp_path: Path) -> None:
    with Store.open(window(tmp_path / "a", commit_window_s=0.05)) as s:
        s.put(prompt(0, 3), page_data(0, 3))
        assert wait_for(lambda: group(s).windows == 1 and group(s).pending == 0)
    with Store.open(window(tmp_path / "b", commit_window_pages=4)) as s:
        s.put(prompt(1, 3), page_data(1, 3))
        assert group(s).pending == 3
        s.put(prompt(2, 3), page_data(2, 3))
        assert wait_for(lambda: group(s).windows >= 1)
        assert served(window(tmp_path / "b"), 1, 3, read_only=True) == 3


def test_close_commits_the_open_window(tmp_path: Path) -> None:
    cfg = window(tmp_path / "s")
    with Store.open(cfg) as s:
        s.put(prompt(0, 3), page_data(0, 3))
        s.put(prompt(1, 2), page_data(1, 2))
    assert served(cfg, 0, 3) == 3 and served(cfg, 1, 2) == 2


def test_failed_data_sync_commits_no_record_and_surfaces_once(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = window(tmp_path / "s")
    with Store.open(cfg) as s:
        s.put(prompt(0, 2), page_data(0, 2))
        s.flush()                                            # prompt 0 is durable
        count_flushes(monkeypatch, s._manager.tiers[0], fail=1)
        s.put(prompt(1, 2), page_data(1, 2))
        with pytest.raises(TierIOError, match="injected"):
            s.flush()
        assert check(s, 1, 2) == 2                          # still served here, checked as every read
        s.put(prompt(2, 2), page_data(2, 2))
        s.flush()                                            # the error was raised once; this window syncs
    assert served(cfg, 0, 2) == 2 and served(cfg, 2, 2) == 2
    assert served(cfg, 1, 2) == 0                            # its window's sync failed: never committed


def test_failed_background_sync_is_raised_by_close(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = window(tmp_path / "s", commit_window_s=0.02)
    s = Store.open(cfg)
    count_flushes(monkeypatch, s._manager.tiers[0], fail=1)
    s.put(prompt(0, 2), page_data(0, 2))
    assert wait_for(lambda: group(s).pending == 0 and group(s)._lost is not None)
    with pytest.raises(TierIOError, match="injected"):
        s.close()
    assert served(cfg, 0, 2) == 0


def test_a_degraded_tier_keeps_its_records_waiting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = window(tmp_path / "s")
    with Store.open(cfg) as s:
        nvme = s._manager.tiers[0]
        real = nvme.flush
        down = [True]

        def flush() -> None:
            if down[0]:
                raise TierUnavailableError("nvmeof tier is degraded (injected); flush refused")
            real()
        monkeypatch.setattr(nvme, "flush", flush)
        s.put(prompt(0, 2), page_data(0, 2))
        for _ in range(2):                                   # raised while the records wait
            with pytest.raises(TierUnavailableError, match="injected"):
                s.flush()
        assert group(s).pending == 2
        down[0] = False                                      # the tier is back: the window commits
        s.flush()
    assert served(cfg, 0, 2) == 2


def test_failed_index_commit_is_retried_and_surfaces(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = window(tmp_path / "s")
    with Store.open(cfg) as s:
        g = group(s)
        real = g._apply
        fails = [1]

        def apply(ops: dict[str, dict[bytes, object]]) -> None:
            if fails[0]:
                fails[0] -= 1
                raise TierIOError("store index group commit failed: MDB_MAP_FULL (injected)")
            real(ops)  # type: ignore[arg-type]
        monkeypatch.setattr(g, "_apply", apply)
        s.put(prompt(0, 3), page_data(0, 3))
        with pytest.raises(TierIOError, match="injected"):
            s.flush()
        assert g.pending == 3                                # back in the buffer: the data was synced
        s.flush()
    assert served(cfg, 0, 3) == 3


def test_demotions_and_their_evictions_share_the_window(tmp_path: Path) -> None:
    # Demotions from DRAM to NVMe inside one window land in its single commit, with the
    # deletes of the NVMe pages they evicted ahead of the records that reuse their slots.
    cfg = window(tmp_path / "s", nvme_pages=6, dram_pages=2)
    with Store.open(cfg) as s:
        for i in range(8):
            s.put(prompt(i, 2), page_data(i, 2))
        s.flush()
        assert group(s).windows == 1
        assert s.stats().tiers["nvme"].used_slots == 6
    ro = make_config(tmp_path / "s", 0, 6)
    # The committed window names exactly what the NVMe tier held: 3 prompts, all intact.
    assert sum(served(ro, i, 2, read_only=True) for i in range(8)) == 6


CRASH_CHILD = """
import sys
from tests.store.test_group_commit import window, prompt
from tests.conftest import page_data
from pathlib import Path
from tierkv.store.api import Store
s = Store.open(window(Path(sys.argv[1]), nvme_pages=4))
s.put(prompt(0, 4), page_data(0, 4))
s.flush()                                      # prompt 0: durable, in all 4 slots
s.put(prompt(1, 4), page_data(1, 4))           # evicts prompt 0 and reuses its slots, in the window
print("ready", flush=True)
sys.stdin.read()
"""


def test_slots_reused_in_the_window_stay_misses_after_a_crash(tmp_path: Path) -> None:
    path = tmp_path / "s"
    child = subprocess.Popen([sys.executable, "-c", CRASH_CHILD, str(path)], cwd=ROOT,
                             env=dict(os.environ, PYTHONPATH=str(ROOT)), stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert child.stdout is not None
    line = child.stdout.readline()
    assert line.strip() == "ready", child.stderr.read() if child.stderr else line
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=30)
    cfg = window(path, nvme_pages=4)
    # Prompt 0's records survive and name slots that now hold prompt 1's bytes: they fail
    # their checksums (misses). Prompt 1 was never committed: a miss, its slots free.
    assert served(cfg, 0, 4) == 0
    assert served(cfg, 1, 4) == 0
    assert served(cfg, 0, 4) == 0


def test_puts_wait_when_the_next_window_outgrows_a_slow_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """While a window is synced and committed the next one fills; a put that leaves it
    holding twice ``commit_window_pages`` returns only once the window in progress is
    done, so a disk slower than the puts bounds what a crash can lose."""
    import threading

    cfg = window(tmp_path / "s", nvme_pages=64, commit_window_pages=4)
    with Store.open(cfg) as s:
        nvme = s._manager.tiers[0]
        real, slow, syncing = nvme.flush, threading.Event(), threading.Event()

        def flush() -> None:   # a disk that takes its time: until the test lets it go
            syncing.set()
            slow.wait(LONG)
            real()
        monkeypatch.setattr(nvme, "flush", flush)
        s.put(prompt(0, 2), page_data(0, 2))
        s.put(prompt(1, 2), page_data(1, 2))          # 4 wait: the window closes, its sync hangs
        assert syncing.wait(LONG) and group(s).pending == 0
        done: list[int] = []

        def writer() -> None:
            for i in range(2, 7):
                s.put(prompt(i, 2), page_data(i, 2))
                done.append(i)
        t = threading.Thread(target=writer)
        t.start()
        assert wait_for(lambda: group(s).pending >= 8)
        t.join(0.5)
        # The put that made the window 8 stored its pages and waits; no later one has run.
        assert t.is_alive() and done == [2, 3, 4] and group(s).pending == 8
        slow.set()
        t.join(LONG)
        assert not t.is_alive() and done == [2, 3, 4, 5, 6]
        s.flush()
        assert group(s).pending == 0
    for i in range(7):
        assert served(cfg, i, 2) == 2
