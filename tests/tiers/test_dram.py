"""The DRAM tier's own behaviour beyond the conformance suite."""

from __future__ import annotations

import ctypes
import errno
import os
from pathlib import Path

import numpy as np
import pytest

import tierkv.tiers.aligned as aligned
import tierkv.tiers.hugepages as hugepages
import tierkv.tiers.dram as dram
from tierkv.config import DramConfig, config_from_dict
from tierkv.errors import CapacityError, InputError


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
