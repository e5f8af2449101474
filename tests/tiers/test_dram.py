"""The DRAM tier's own behaviour beyond the conformance suite."""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import tierkv.tiers.aligned as aligned
import tierkv.tiers.hugepages as hugepages
import tierkv.tiers.dram as dram
from tierkv.config import DramConfig, config_from_dict
from tierkv.errors import CapacityError, InputError
from tierkv.store.pages import PageList
from tests.polling import ends_while_busy


def test_a_tier_that_does_not_fit_in_memory_names_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_memory(nbytes: int) -> object:
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr(dram, "_shared_buffer", no_memory)
    with pytest.raises(CapacityError, match=r"dram tier: cannot allocate 64\.0 GiB .*capacity_bytes"):
        dram.DramTier(1 << 20, 1 << 16)


def test_a_tier_larger_than_memory_and_swap_is_refused_at_open() -> None:
    # Its memfd would be created sparse and fail page by page later: refused up front.
    slots = 2 * dram._memory_and_swap() // (1 << 20) + 1
    with pytest.raises(CapacityError, match="more than this machine's memory and swap"):
        dram.DramTier(slots, 1 << 20)


def test_the_slot_buffer_is_a_memfd_another_process_can_map() -> None:
    import mmap

    with dram.DramTier(4, 8192) as t:
        t.write([2], np.full((1, 8192), 7, dtype=np.uint8))
        fd = t.lend_fd()
        assert fd >= 0
        m = mmap.mmap(fd, 4 * 8192, mmap.MAP_SHARED, mmap.PROT_READ)   # as a client maps what it is sent
        assert np.frombuffer(m, dtype=np.uint8)[2 * 8192:3 * 8192].tolist() == [7] * 8192
        m.close()


def test_the_shmem_huge_page_mode_is_read_from_the_kernel(tmp_path: Path) -> None:
    """shmem_enabled, unless the 2 MiB size's own setting says otherwise (newer kernels)."""
    thp = tmp_path / "kernel/mm/transparent_hugepage"
    thp.mkdir(parents=True)
    (thp / "shmem_enabled").write_text("always within_size [advise] never deny force\n")
    assert hugepages.shmem_huge_pages(str(tmp_path)) == "advise"
    (thp / "hugepages-2048kB").mkdir()
    (thp / "hugepages-2048kB/shmem_enabled").write_text("always [inherit] within_size advise never\n")
    assert hugepages.shmem_huge_pages(str(tmp_path)) == "advise"
    (thp / "hugepages-2048kB/shmem_enabled").write_text("always inherit within_size advise [never]\n")
    assert hugepages.shmem_huge_pages(str(tmp_path)) == "never"       # both must allow them
    (thp / "shmem_enabled").write_text("always within_size advise [never] deny force\n")
    (thp / "hugepages-2048kB/shmem_enabled").write_text("always inherit within_size [advise] never\n")
    assert hugepages.shmem_huge_pages(str(tmp_path)) == "never"
    (thp / "hugepages-2048kB/shmem_enabled").write_text("[inherit]")
    (thp / "shmem_enabled").write_text("garbled")
    assert hugepages.shmem_huge_pages(str(tmp_path)) == "unknown"
    assert hugepages.shmem_huge_pages(str(tmp_path / "absent")) == "unknown"


@pytest.mark.skipif(not os.path.isdir("/sys/kernel/mm/transparent_hugepage"),
                    reason="a kernel without transparent huge pages refuses the advice")
def test_the_slot_buffer_and_page_buffers_ask_for_huge_pages() -> None:
    """The advice is on the mapping (VmFlags hg) whatever the kernel then gives, over whole
    2 MiB pages only: a smaller memfd keeps 4 KiB pages (a kernel before 6.11 would give
    it a whole huge page)."""
    from tierkv.serve.client import _Segment

    with dram.DramTier(8, 1 << 20) as t:
        if t.lend_fd() < 0:
            pytest.skip("the slot buffer is page-locked memory here, not a memfd")
        assert "hg" in _smaps_flags(int(t.buffer.ctypes.data))
    big, small = _Segment(4 << 20, "test-big"), _Segment(64 << 10, "test-small")
    try:
        assert "hg" in _smaps_flags(big.base)
        assert "hg" not in _smaps_flags(small.base)
    finally:
        big.close()
        small.close()


@pytest.mark.skipif(hugepages.shmem_huge_pages() not in hugepages.HUGE_MODES,
                    reason="the kernel gives shared memory no huge pages (transparent_hugepage/shmem_enabled)")
def test_the_slot_buffer_gets_huge_pages_where_the_kernel_gives_them() -> None:
    with dram.DramTier(8, 1 << 20) as t:   # 8 MiB: whole huge pages
        t.write(list(range(8)), np.ones((8, 1 << 20), dtype=np.uint8))
        assert int((_smaps(int(t.buffer.ctypes.data), "ShmemPmdMapped") or "0").split()[0]) > 0


def _smaps(addr: int, field: str) -> str:
    """A field of the /proc/self/smaps entry of the mapping that holds ``addr`` ("" if none)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(" ", 1)[0]
            if "-" in head and all(ch in "0123456789abcdef-" for ch in head):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and line.startswith(field + ":"):
                return line.split(":", 1)[1].strip()
    return ""


def _smaps_flags(addr: int) -> list[str]:
    return _smaps(addr, "VmFlags").split()


def _resident(buf: np.ndarray) -> float:
    """The fraction of ``buf``'s memory pages that are resident (mincore)."""
    libc = ctypes.CDLL(None, use_errno=True)
    page = os.sysconf("SC_PAGE_SIZE")
    n = -(-buf.nbytes // page)
    vec = (ctypes.c_ubyte * n)()
    assert libc.mincore(ctypes.c_void_p(buf.ctypes.data), ctypes.c_size_t(buf.nbytes), vec) == 0
    return sum(v & 1 for v in vec) / n


def _populate_write_supported() -> bool:
    buf = aligned.aligned_empty(4096)
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return madvise(int(buf.ctypes.data), 4096, aligned.MADV_POPULATE_WRITE) == 0


needs_populate = pytest.mark.skipif(not _populate_write_supported(), reason="MADV_POPULATE_WRITE needs Linux 5.14+")


@needs_populate
def test_prefault_makes_the_buffer_resident_at_open_and_lazy_leaves_it_alone() -> None:
    with dram.DramTier(256, 4096) as lazy, dram.DramTier(256, 4096, prefault=True) as eager:
        assert _resident(lazy.buffer) < 0.1
        assert _resident(eager.buffer) == 1.0
        assert not eager.buffer.any()   # faulted in, never written: still zeroes


@needs_populate
def test_a_large_buffer_is_prefaulted_in_the_background_beside_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(aligned, "PREFAULT_SYNC_BYTES", 64 << 10)
    monkeypatch.setattr(aligned, "PREFAULT_CHUNK", 64 << 10)
    rng = np.random.default_rng(3)
    pages = rng.integers(0, 256, (64, 4096), dtype=np.uint8)
    with dram.DramTier(2048, 4096, prefault=True) as tier:
        assert tier._prefault is not None and tier._prefault._thread is not None
        slots = list(range(0, 2048, 32))
        tier.write(slots, pages)            # while the thread works through the buffer
        assert tier._prefault.done.wait(30)
        assert _resident(tier.buffer) == 1.0
        out = np.empty_like(pages)
        tier.read(slots, out)
        assert np.array_equal(out, pages)


def test_close_stops_a_background_prefault(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(aligned, "PREFAULT_SYNC_BYTES", 4096)
    monkeypatch.setattr(aligned, "PREFAULT_CHUNK", 4096)
    tier = dram.DramTier(16384, 4096, prefault=True)
    prefault = tier._prefault
    assert prefault is not None and prefault._thread is not None
    tier.close()
    assert not prefault._thread.is_alive() and prefault.done.is_set()


def test_prefault_is_on_unless_the_config_turns_it_off() -> None:  # its type checks: tests/test_config.py
    cfg = config_from_dict({"store": {"path": "/tmp/unused", "model_id": "m"},
                            "layout": {"num_layers": 1, "num_kv_heads": 1, "head_dim": 64},
                            "tiers": {"dram": {"capacity_bytes": "1MiB", "prefault": False}}})
    assert cfg.dram is not None and cfg.dram.prefault is False
    assert DramConfig(1 << 20).prefault is True


def test_a_buffer_larger_than_the_memory_available_is_left_to_fault_lazily(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(aligned, "memory_available", lambda: 4 << 20)   # 4 MiB free, an 8 MiB tier
    with caplog.at_level("WARNING"), dram.DramTier(2048, 4096, prefault=True) as tier:
        assert tier._prefault is not None and tier._prefault.done.is_set()
        assert _resident(tier.buffer) < 0.1
    assert "not prefaulted" in caplog.text
    assert aligned.memory_available() is None or aligned.memory_available() > 0  # type: ignore[operator]


def test_a_tier_too_large_to_track_is_a_capacity_error_not_a_memory_error() -> None:
    """Issue 28 item 7: `--dram 1000000TiB` ended in a bare MemoryError from the slot map."""
    with pytest.raises(CapacityError, match=r"dram tier: cannot keep the free map of 281,474,976,710,656 slots"):
        dram.DramTier(1 << 48, 4096)


@pytest.mark.parametrize("version", [1, 2])
def test_a_cgroup_limit_bounds_the_memory_available(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    version: int) -> None:
    """In a container MemAvailable is the host's: the cgroup's limit less its usage counts (review)."""
    if version == 2:
        (tmp_path / "proc").write_text("0::/kv.slice\n")
        d = tmp_path / "cg" / "kv.slice"
        d.mkdir(parents=True)
        (d / "memory.max").write_text(f"{8 << 20}\n")
        (d / "memory.current").write_text(f"{3 << 20}\n")
    else:
        (tmp_path / "proc").write_text("5:devices:/\n4:memory:/docker/abc\n0::/\n")
        d = tmp_path / "cg" / "memory" / "docker" / "abc"
        d.mkdir(parents=True)
        (d / "memory.limit_in_bytes").write_text(f"{8 << 20}\n")
        (d / "memory.usage_in_bytes").write_text(f"{3 << 20}\n")
    monkeypatch.setattr(aligned, "PROC_CGROUP", str(tmp_path / "proc"))
    monkeypatch.setattr(aligned, "CGROUP_ROOT", str(tmp_path / "cg"))
    assert aligned.memory_available() == 5 << 20
    (d / ("memory.max" if version == 2 else "memory.limit_in_bytes")).write_text("max\n" if version == 2 else
                                                                               "9223372036854771712\n")
    host = aligned.memory_available()
    assert host is not None and host > 5 << 20      # no limit: the host's MemAvailable


def test_copies_outside_the_lock_refuse_slots_out_of_range_before_counting_them() -> None:

    tier = dram.DramTier(4, 4096)
    try:
        with pytest.raises(InputError, match="slot 4 out of range"):
            tier.begin_copy([1, 4])
        with pytest.raises(InputError, match="slot -1 out of range"):
            tier.begin_copy([-1])
        token = tier.begin_copy([3])           # nothing of the refused copies was counted
        with pytest.raises(InputError, match="slot -1 out of range"):
            tier.free([-1])                    # not taken for the busy last slot
        tier.end_copy(token)
        assert tier.held_back == 0 and not tier.lent(token)
    finally:
        tier.close()


@pytest.mark.parametrize("n", [3, 40])   # the loop, and the numpy pass over many slots
def test_slots_must_be_whole_numbers_and_in_range_however_many(n: int) -> None:
    tier = dram.DramTier(64, 256)
    rows = np.ones((n, 256), np.uint8)
    try:
        with pytest.raises(InputError, match="slots are whole numbers, got 0.5"):
            tier.write([i + 0.5 for i in range(n)], rows)   # type: ignore[misc]
        with pytest.raises(InputError, match="slot 64 out of range"):
            tier.write([1] * (n - 1) + [64], rows)   # the bad one is named
        tier.write(np.arange(n, dtype=np.int32), rows)   # type: ignore[call-overload]
        out = np.zeros_like(rows)
        tier.read(list(range(n)), out)
        assert (out == 1).all()
    finally:
        tier.close()


# -- large batches copied on several threads ---------------------------------------------
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
    assert dram._copying == 0


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
    assert dram._copying == 0


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
    pool = dram._copy_pool(1)
    seen = _spy(monkeypatch, "_read_serial")
    src = _batch(16, MIB, 3)
    out = np.empty_like(src)

    def read() -> None:
        with dram.DramTier(16, MIB, copy_threads=2) as tier:
            tier.write(list(range(16)), src)
            tier.read(list(range(16)), out)

    ends_while_busy(pool, dram._pool_workers, read)
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
        assert dram._copying == 0
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
    assert dram._copying == 0


def test_copy_threads_come_from_the_config_and_bad_ones_are_refused(tmp_path: Path) -> None:
    assert 1 <= dram.default_copy_threads() <= 4
    assert dram.default_copy_threads() <= len(os.sched_getaffinity(0))
    cfg = config_from_dict({"store": {"path": str(tmp_path), "model_id": "m"},
                            "layout": {"num_layers": 1, "num_kv_heads": 1, "head_dim": 64},
                            "tiers": {"dram": {"capacity_bytes": "1MiB", "copy_threads": 3}}})
    assert cfg.dram is not None and cfg.dram.copy_threads == 3
    from tierkv.store.opening import _dram
    tier = _dram(cfg, read_only=False)
    assert isinstance(tier, dram.DramTier) and tier.copy_threads == 3
    tier.close()
    tier = _dram(dataclasses.replace(cfg, dram=DramConfig(1 << 20)), read_only=False)
    assert isinstance(tier, dram.DramTier) and tier.copy_threads == dram.default_copy_threads()
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
