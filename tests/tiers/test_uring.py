"""The NVMe tier's io_uring read path: the ring itself (short reads, errors, close with reads
in flight), the tier's reads through it (checksums, short files, failures mid-batch), and
the fallback to the thread pool where io_uring is off or missing."""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tierkv.errors import InputError, TierIOError
from tierkv.store.checksum import checksum64
from tierkv.tiers import uring
from tierkv.tiers.aligned import aligned_empty
from tierkv.tiers.nvme import NvmeTier
from tests.tiers import test_conformance as conformance

PAGE = 64 << 10
ODD_PAGE = 70000  # a slot of 73728 bytes: every read has a tail into the sink

needs_uring = pytest.mark.skipif(not uring.available(), reason="io_uring is not available here")


def pages(n: int, width: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, width), dtype=np.uint8)


def unaligned(n: int, width: int) -> np.ndarray:
    """Rows starting 64 bytes past a page, as numpy and torch CPU tensors do."""
    return aligned_empty(n * width + 64)[64:].reshape(n, width)


@pytest.fixture
def data_file(tmp_path: Path) -> Path:
    path = tmp_path / "data.bin"
    path.write_bytes(bytes(range(256)) * 64)  # 16 KiB
    return path


# -- the whole tier conformance suite, reading through the ring ---------------------------------
for _name in dir(conformance):
    if _name.startswith("test_"):
        globals()[f"{_name}_via_io_uring"] = getattr(conformance, _name)


@pytest.fixture(params=["odirect", "buffered"])
def tier_factory(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[conformance.TierFactory]:
    """The suite's ``tier_factory``, for NVMe tiers that read through io_uring."""
    if not uring.available():
        pytest.skip("io_uring is not available here")
    if request.param == "buffered" and not os.path.isdir("/dev/shm"):
        pytest.skip("/dev/shm is absent")
    built: list[NvmeTier] = []
    where = tmp_path if request.param == "odirect" else Path(tempfile.mkdtemp(prefix="tierkv-test-", dir="/dev/shm"))

    def make(num_slots: int, page_bytes: int) -> NvmeTier:
        tier = NvmeTier(where / f"tier{len(built)}.dat", num_slots, page_bytes, o_direct=request.param == "odirect",
                        io_uring=True, read_depth=4)
        assert tier.io_engine == "io_uring"
        built.append(tier)
        return tier

    yield make
    for tier in built:
        tier.close()
    if where != tmp_path:
        shutil.rmtree(where, ignore_errors=True)


# -- the ring ---------------------------------------------------------------------
@needs_uring
def test_ring_reads_vectors_and_reports_each_read(data_file: Path) -> None:
    ring = uring._new_ring(4)
    fd = os.open(data_file, os.O_RDONLY)
    try:
        a, b, c = bytearray(100), bytearray(4000), bytearray(4096)
        ring.readv(fd, 0, [memoryview(a), memoryview(b)], 7)
        ring.readv(fd, 8192, [memoryview(c)], 8)
        assert ring.inflight == 2
        done = dict(ring.wait(2))
        assert done == {7: 4100, 8: 4096} and ring.inflight == 0
        want = data_file.read_bytes()
        assert bytes(a + b) == want[:4100] and bytes(c) == want[8192:12288]
        assert ring.wait(1) == []  # nothing in flight: returns at once
    finally:
        ring.close()
        os.close(fd)


@needs_uring
def test_ring_read_past_the_end_comes_back_short(data_file: Path) -> None:
    ring = uring._new_ring(2)
    fd = os.open(data_file, os.O_RDONLY)
    try:
        buf = bytearray(8192)
        # A buffered read over the end: the first pass returns 4096 bytes, the ring asks for
        # the rest, gets 0 (end of file) and reports what it has.
        ring.readv(fd, 12288, [memoryview(buf)[:4000], memoryview(buf)[4000:]], 1)
        assert ring.wait(1) == [(1, 4096)]
        assert bytes(buf[:4096]) == data_file.read_bytes()[12288:]
    finally:
        ring.close()
        os.close(fd)


@needs_uring
def test_ring_errors_come_back_as_negative_errno(data_file: Path) -> None:
    ring = uring._new_ring(2)
    fd = os.open(data_file, os.O_WRONLY)  # reading a write-only descriptor fails: EBADF
    try:
        ring.readv(fd, 0, [memoryview(bytearray(4096))], 3)
        assert ring.wait(1) == [(3, -9)]
    finally:
        ring.close()
        os.close(fd)


@needs_uring
def test_ring_refuses_what_it_cannot_hold(data_file: Path) -> None:
    ring = uring._new_ring(1)
    fd = os.open(data_file, os.O_RDONLY)
    try:
        with pytest.raises(BufferError):
            ring.readv(fd, 0, [memoryview(b"read-only")], 0)
        with pytest.raises(ValueError):
            ring.readv(fd, 0, [], 0)
        ring.readv(fd, 0, [memoryview(bytearray(16))], 0)
        with pytest.raises(RuntimeError, match="full"):
            ring.readv(fd, 0, [memoryview(bytearray(16))], 1)
        assert ring.inflight == 1
        ring.close()  # waits for the read in flight
        assert ring.inflight == 0
        with pytest.raises(ValueError, match="closed"):
            ring.submit()
    finally:
        ring.close()
        os.close(fd)


@needs_uring
def test_ring_pool_reuses_rings_and_closes_one_after_an_error() -> None:
    pool = uring.RingPool(4)
    with pool.borrow() as first:
        pass
    with pool.borrow() as again:
        assert again is first
    with pytest.raises(KeyError), pool.borrow() as failed:
        raise KeyError
    with pytest.raises(ValueError, match="closed"):
        failed.submit()
    pool.close()
    with pool.borrow() as late:  # a ring lent after close is closed when it comes back
        pass
    with pytest.raises(ValueError, match="closed"):
        late.submit()


# -- the tier through the ring ----------------------------------------------------------
@needs_uring
@pytest.mark.parametrize("page_bytes", [PAGE, ODD_PAGE, 2 << 20])
@pytest.mark.parametrize("layout", ["aligned", "unaligned"])
def test_tier_reads_through_the_ring_with_checksums(tmp_path: Path, page_bytes: int, layout: str) -> None:
    n = 24
    with NvmeTier(tmp_path / "t.dat", n, page_bytes, io_uring=True, read_depth=4, max_io_bytes=256 << 10) as tier:
        assert tier.io_engine == "io_uring" and tier.direct
        src = pages(n, page_bytes, seed=page_bytes)
        order = list(np.random.default_rng(1).permutation(n))  # runs of consecutive slots and single ones
        order[5:12] = sorted(order[5:12])
        tier.write(order, src)
        dst = aligned_empty(n * page_bytes).reshape(n, page_bytes) if layout == "aligned" else unaligned(n, page_bytes)
        sums = tier.read(order, dst, checksums=True)
        np.testing.assert_array_equal(dst, src)
        assert sums == [checksum64(row) for row in src]


@needs_uring
def test_a_truncated_file_fails_the_read_after_every_chunk_returned(tmp_path: Path) -> None:
    path = tmp_path / "t.dat"
    with NvmeTier(path, 16, PAGE, io_uring=True, read_depth=4) as tier:
        src = pages(16, PAGE, seed=3)
        tier.write(list(range(16)), src)
        tier.flush()
        os.truncate(path, 10 * PAGE + 4096)  # slot 10 is cut short, 11.. are gone
        dst = np.zeros((16, PAGE), np.uint8)
        # Whichever chunk lands first, the error names the first slot that came up short.
        with pytest.raises(TierIOError, match=r"short read at slot 10 \(offset 659456\): 135168 of 262144 "):
            tier.read(list(range(16)), dst, checksums=True)
        rings = tier._rings
        assert rings is not None and all(r.inflight == 0 for r in rings._idle)
        # The slots before the cut still read back, through the same ring.
        assert tier.read(list(range(4)), dst[:4], checksums=True) == [checksum64(r) for r in src[:4]]
        np.testing.assert_array_equal(dst[:4], src[:4])


@needs_uring
def test_a_failing_read_becomes_a_tier_io_error(tmp_path: Path) -> None:
    with NvmeTier(tmp_path / "t.dat", 4, PAGE, io_uring=True) as tier:
        assert tier.io_engine == "io_uring"
        tier.write([0, 1], pages(2, PAGE, seed=4))
        # A descriptor the kernel cannot read from, as a dying device answers EIO.
        write_only = os.open(tier.path, os.O_WRONLY)
        real, tier._fd = tier._fd, write_only
        try:
            with pytest.raises(TierIOError, match=r"read of slot 0 .*\[Errno 9\]"):
                tier.read([0, 1], np.zeros((2, PAGE), np.uint8))
        finally:
            tier._fd = real
            os.close(write_only)


@needs_uring
def test_concurrent_reads_each_get_a_ring(tmp_path: Path) -> None:
    n = 64
    with NvmeTier(tmp_path / "t.dat", n, PAGE, io_uring=True, read_depth=2) as tier:
        src = pages(n, PAGE, seed=5)
        tier.write(list(range(n)), src)
        failures: list[BaseException] = []

        def reader(k: int) -> None:
            try:
                for _ in range(20):
                    dst = unaligned(8, PAGE)
                    tier.read(list(range(8 * k, 8 * k + 8)), dst)
                    np.testing.assert_array_equal(dst, src[8 * k:8 * k + 8])
            except BaseException as e:  # noqa: BLE001 - reported below
                failures.append(e)

        threads = [threading.Thread(target=reader, args=(k,)) for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not failures
        assert tier._rings is not None and 1 <= len(tier._rings._idle) <= 8


# -- the fallback ------------------------------------------------------------------------
def _round_trip(tier: NvmeTier) -> None:
    src = pages(6, PAGE, seed=6)
    tier.write(list(range(6)), src)
    dst = unaligned(6, PAGE)
    assert tier.read([5, 0, 1, 2, 4, 3], dst, checksums=True) == [checksum64(src[i]) for i in (5, 0, 1, 2, 4, 3)]
    np.testing.assert_array_equal(dst, src[[5, 0, 1, 2, 4, 3]])


def test_io_uring_false_reads_with_the_pool(tmp_path: Path) -> None:
    with NvmeTier(tmp_path / "t.dat", 8, PAGE, io_uring=False) as tier:
        assert tier.io_engine == "threads"
        _round_trip(tier)


def _switch(monkeypatch: pytest.MonkeyPatch, env: str | None, engine: str) -> None:
    """TIERKV_IO_URING set to ``env`` (None: unset); skips where ``engine`` is io_uring and
    this kernel has none."""
    if env is None:
        monkeypatch.delenv(uring.ENV_SWITCH, raising=False)
    else:
        monkeypatch.setenv(uring.ENV_SWITCH, env)
    if engine == "io_uring" and not uring.available():
        pytest.skip("io_uring is not available here")


@pytest.mark.parametrize(("env", "engine"), [(None, "threads"), ("0", "threads"), ("1", "io_uring")])
def test_by_default_the_environment_chooses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, env: str | None,
                                            engine: str) -> None:
    _switch(monkeypatch, env, engine)
    with NvmeTier(tmp_path / "t.dat", 8, PAGE) as tier:
        assert tier.io_engine == engine
        _round_trip(tier)


def test_the_environment_switch_turns_io_uring_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(uring.ENV_SWITCH, "0")
    with NvmeTier(tmp_path / "t.dat", 8, PAGE, io_uring=True) as tier:
        assert tier.io_engine == "threads"
        _round_trip(tier)


@pytest.mark.parametrize("why", [ImportError("no module named tierkv.tiers._uring"),
                                 OSError(1, "Operation not permitted")])
def test_without_io_uring_the_tier_reads_with_the_pool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       why: Exception) -> None:
    def refused(entries: int) -> uring.Ring:
        raise why

    monkeypatch.setattr(uring, "_new_ring", refused)
    uring._probe.cache_clear()
    try:
        assert not uring.available()
        with NvmeTier(tmp_path / "t.dat", 8, PAGE, io_uring=True) as tier:
            assert tier.io_engine == "threads"
            _round_trip(tier)
    finally:
        uring._probe.cache_clear()


def test_read_depth_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="read_depth"):
        NvmeTier(tmp_path / "t.dat", 8, PAGE, read_depth=0)


@pytest.mark.parametrize(("setting", "env", "engine"), [(True, None, "io_uring"), (False, "1", "threads"),
                                                        (None, "1", "io_uring"), (None, None, "threads")])
@pytest.mark.parametrize("codec", ["none", "lossless"])
def test_the_store_config_chooses_over_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       setting: bool | None, env: str | None, engine: str,
                                                       codec: str) -> None:
    from tierkv.config import config_from_dict
    from tierkv.store.api import Store
    from tierkv.tiers.blocks import BlockPageTier

    _switch(monkeypatch, env, engine)
    nvme: dict[str, object] = {"capacity_bytes": "4MiB", "codec": codec}
    if setting is not None:
        nvme["io_uring"] = setting
    cfg = config_from_dict({"store": {"path": str(tmp_path / "s"), "model_id": "m"},
                            "layout": {"num_layers": 2, "num_kv_heads": 2, "head_dim": 64, "tokens_per_page": 16},
                            "tiers": {"nvme": nvme}})
    with Store.open(cfg) as store:
        tier = store._manager.tiers[0]
        medium = tier.blocks if isinstance(tier, BlockPageTier) else tier
        assert isinstance(medium, NvmeTier) and medium.io_engine == engine
        tokens = np.arange(64, dtype=np.int64)
        rows = pages(4, cfg.layout.page_bytes, 5)
        store.put(tokens, rows)
        out = np.zeros_like(rows)
        assert store.get(tokens, out).pages == 4 and np.array_equal(out, rows)


@pytest.mark.parametrize("bad", ["yes", 1, 0, "true"])
def test_io_uring_in_the_config_is_a_boolean(bad: object) -> None:
    from tierkv.config import NvmeConfig
    from tierkv.errors import ConfigError

    with pytest.raises(ConfigError, match=r"nvme.io_uring must be true or false"):
        NvmeConfig(1 << 20, io_uring=bad)  # type: ignore[arg-type]
