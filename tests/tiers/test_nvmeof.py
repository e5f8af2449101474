"""The NVMe-oF tier's lifecycle on the host: deadlines, degradation, held slots, recovery.

The namespace is a plain file behind a :class:`StaticLink`. Losing it for real (a
removed path) drives the monitor; I/O errors and syscalls that hang are injected by a
hand-written subclass with failure switches, since no fabric can fail on this host.
The rig (tests/rig) runs the same tier against the kernel's NVMe-oF target.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.polling import wait_for
from tierkv.errors import TierIOError, TierUnavailableError
from tierkv.tiers.aligned import aligned_empty, round_up
from tierkv.tiers.nvmeof import NvmeofTier, StaticLink

PAGE = 8192
SLOTS = 16
HEADER = 4096
LABEL = b"tierkv-test-label"


class FlakyTier(NvmeofTier):
    """Syscalls fail (``fail``) or block until ``release`` is set (``hang``)."""

    def __init__(self, *args: object, **kw: object) -> None:
        self.fail = False
        self.hang = False
        self.release = threading.Event()
        self.entered = threading.Event()
        super().__init__(*args, **kw)  # type: ignore[arg-type]

    def _syscall(self, op, fd, chunk, iov):  # type: ignore[no-untyped-def]
        if self.hang:
            self.entered.set()
            self.release.wait(30)
        if self.fail:
            raise TierIOError("injected EIO")
        return super()._syscall(op, fd, chunk, iov)


@pytest.fixture
def dev(tmp_path: Path) -> Path:
    path = tmp_path / "ns1.img"
    with open(path, "wb") as f:
        f.truncate(HEADER + SLOTS * round_up(PAGE))
    return path


@pytest.fixture
def tier(dev: Path) -> Iterator[FlakyTier]:
    t = FlakyTier(StaticLink(dev), SLOTS, PAGE, io_timeout_s=0.5, monitor_interval_s=0.05, header_bytes=HEADER)
    t.write_header(LABEL)
    t.expect_header(LABEL)
    yield t
    t.release.set()
    t.close()


def off_page(n: int) -> np.ndarray:
    """``n`` C-contiguous rows whose first byte is 16 bytes past a page (numpy's offset)."""
    return aligned_empty(n * PAGE + 16)[16:].reshape(n, PAGE)


def lose_and_regain(tier: NvmeofTier, dev: Path, says: str = "") -> None:
    """The namespace's device goes away (the tier degrades, its reason naming ``says``)
    and comes back (the monitor recovers it)."""
    moved = dev.with_suffix(".away")
    os.rename(dev, moved)
    assert wait_for(lambda: not tier.available)
    assert says in str(tier.state()["reason"])
    os.rename(moved, dev)
    assert wait_for(lambda: tier.available)


def pages(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, PAGE), dtype=np.uint8)


def test_io_error_degrades_then_the_monitor_recovers(tier: FlakyTier) -> None:
    src = pages(2)
    slots = tier.allocate(2)
    tier.write(slots, src)
    tier.fail = True
    out = np.zeros_like(src)
    with pytest.raises(TierUnavailableError, match="injected EIO"):
        tier.read(slots, out)
    assert not tier.available and tier.state()["state"] == "degraded"
    # While degraded every call fails at once, with the reason.
    with pytest.raises(TierUnavailableError, match="degraded"):
        tier.read(slots, out)
    assert not out.any()
    tier.fail = False
    assert wait_for(lambda: tier.available)
    tier.read(slots, out)
    assert np.array_equal(out, src)
    assert tier.degradations == 1 and tier.recoveries == 1


def test_a_hung_read_times_out_and_never_touches_the_callers_buffer(tier: FlakyTier) -> None:
    src = pages(3, seed=1)
    slots = tier.allocate(3)
    tier.write(slots, src)
    tier.hang = True
    out = np.full_like(src, 7)
    start = time.monotonic()
    with pytest.raises(TierUnavailableError, match="did not complete within 0.5 s"):
        tier.read(slots, out)
    assert time.monotonic() - start < 3.0
    assert not tier.available
    tier.hang = False
    tier.release.set()  # the stuck syscall now completes, into the tier's private buffer
    assert wait_for(lambda: tier.available)
    assert (out == 7).all()


def test_slots_of_a_timed_out_write_are_not_reused_until_it_returns(tier: FlakyTier) -> None:
    slots = tier.allocate(2)
    tier.hang = True
    with pytest.raises(TierUnavailableError):
        tier.write(slots, pages(2, seed=2))
    assert tier.entered.is_set()
    free_before = tier.num_free
    tier.free(slots)  # the store abandons the write: the slots must stay out of the free list
    assert tier.num_free == free_before
    tier.hang = False
    tier.release.set()
    assert wait_for(lambda: tier.num_free == free_before + 2)


def test_a_lost_device_degrades_and_comes_back(tier: FlakyTier, dev: Path) -> None:
    src = pages(4, seed=3)
    slots = tier.allocate(4)
    tier.write(slots, src)
    tier.flush()
    lose_and_regain(tier, dev, says="gone")
    out = np.zeros_like(src)
    tier.read(slots, out)
    assert np.array_equal(out, src)


def test_a_namespace_with_another_label_keeps_the_tier_degraded(tier: FlakyTier, dev: Path) -> None:
    moved = dev.with_suffix(".away")
    os.rename(dev, moved)
    assert wait_for(lambda: not tier.available)
    with open(dev, "wb") as f:  # a different namespace appears under the same name
        f.write(b"someone-else".ljust(HEADER, b"\0"))
        f.truncate(HEADER + SLOTS * round_up(PAGE))
    time.sleep(0.5)
    assert not tier.available
    os.replace(moved, dev)
    assert wait_for(lambda: tier.available)


def test_close_does_not_hang_on_a_stuck_syscall(tier: FlakyTier) -> None:
    slots = tier.allocate(1)
    tier.hang = True
    with pytest.raises(TierUnavailableError):
        tier.write(slots, pages(1))
    start = time.monotonic()
    tier.close()
    assert time.monotonic() - start < 5.0


def test_a_transfer_stuck_past_close_never_writes_into_another_file(dev: Path, tmp_path: Path) -> None:
    # One slot per syscall, one thread: after the first syscall returns late, the stuck
    # transfer goes on with the next chunks on the same fd number. Closing the tier must
    # not free that number for another open() while the transfer holds it.
    tier = FlakyTier(StaticLink(dev), SLOTS, PAGE, io_timeout_s=0.3, monitor_interval_s=0.05,
                     header_bytes=HEADER, io_threads=1, max_io_bytes=round_up(PAGE))
    slots = tier.allocate(4)
    tier.hang = True
    with pytest.raises(TierUnavailableError):
        tier.write(slots, np.full((4, PAGE), 0xAB, dtype=np.uint8))
    assert tier.entered.wait(5)
    tier.close()
    other = tmp_path / "other.bin"
    other.write_bytes(bytes(4 * round_up(PAGE)))
    fds = [os.open(other, os.O_RDWR) for _ in range(4)]  # likely to reuse a just-freed number
    tier.hang = False
    tier.release.set()
    time.sleep(0.5)  # the stuck transfer finishes its remaining chunks
    for fd in fds:
        os.close(fd)
    assert other.read_bytes() == bytes(4 * round_up(PAGE))


def test_static_link_refuses_a_missing_device(tmp_path: Path) -> None:
    with pytest.raises(TierIOError, match="does not exist"):
        NvmeofTier(StaticLink(tmp_path / "nope"), 1, PAGE)


@pytest.mark.parametrize("first_direct", [False, True])
def test_a_namespace_that_comes_back_in_the_other_io_mode_is_moved_by_its_rules(
        dev: Path, monkeypatch: pytest.MonkeyPatch, first_direct: bool) -> None:
    """The tier first opened the namespace buffered (its O_DIRECT refused) and it comes back
    taking O_DIRECT, or the other way round: the new descriptor's mode is the tier's from
    then on. Otherwise rows a buffered descriptor took in place (16 bytes past a page) would
    go unaligned to an O_DIRECT one and fail with EINVAL."""
    import tierkv.tiers.nvme as nvme_mod
    import tierkv.tiers.nvmeof as nvmeof_mod
    from tierkv.tiers.backing import open_backing

    def opener(direct: bool):  # type: ignore[no-untyped-def]
        return lambda path, size, *, o_direct, create: open_backing(path, size, o_direct=o_direct and direct,
                                                                  create=create)

    monkeypatch.setattr(nvme_mod, "open_backing", opener(first_direct))
    monkeypatch.setattr(nvmeof_mod, "open_backing", opener(not first_direct))
    t = NvmeofTier(StaticLink(dev), SLOTS, PAGE, io_timeout_s=0.5, monitor_interval_s=0.05, header_bytes=HEADER)
    try:
        t.write_header(LABEL)
        t.expect_header(LABEL)
        assert t.direct is first_direct
        src = off_page(4)
        src[...] = pages(4, seed=9)
        slots = t.allocate(4)
        t.write(slots, src)
        t.flush()
        lose_and_regain(t, dev)
        assert t.direct is not first_direct and t.mem_align == (4096 if t.direct else 1)
        with open(f"/proc/self/fdinfo/{t.fileno()}") as f:
            flags = int(f.read().split("flags:")[1].split()[0], 8)
        assert bool(flags & os.O_DIRECT) is t.direct   # the descriptor in use is what the tier thinks
        out = off_page(4)
        t.read(slots, out)
        assert np.array_equal(out, src)
        src[...] = pages(4, seed=10)
        t.write(slots, src)
        t.read(slots, out)
        assert np.array_equal(out, src)
    finally:
        t.close()


def test_a_transfer_decides_what_goes_in_place_by_the_descriptor_it_holds(
        dev: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A namespace first opened buffered comes back taking O_DIRECT just as a write starts
    (after the tier's availability check, before the transfer holds a descriptor): the
    write takes the new descriptor and moves rows 16 bytes past a page by its rules
    (through the bounce buffers), not by the mode the tier had when the call began."""
    import contextlib

    import tierkv.tiers.nvme as nvme_mod
    from tierkv.tiers.backing import open_backing

    def buffered(path, size, *, o_direct, create):  # type: ignore[no-untyped-def]
        return open_backing(path, size, o_direct=False, create=create)

    monkeypatch.setattr(nvme_mod, "open_backing", buffered)
    t = NvmeofTier(StaticLink(dev), SLOTS, PAGE, io_timeout_s=5, monitor_interval_s=3600, header_bytes=HEADER)
    try:
        t.write_header(LABEL)
        t.expect_header(LABEL)
        assert not t.direct
        real = t._busy_mode
        swapped: list[bool] = []

        @contextlib.contextmanager
        def recovering_first():  # type: ignore[no-untyped-def]
            if not swapped:   # the monitor's recovery, between the call's start and its descriptor
                swapped.append(True)
                t._try_recover()   # reattaches with O_DIRECT (the real open_backing in nvmeof)
            with real() as held:
                yield held

        monkeypatch.setattr(t, "_busy_mode", recovering_first)
        src = off_page(3)
        src[...] = pages(3, seed=11)
        slots = t.allocate(3)
        t.write(slots, src)
        assert swapped and t.direct and t.available
        out = off_page(3)
        t.read(slots, out)
        assert np.array_equal(out, src)
    finally:
        t.close()


AT_EXIT = """
import atexit, sys, numpy as np
from tierkv.tiers.nvmeof import NvmeofTier, StaticLink
tier = NvmeofTier(StaticLink(sys.argv[1]), 16, 8192, io_timeout_s=5, header_bytes=4096)
pages = np.random.default_rng(3).integers(0, 256, (4, 8192), dtype=np.uint8)

def at_exit():   # a store's close writing its pages down at exit does this
    tier.write([1, 2, 3, 4], pages)
    out = np.zeros_like(pages)
    tier.read([1, 2, 3, 4], out)
    print("exact", np.array_equal(out, pages), "up", tier.available)
    tier.close()

atexit.register(at_exit)
"""


def test_io_at_interpreter_exit_still_runs_with_its_deadline_guard(dev: Path, tmp_path: Path) -> None:
    # concurrent.futures takes no more work once the main thread is done: the guarded
    # syscalls raised RuntimeError there (a store closed at exit lost its pages).
    import os
    import subprocess
    import sys

    script = tmp_path / "at_exit.py"
    script.write_text(AT_EXIT)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    done = subprocess.run([sys.executable, str(script), str(dev)], capture_output=True, text=True, timeout=120,
                          env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["exact", "True", "up", "True"], done.stdout + done.stderr


def test_a_guard_shut_down_by_close_refuses_work_as_closed(dev: Path) -> None:
    from tierkv.errors import StoreClosedError
    from tierkv.tiers import nvmeof

    t = NvmeofTier(StaticLink(dev), SLOTS, PAGE, io_timeout_s=0.5, header_bytes=HEADER)
    ran: list[int] = []
    assert nvmeof._start(t._guard, lambda: ran.append(1), t._closing).result(5) is None and ran == [1]
    t.close()
    with pytest.raises(StoreClosedError, match="closed"):
        nvmeof._start(t._guard, lambda: ran.append(2), t._closing)
    assert ran == [1]   # nothing ran on a closed tier's behalf
