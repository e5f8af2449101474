"""The NVMe tier's own tests: what only a file-backed tier has.

Persistence, alignment, O_DIRECT and its fallback, the backing file's mode and size,
and I/O errors, on a real file (O_DIRECT on the ext4 under pytest's tmp_path).
"""
from __future__ import annotations

import errno
import fcntl
import logging
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from tierkv.errors import ConfigError, InputError, StoreBusyError, StoreClosedError, TierIOError
import tierkv.tiers.nvme as nvme_mod
from tierkv.tiers.aligned import ALIGN, aligned_empty
from tierkv.tiers.hugepages import HUGE_PAGE
from tierkv.tiers.nvme import NvmeTier



from tests.tiers.test_aligned import huge_kib, needs_thp
from tests.tiers.test_conformance import ODD_PAGE, PAGE, pages, read_back


# ==== NVMe tier only ====================================================================
def unaligned(n: int, width: int, shift: int) -> np.ndarray:
    """An (n, width) C-contiguous buffer whose first byte is ``shift`` past a page boundary."""
    return aligned_empty(n * width + shift)[shift:].reshape(n, width)


@pytest.mark.parametrize("o_direct", [True, False])
def test_nvme_persists_across_reopen(nvme_path: Path, o_direct: bool) -> None:
    src = pages(6, ODD_PAGE, seed=11)
    with NvmeTier(nvme_path, 6, ODD_PAGE, o_direct=o_direct) as tier:
        tier.write([5, 0, 2, 1, 4, 3], src)
        tier.flush()
    with NvmeTier(nvme_path, 6, ODD_PAGE, o_direct=o_direct, create=False) as tier:
        assert tier.num_free == 6  # the free list is the index's business, not the file's
        np.testing.assert_array_equal(read_back(tier, [5, 0, 2, 1, 4, 3], ODD_PAGE), src)


@pytest.mark.parametrize("page_bytes", [PAGE, ODD_PAGE])
@pytest.mark.parametrize("shift", [1, 64, 512])
def test_nvme_unaligned_caller_buffers(nvme_path: Path, page_bytes: int, shift: int) -> None:
    with NvmeTier(nvme_path, 10, page_bytes) as tier:
        src = unaligned(10, page_bytes, shift)
        src[...] = pages(10, page_bytes, seed=shift)
        tier.write(list(range(10)), src)
        dst = unaligned(10, page_bytes, shift)
        tier.read(list(range(10)), dst)
        np.testing.assert_array_equal(dst, src)


def test_nvme_aligned_buffers_skip_the_bounce(nvme_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with NvmeTier(nvme_path, 16, 64 << 10) as tier:
        borrowed = []
        real = tier._bounce.borrow
        monkeypatch.setattr(tier._bounce, "borrow", lambda: borrowed.append(1) or real())
        src = aligned_empty(16 * (64 << 10)).reshape(16, -1)
        src[...] = pages(16, 64 << 10, seed=12)
        dst = aligned_empty(src.size).reshape(src.shape)
        tier.write(list(range(16)), src)
        tier.read(list(range(16)), dst)
        np.testing.assert_array_equal(dst, src)
        assert borrowed == []
        tier.read(list(range(16)), unaligned(16, 64 << 10, 64))
        assert borrowed  # and an unaligned one does go through it


@needs_thp
@pytest.mark.parametrize("page_bytes", [1 << 20, 2 << 20])
def test_nvme_bounce_and_store_read_buffers_are_on_huge_pages(nvme_path: Path, tmp_path: Path,
                                                              page_bytes: int) -> None:
    """The buffers direct I/O moves again and again sit on huge pages (aligned_empty's
    ``huge``): the tier's bounce buffers (1 MiB ones two to a huge page) and a Store's own
    read rows, so that a 2 MiB transfer is not cut into requests by scattered 4 KiB pages."""
    from tierkv.config import NvmeConfig, StoreConfig
    from tierkv.layout import KVLayout
    from tierkv.store.api import Store

    with NvmeTier(nvme_path, 8, page_bytes, io_threads=2) as tier:
        src = unaligned(8, page_bytes, 64)
        src[...] = pages(8, page_bytes, seed=21)
        tier.write(list(range(8)), src)
        dst = unaligned(8, page_bytes, 64)
        tier.read(list(range(8)), dst)
        np.testing.assert_array_equal(dst, src)
        idle = tier._bounce._idle
        assert len(idle) == 2 and all(int(b.ctypes.data) % ALIGN == 0 for b in idle)
        assert all(huge_kib(int(b.ctypes.data)) >= HUGE_PAGE // 1024 for b in idle)
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=page_bytes // 64, dtype="bf16", tokens_per_page=16)
    cfg = StoreConfig(path=str(tmp_path / "store"), model_id="m", layout=layout, nvme=NvmeConfig(8 * page_bytes))
    with Store.open(cfg) as store:
        tokens = np.arange(4 * 16, dtype=np.int64)
        rows = pages(4, page_bytes, seed=22)
        store.put(tokens, rows)
        out = unaligned(4, page_bytes, 16)   # numpy's offset: through the tier's bounce buffers
        assert store.get(tokens, out).pages == 4
        np.testing.assert_array_equal(out, rows)
        # what a get of pages from below DRAM reads into (then checks, promotes, copies out)
        own = store._private_rows(4, page_bytes)
        own[...] = rows
        assert int(own.ctypes.data) % HUGE_PAGE == 0 and huge_kib(int(own.ctypes.data)) >= 4 * page_bytes // 1024


def test_nvme_rows_at_the_reported_alignment_skip_the_bounce(nvme_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             tmp_path: Path) -> None:
    """The kernel says what memory alignment O_DIRECT needs on the file (STATX_DIOALIGN):
    rows aligned to it are read and written in place by the real syscalls (bytes
    checked), rows aligned less still go through the bounce buffers. A Store's get into
    such rows (a verified read) goes through the tier's bounce buffers, whose copy out is
    the hash's pass, never through rows of the store's own."""
    from tierkv.config import NvmeConfig, StoreConfig
    from tierkv.layout import KVLayout
    from tierkv.store.api import Store
    from tierkv.tiers.aligned import dio_alignments

    width = 64 << 10
    with NvmeTier(nvme_path, 16, width) as tier:
        got = dio_alignments(tier._fd)
        reported = None if got is None else got[0]
        if reported is None or reported >= ALIGN:
            pytest.skip(f"{nvme_path.parent}'s filesystem reports no O_DIRECT memory alignment below a page "
                        f"({reported})")
        assert tier.mem_align == reported
        borrowed: list[int] = []
        real = tier._bounce.borrow
        monkeypatch.setattr(tier._bounce, "borrow", lambda: borrowed.append(1) or real())
        src = unaligned(16, width, reported)
        src[...] = pages(16, width, seed=13)
        dst = unaligned(16, width, reported)
        tier.write(list(range(16)), src)
        tier.read(list(range(16)), dst)
        np.testing.assert_array_equal(dst, src)
        assert borrowed == []
        less = unaligned(16, width, reported // 2)
        tier.read(list(range(16)), less)
        np.testing.assert_array_equal(less, src)
        assert borrowed    # half the alignment: bounced

    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=width // 64, dtype="bf16", tokens_per_page=16)
    assert layout.page_bytes == width
    cfg = StoreConfig(path=str(tmp_path / "store"), model_id="m", layout=layout, nvme=NvmeConfig(16 * width))
    with Store.open(cfg) as store:
        tokens = np.arange(8 * 16, dtype=np.int64)
        rows = pages(8, width, seed=14)
        store.put(tokens, rows)
        nvme = store._manager.tiers[0]
        copied: list[int] = []
        own, bounce = store._private_rows, nvme._bounce.borrow
        monkeypatch.setattr(store, "_private_rows", lambda n, w: copied.append(n) or own(n, w))
        monkeypatch.setattr(nvme._bounce, "borrow", lambda: copied.append(1) or bounce())
        for align in (reported, reported // 2, ALIGN):
            out = unaligned(8, width, align)
            assert store.get(tokens, out).pages == 8
            np.testing.assert_array_equal(out, rows)
            assert copied and set(copied) == {1}   # the tier's bounce buffers, not the store's rows
            copied.clear()


def test_nvme_goes_buffered_where_o_direct_needs_more_than_a_page(nvme_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """A file whose O_DIRECT transfers must be aligned to more than the tier's 4 KiB (as the
    kernel would report for some 16 KiB-block setups; none here, so the report is
    substituted) would refuse every transfer: the tier opens it buffered, says so once an
    open, and its pages survive a reopen. The lock of an exclusive tier is on the descriptor
    it keeps."""
    monkeypatch.setattr(nvme_mod, "dio_alignments", lambda fd: (512, 16384))
    src = pages(4, PAGE, seed=15)
    with caplog.at_level(logging.WARNING, logger="tierkv.tiers.nvme"):
        with NvmeTier(nvme_path, 4, PAGE, exclusive=True) as tier:
            assert not tier.direct and tier.mem_align == 1
            assert not fcntl.fcntl(tier._fd, fcntl.F_GETFL) & os.O_DIRECT
            tier.write(list(range(4)), src)
            with pytest.raises(StoreBusyError):
                NvmeTier(nvme_path, 4, PAGE, exclusive=True, create=False)
    assert sum("aligned to 16384 bytes" in r.getMessage() for r in caplog.records) == 2   # once an open
    monkeypatch.setattr(nvme_mod, "dio_alignments", lambda fd: (512, 4096))
    with NvmeTier(nvme_path, 4, PAGE, create=False) as tier:
        assert tier.direct and tier.mem_align == 512
        np.testing.assert_array_equal(read_back(tier, [0, 1, 2, 3], PAGE), src)


def test_nvme_uses_o_direct_on_disk(nvme_path: Path) -> None:
    with NvmeTier(nvme_path, 2, PAGE) as tier:
        assert tier.direct
        assert fcntl.fcntl(tier.fileno(), fcntl.F_GETFL) & os.O_DIRECT


def test_nvme_falls_back_when_o_direct_refused(nvme_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               caplog: pytest.LogCaptureFixture) -> None:
    # This kernel's tmpfs accepts O_DIRECT, so the refusal is injected (EINVAL, as
    # older tmpfs and some FUSE filesystems answer).
    real_open = os.open

    def refusing_open(path: object, flags: int, *args: object) -> int:
        if flags & os.O_DIRECT and Path(str(path)) == nvme_path:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real_open(path, flags, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", refusing_open)
    with caplog.at_level(logging.WARNING, logger="tierkv.tiers.nvme"):
        tier = NvmeTier(nvme_path, 4, ODD_PAGE)
    with tier:
        assert not tier.direct
        assert not fcntl.fcntl(tier.fileno(), fcntl.F_GETFL) & os.O_DIRECT
        assert any("O_DIRECT" in r.getMessage() and str(nvme_path) in r.getMessage() for r in caplog.records)
        src = unaligned(4, ODD_PAGE, 3)
        src[...] = pages(4, ODD_PAGE, seed=13)
        tier.write([3, 1, 2, 0], src)
        np.testing.assert_array_equal(read_back(tier, [3, 1, 2, 0], ODD_PAGE), src)


def test_nvme_on_shm_follows_the_filesystem(shm_dir: Callable[[], Path], caplog: pytest.LogCaptureFixture) -> None:
    probe = shm_dir() / "probe"
    try:
        os.close(os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600))
        accepts = True
    except OSError:
        accepts = False
    with caplog.at_level(logging.WARNING, logger="tierkv.tiers.nvme"), \
            NvmeTier(shm_dir() / "tier.dat", 4, PAGE) as tier:
        assert tier.direct == accepts
        assert any("O_DIRECT" in r.getMessage() for r in caplog.records) != accepts
        src = pages(4, PAGE, seed=14)
        tier.write([0, 1, 2, 3], src)
        np.testing.assert_array_equal(read_back(tier, [0, 1, 2, 3], PAGE), src)


def test_nvme_file_is_0600_full_size_and_sparse_until_written(nvme_path: Path) -> None:
    with NvmeTier(nvme_path, 5, ODD_PAGE) as tier:
        assert tier.slot_bytes == 372736
        st = os.stat(nvme_path)
        assert st.st_mode & 0o777 == 0o600
        assert st.st_size == 5 * 372736
        assert st.st_blocks == 0
        tier.write([3], pages(1, ODD_PAGE, seed=30))
        assert os.stat(nvme_path).st_blocks * 512 >= 4 * 372736  # room up to the slot written, and ahead


def test_nvme_allocates_a_step_ahead_of_the_highest_slot_written(nvme_path: Path) -> None:
    step = nvme_mod.RESERVE_STEP_BYTES
    with NvmeTier(nvme_path, 4 * step // PAGE, PAGE) as tier:   # four steps of slots
        tier.write([0], pages(1, PAGE, seed=31))
        used = os.stat(nvme_path).st_blocks * 512
        assert step <= used < 2 * step
        last = step // PAGE - 1                                  # still inside the first step: no call
        tier.write([last], pages(1, PAGE, seed=32))
        assert os.stat(nvme_path).st_blocks * 512 == used
        tier.write([last + 1], pages(1, PAGE, seed=33))          # past it: one more step
        assert 2 * step <= os.stat(nvme_path).st_blocks * 512 < 3 * step
        np.testing.assert_array_equal(read_back(tier, [0, last, last + 1], PAGE),
                                      np.concatenate([pages(1, PAGE, seed=s) for s in (31, 32, 33)]))


@pytest.mark.parametrize("o_direct", [True, False])
def test_a_full_disk_fails_the_write_before_it_moves_a_byte(nvme_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            o_direct: bool) -> None:
    """No room to allocate a never-written slot: the write raises TierIOError naming it
    (a failed transfer), no page is half written, the slots written before are intact."""
    with NvmeTier(nvme_path, 8, PAGE, o_direct=o_direct) as tier:
        first = pages(2, PAGE, seed=34)
        tier.write([0, 1], first)
        tier.flush()
        real = os.posix_fallocate
        calls: list[tuple[int, int]] = []

        def full(fd: int, offset: int, length: int) -> None:
            calls.append((offset, length))
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(os, "posix_fallocate", full)
        tier._reserved = 2 * PAGE           # as if the disk had filled right after those two slots
        writes: list[int] = []
        real_pwritev = os.pwritev
        monkeypatch.setattr(os, "pwritev", lambda fd, iov, off: writes.append(off) or real_pwritev(fd, iov, off))
        with pytest.raises(TierIOError, match=r"cannot allocate bytes 16384 to 49152 .* bytes free .*No space left"):
            tier.write([5, 2], pages(2, PAGE, seed=35))
        assert writes == [] and calls[-1] == (2 * PAGE, 4 * PAGE)   # tried the step, then just the write's room
        np.testing.assert_array_equal(read_back(tier, [0, 1], PAGE), first)
        monkeypatch.setattr(os, "posix_fallocate", real)
        tier.write([5, 2], pages(2, PAGE, seed=35))         # room again: the same write lands
        np.testing.assert_array_equal(read_back(tier, [5, 2], PAGE), pages(2, PAGE, seed=35))


@pytest.mark.parametrize("size", [12345, 4 * PAGE + PAGE])
def test_nvme_wrong_size_file_raises(nvme_path: Path, size: int) -> None:
    nvme_path.write_bytes(b"\0" * size)
    with pytest.raises(ConfigError, match=rf"{size} bytes.*{4 * PAGE}"):
        NvmeTier(nvme_path, 4, PAGE, create=False)
    assert nvme_path.stat().st_size == size  # left alone


def test_nvme_longer_file_raises_even_with_create(nvme_path: Path) -> None:
    nvme_path.write_bytes(b"\0" * (5 * PAGE))
    with pytest.raises(ConfigError, match="needs exactly"):
        NvmeTier(nvme_path, 4, PAGE)


def test_nvme_truncated_file_grows_back_keeping_its_head(nvme_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with NvmeTier(nvme_path, 4, PAGE) as tier:
        tier.write([0, 1, 2, 3], pages(4, PAGE, 5))
    os.truncate(nvme_path, 2 * PAGE + 100)
    with caplog.at_level(logging.WARNING), NvmeTier(nvme_path, 4, PAGE) as tier:
        got = read_back(tier, [0, 1, 2, 3], PAGE)
    assert "truncated" in caplog.text
    assert np.array_equal(got[:2], pages(4, PAGE, 5)[:2])
    assert not got[3].any()
    assert nvme_path.stat().st_size == 4 * PAGE


def test_nvme_missing_file_without_create(nvme_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        NvmeTier(nvme_path, 4, PAGE, create=False)
    assert not nvme_path.exists()


@pytest.mark.parametrize("kwargs", [{"page_bytes": 0}, {"num_slots": -1}, {"io_threads": 0}, {"max_io_bytes": 100}])
def test_nvme_bad_arguments(nvme_path: Path, kwargs: dict[str, int]) -> None:
    args = {"num_slots": 4, "page_bytes": PAGE} | kwargs
    with pytest.raises(InputError):
        NvmeTier(nvme_path, **args)


@pytest.mark.parametrize(("io_threads", "max_io_bytes"), [(1, 8 << 20), (3, 8192), (8, 4096)])
def test_nvme_thread_and_syscall_sizes(nvme_path: Path, io_threads: int, max_io_bytes: int) -> None:
    with NvmeTier(nvme_path, 64, PAGE, io_threads=io_threads, max_io_bytes=max_io_bytes) as tier:
        slots = list(range(40)) + [63, 50, 51, 52, 41]
        src = pages(len(slots), PAGE, seed=15)
        tier.write(slots, src)
        np.testing.assert_array_equal(read_back(tier, slots[::-1], PAGE), src[::-1])


def test_nvme_write_zero_fills_the_slot_tail(nvme_path: Path) -> None:
    with NvmeTier(nvme_path, 2, ODD_PAGE) as tier:
        tier.write([0, 1], pages(2, ODD_PAGE, seed=16))  # leaves page bytes in the bounce buffer
        tier.write([1], pages(1, 4096, seed=17))
        assert not read_back(tier, [1], tier.slot_bytes)[0, 4096:].any()


def test_nvme_short_read_raises_tier_io_error(nvme_path: Path) -> None:
    with NvmeTier(nvme_path, 8, PAGE) as tier:
        tier.write(list(range(8)), pages(8, PAGE, seed=18))
        os.truncate(nvme_path, 5 * PAGE)  # the file shrinks behind the tier's back
        with pytest.raises(TierIOError, match=rf"short read at slot 5 \(offset {5 * PAGE}\)"):
            tier.read([4, 5], np.zeros((2, PAGE), dtype=np.uint8))
        with pytest.raises(TierIOError, match="short read"):
            tier.read([6], np.zeros((1, PAGE), dtype=np.uint8))


def test_nvme_os_error_becomes_tier_io_error(nvme_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with NvmeTier(nvme_path, 8, PAGE) as tier:
        def failing(*args: object) -> int:
            raise OSError(errno.EIO, os.strerror(errno.EIO))

        monkeypatch.setattr(os, "pwritev", failing)
        with pytest.raises(TierIOError, match=rf"write of slot 6 .* offset {6 * PAGE}.*Input/output error"):
            tier.write([6], pages(1, PAGE, seed=19))


def test_nvme_flush(nvme_path: Path) -> None:
    tier = NvmeTier(nvme_path, 2, PAGE)
    tier.write([1], pages(1, PAGE, seed=20))
    tier.flush()
    tier.close()
    with pytest.raises(StoreClosedError):
        tier.flush()


def test_nvme_read_into_read_only_buffer(nvme_path: Path) -> None:
    with NvmeTier(nvme_path, 2, PAGE) as tier:
        dst = np.zeros((1, PAGE), dtype=np.uint8)
        dst.flags.writeable = False
        with pytest.raises(InputError, match="read-only"):
            tier.read([0], dst)


def test_nvme_header_precedes_slot_zero(nvme_path: Path) -> None:
    with NvmeTier(nvme_path, 3, PAGE, header_bytes=4096) as tier:
        tier.write([0, 1, 2], pages(3, PAGE, 9))
        tier.write_header(b"label")
        assert tier.read_header()[:6] == b"label\0" and len(tier.read_header()) == 4096
        with pytest.raises(InputError, match="header holds"):
            tier.write_header(b"x" * 4097)
    raw = nvme_path.read_bytes()
    assert len(raw) == 4096 + 3 * PAGE and raw[:5] == b"label"
    assert raw[4096:4096 + PAGE] == pages(3, PAGE, 9)[0].tobytes()
    with pytest.raises(InputError, match="multiple of 4096"):
        NvmeTier(nvme_path, 3, PAGE, header_bytes=100)


ATEXIT_CLOSE = """
import atexit, sys, numpy as np
from tierkv.config import DramConfig, NvmeConfig, StoreConfig
from tierkv.layout import KVLayout
from tierkv.store.api import Store
layout = KVLayout(num_layers=8, num_kv_heads=8, head_dim=128, dtype="bf16", tokens_per_page=16)
cfg = StoreConfig(path=sys.argv[1], model_id="m", layout=layout,
                  dram=DramConfig(128 * layout.page_bytes, prefault=False),
                  nvme=NvmeConfig(128 * layout.page_bytes, codec=sys.argv[2]))
store = Store.open(cfg)
tokens = np.arange(64 * 16, dtype=np.int64)
pages = np.random.default_rng(0).integers(0, 256, (64, layout.page_bytes), dtype=np.uint8)
store.put(tokens, pages)   # in DRAM: written down to NVMe by close()

def at_exit():
    store.close()
    with Store.open(cfg) as again:
        out = np.zeros_like(pages)
        print(again.get(tokens, out).pages, np.array_equal(out, pages))

atexit.register(at_exit)
"""


@pytest.mark.parametrize("codec", ["none", "lossless"])   # lossless: a coded tier's pipelined writes
def test_a_store_closed_at_interpreter_exit_writes_its_pages_down(tmp_path: Path, codec: str) -> None:
    # concurrent.futures takes no more work once the main thread is done: the NVMe tier's
    # write-back then ran on no thread and close() raised RuntimeError, losing the DRAM
    # pages; now the closing thread moves every chunk itself.
    import subprocess
    import sys

    script = tmp_path / "atexit_close.py"
    script.write_text(ATEXIT_CLOSE)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "store"), codec], capture_output=True,
                          text=True, timeout=180, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["64", "True"], done.stdout + done.stderr
