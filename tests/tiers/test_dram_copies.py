"""The DRAM tier's large copies on several threads (tierkv.tiers.parallel_copy): exact bytes
whoever copies, chunking thresholds, failures raised once nothing is in flight, a busy or
refusing pool, other large copies beside one, forks and interpreter exit."""

from __future__ import annotations

import dataclasses
import errno
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import tierkv.tiers.dram as dram
import tierkv.tiers.parallel_copy as parallel_copy
from tierkv.config import DramConfig, config_from_dict
from tierkv.errors import InputError
from tierkv.store.pages import PageList
from tests.polling import ends_while_busy

MIB = 1 << 20


def _batch(n: int, width: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, width), dtype=np.uint8)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("source", ["array", "list", "numpy"])   # numpy: the copies without the extension
def test_a_large_batch_lands_exact_on_any_number_of_threads(threads: int, source: str,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    if source == "numpy":
        monkeypatch.setattr(dram, "_copy", None)
    n, page = 21, MIB                                   # 21 MiB: shares of 7 or 10-11 pages
    slots = np.random.default_rng(threads).permutation(24)[:n].tolist()   # scattered, not a run
    src = _batch(n, page, threads)
    with dram.DramTier(24, page, copy_threads=threads) as tier:
        tier.write(slots, PageList(list(src), page) if source == "list" else src)
        out = np.zeros_like(src)
        tier.read(slots, out)
        assert np.array_equal(out, src)
        rest = sorted(set(range(24)) - set(slots))
        assert not tier.buffer[rest].any()              # nothing landed outside the batch's slots


def _spy(monkeypatch: pytest.MonkeyPatch, method: str) -> list[tuple[str, int]]:
    seen: list[tuple[str, int]] = []
    real = getattr(dram.DramTier, method)

    def spy(self: dram.DramTier, slots: list[int], rows: object) -> None:
        seen.append((threading.current_thread().name, len(slots)))
        real(self, slots, rows)

    monkeypatch.setattr(dram.DramTier, method, spy)
    return seen


def test_a_batch_of_16_mib_is_shared_out_and_a_smaller_one_is_not(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[str, int]] = []
    real = dram.DramTier._read_serial
    helped = threading.Event()
    me = threading.current_thread().name

    def spy(self: dram.DramTier, slots: list[int], dst: np.ndarray) -> None:
        name = threading.current_thread().name
        seen.append((name, len(slots)))
        if name.startswith("tierkv-dram-copy"):
            helped.set()
        elif len(slots) == 8:
            helped.wait(10)   # the caller's first chunk: until a pool thread has taken the other
        real(self, slots, dst)

    monkeypatch.setattr(dram.DramTier, "_read_serial", spy)
    with dram.DramTier(40, MIB, copy_threads=2) as tier:
        tier.read(list(range(16)), np.empty((16, MIB), np.uint8))
        assert sorted(n for _, n in seen) == [8, 8]                     # chunks of 8 MiB
        assert {name.startswith("tierkv-dram-copy") for name, _ in seen} == {True, False}
        seen.clear()
        tier.read(list(range(15)), np.empty((15, MIB), np.uint8))   # under 16 MiB: this thread alone
        assert seen == [(me, 15)]
        seen.clear()
        tier.read(list(range(20)), np.empty((20, MIB // 2), np.uint8))   # rows narrower than slots: 10 MiB
        assert seen == [(me, 20)]
    with dram.DramTier(40, MIB, copy_threads=1) as tier:
        seen.clear()
        tier.read(list(range(40)), np.empty((40, MIB), np.uint8))
        assert seen == [(me, 40)]
    with dram.DramTier(40, MIB, copy_threads=8) as tier:
        seen.clear()
        tier.read(list(range(20)), np.empty((20, MIB), np.uint8))
        assert sorted(n for _, n in seen) == [4, 8, 8]
    assert parallel_copy._copying == 0


def test_a_failed_chunk_is_raised_once_every_chunk_taken_has_ended(monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[int] = []
    ended: list[int] = []
    real = dram.DramTier._write_serial
    helper_in = threading.Event()

    def chunk(self: dram.DramTier, slots: list[int], src: np.ndarray) -> None:
        started.append(slots[0])
        if threading.current_thread().name.startswith("tierkv-dram-copy"):
            helper_in.set()
            time.sleep(0.3)                # still writing when the caller's chunk fails
            real(self, slots, src)
            ended.append(slots[0])
            return
        helper_in.wait(10)                 # the caller's chunk fails once a helper has one in flight
        raise OSError(errno.EIO, f"chunk at slot {slots[0]} failed")

    monkeypatch.setattr(dram.DramTier, "_write_serial", chunk)
    with dram.DramTier(32, MIB, copy_threads=2) as tier:
        src = _batch(32, MIB, 7)
        with pytest.raises(OSError, match="chunk at slot (0|8) failed"):
            tier.write(list(range(32)), src)
        assert len(ended) == 1             # raised only after the helper's chunk had written
        assert len(started) == 2           # and no chunk was taken after the failure
        done = ended[0]
        assert np.array_equal(tier.buffer[done:done + 8], src[done:done + 8])
    assert parallel_copy._copying == 0


def test_a_large_write_naming_a_slot_twice_lands_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _spy(monkeypatch, "_write_serial")
    src = _batch(16, MIB, 9)
    slots = list(range(15)) + [3]          # row 15 goes to slot 3 after row 3
    with dram.DramTier(16, MIB, copy_threads=2) as tier:
        tier.write(slots, src)
        assert seen == [(threading.current_thread().name, 16)]   # one call, not chunks
        assert np.array_equal(tier.buffer[3], src[15]) and np.array_equal(tier.buffer[4], src[4])


def test_a_caller_copies_the_shares_no_pool_thread_has_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    # Every pool thread busy (another caller's shares, say): the call does not wait for
    # one to come free, it copies the whole batch itself.
    pool = parallel_copy._copy_pool(1)
    seen = _spy(monkeypatch, "_read_serial")
    src = _batch(16, MIB, 3)
    out = np.empty_like(src)

    def read() -> None:
        with dram.DramTier(16, MIB, copy_threads=2) as tier:
            tier.write(list(range(16)), src)
            tier.read(list(range(16)), out)

    ends_while_busy(pool, parallel_copy._pool_workers, read)
    assert seen == [("caller", 8), ("caller", 8)]
    assert np.array_equal(out, src)


def test_a_large_copy_beside_another_takes_only_the_threads_left(monkeypatch: pytest.MonkeyPatch) -> None:
    # Two clients of a daemon copying at once on two cores: each on its own thread, not
    # three threads (two callers and the pool's) fighting for two cores.
    seen: list[tuple[str, int]] = []
    real = dram.DramTier._read_serial
    inside, go = threading.Event(), threading.Event()

    def spy(self: dram.DramTier, slots: list[int], dst: np.ndarray) -> None:
        seen.append((threading.current_thread().name, len(slots)))
        if threading.current_thread().name == "first":
            inside.set()
            go.wait(20)
        real(self, slots, dst)

    monkeypatch.setattr(dram.DramTier, "_read_serial", spy)
    with dram.DramTier(32, MIB, copy_threads=2) as tier:
        first = threading.Thread(target=tier.read, args=(list(range(16)), np.empty((16, MIB), np.uint8)),
                                 name="first")
        first.start()
        try:
            assert inside.wait(20)
            tier.read(list(range(16, 32)), np.empty((16, MIB), np.uint8))   # while the first one copies
            assert (threading.current_thread().name, 16) in seen             # whole, on this thread
        finally:
            go.set()
            first.join()
        assert ("first", 8) in seen and sorted(n for _, n in seen) == [8, 8, 16]
        assert parallel_copy._copying == 0
        seen.clear()
        tier.read(list(range(16)), np.empty((16, MIB), np.uint8))          # alone again: shared out
        assert sorted(n for _, n in seen) == [8, 8]


def test_a_helper_stops_taking_chunks_once_another_large_copy_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    by_pool: list[int] = []
    real = dram.DramTier._read_serial
    helper_in, b_in, a_done = threading.Event(), threading.Event(), threading.Event()

    def spy(self: dram.DramTier, slots: list[int], dst: np.ndarray) -> None:
        name = threading.current_thread().name
        if name.startswith("tierkv-dram-copy"):
            by_pool.append(slots[0])
            helper_in.set()
            b_in.wait(10)            # B copies now: three threads for two
        elif name == "A" and not helper_in.is_set():
            helper_in.wait(10)       # A's first chunk: until its helper has one too
        elif name == "B":
            b_in.set()
            a_done.wait(10)
        real(self, slots, dst)

    monkeypatch.setattr(dram.DramTier, "_read_serial", spy)
    with dram.DramTier(48, MIB, copy_threads=2) as tier:
        a = threading.Thread(target=tier.read, args=(list(range(32)), np.empty((32, MIB), np.uint8)), name="A")
        b = threading.Thread(target=tier.read, args=(list(range(32, 48)), np.empty((16, MIB), np.uint8)), name="B")
        a.start()
        assert helper_in.wait(10)
        b.start()
        a.join(20)
        a_done.set()
        b.join(20)
    assert len(by_pool) == 1      # the helper's one chunk; A copied the other three itself
    assert parallel_copy._copying == 0


def test_copy_threads_come_from_the_config_and_bad_ones_are_refused(tmp_path: Path) -> None:
    assert 1 <= parallel_copy.default_copy_threads() <= 4
    assert parallel_copy.default_copy_threads() <= len(os.sched_getaffinity(0))
    cfg = config_from_dict({"store": {"path": str(tmp_path), "model_id": "m"},
                            "layout": {"num_layers": 1, "num_kv_heads": 1, "head_dim": 64},
                            "tiers": {"dram": {"capacity_bytes": "1MiB", "copy_threads": 3}}})
    assert cfg.dram is not None and cfg.dram.copy_threads == 3
    from tierkv.store.opening import _dram
    tier = _dram(cfg, read_only=False)
    assert isinstance(tier, dram.DramTier) and tier.copy_threads == 3
    tier.close()
    tier = _dram(dataclasses.replace(cfg, dram=DramConfig(1 << 20)), read_only=False)
    assert isinstance(tier, dram.DramTier) and tier.copy_threads == parallel_copy.default_copy_threads()
    tier.close()
    for bad in (0, -1, True, 2.0, "2"):
        with pytest.raises(InputError, match=r"copy_threads >= 1 .*got"):
            dram.DramTier(4, 4096, copy_threads=bad)   # type: ignore[arg-type]


def test_a_forked_child_copies_a_large_batch_on_threads_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    # Forked while another thread copies a large batch: the child inherits the parent's
    # pool (no threads here) and its count of copying threads (one that will never end).
    # Its own large copy must still get a helper thread.
    real = dram.DramTier._read_serial
    in_copy, forked = threading.Event(), threading.Event()

    def parent_spy(self: dram.DramTier, slots: list[int], dst: np.ndarray) -> None:
        if threading.current_thread().name == "parent-copy":
            in_copy.set()
            forked.wait(20)
        real(self, slots, dst)

    monkeypatch.setattr(dram.DramTier, "_read_serial", parent_spy)
    tier = dram.DramTier(16, MIB, copy_threads=2)
    parent = threading.Thread(target=tier.read, args=(list(range(16)), np.empty((16, MIB), np.uint8)),
                              name="parent-copy")
    parent.start()
    assert in_copy.wait(20)
    pid = os.fork()
    if pid == 0:   # the child: exit status 0 only if a pool thread helped and the copy is exact
        code = 1
        try:
            helped = threading.Event()

            def child_spy(self: dram.DramTier, slots: list[int], dst: np.ndarray) -> None:
                if threading.current_thread().name.startswith("tierkv-dram-copy"):
                    helped.set()
                else:
                    helped.wait(10)   # the caller's chunk: until a helper has taken one
                real(self, slots, dst)

            dram.DramTier._read_serial = child_spy  # type: ignore[method-assign,assignment]
            src = _batch(16, MIB, 11)
            with dram.DramTier(16, MIB, copy_threads=2) as mine:
                mine.write(list(range(16)), src)
                out = np.empty_like(src)
                mine.read(list(range(16)), out)
                code = 0 if helped.is_set() and np.array_equal(out, src) else 2
        finally:
            os._exit(code)
    forked.set()
    parent.join()
    tier.close()
    deadline = time.monotonic() + 60
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the child's large copy never ended")
        time.sleep(0.05)
    assert os.waitstatus_to_exitcode(status) == 0   # 2: no pool thread helped the child


EXIT_SCRIPT = """
import atexit, threading, numpy as np
import tierkv.tiers.dram as dram
import tierkv.tiers.parallel_copy as parallel_copy
tier = dram.DramTier(32, 1 << 20, copy_threads=2)
src = np.random.default_rng(1).integers(0, 256, (32, 1 << 20), dtype=np.uint8)

def late():   # a large copy after the main thread has returned (a non-daemon thread)
    threading.main_thread().join()
    out = np.empty_like(src)
    tier.write(list(range(32)), src)
    tier.read(list(range(32)), out)
    print("late", np.array_equal(out, src))

def at_exit():
    out = np.zeros_like(src)
    tier.read(list(range(32)), out)
    print("atexit", np.array_equal(out, src))

atexit.register(at_exit)
threading.Thread(target=late).start()
"""


def test_large_copies_work_after_the_main_thread_returned_and_at_exit(tmp_path: Path) -> None:
    # concurrent.futures takes no more work once the main thread is done: the caller then
    # copies every chunk itself (before: RuntimeError "cannot schedule new futures").
    import subprocess
    import sys

    script = tmp_path / "late.py"
    script.write_text(EXIT_SCRIPT)
    env = dict(os.environ, PYTHONPATH=str(Path(dram.__file__).resolve().parents[2]))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["late", "True", "atexit", "True"], done.stdout + done.stderr
