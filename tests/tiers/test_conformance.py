"""The tier conformance suite: every tier listed in conftest.py passes every test here.

Bit-exact round trips, futures, slot bookkeeping, input checks, use after close, and
copy hygiene (the source is unchanged, untargeted slots are untouched).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future

import numpy as np
import pytest

from tierkv.store.checksum import checksum64
from tierkv.errors import CapacityError, InputError, StoreClosedError
from tierkv.store.pages import PageList
from tierkv.tiers.aligned import aligned_empty
from tierkv.tiers.base import Tier

PAGE = 8192
ODD_PAGE = 370000  # not a multiple of 4096 (360 KiB = 368640 is one), so an NVMe slot is wider
TIMEOUT_S = 60
TierFactory = Callable[[int, int], Tier]  # the ``tier_factory`` fixture: (num_slots, page_bytes) -> tier


def pages(n: int, width: int, seed: int) -> np.ndarray:
    """``n`` rows of ``width`` random bytes."""
    rng = np.random.default_rng(seed)
    return np.frombuffer(rng.bytes(n * width), dtype=np.uint8).reshape(n, width).copy()


def read_back(tier: Tier, slots: list[int], width: int) -> np.ndarray:
    dst = np.full((len(slots), width), 0xA5, dtype=np.uint8)
    tier.read(slots, dst)
    return dst


# -- round trips ----------------------------------------------------------------------
@pytest.mark.parametrize("page_bytes", [4096, PAGE + 1, ODD_PAGE, 2 << 20])
def test_single_slot_round_trip(tier_factory: TierFactory, page_bytes: int) -> None:
    tier = tier_factory(4, page_bytes)
    [slot] = tier.allocate(1)
    src = pages(1, page_bytes, seed=page_bytes)
    tier.write([slot], src)
    np.testing.assert_array_equal(read_back(tier, [slot], page_bytes), src)


@pytest.mark.parametrize(("page_bytes", "num_slots"), [(PAGE, 64), (ODD_PAGE, 24), (1 << 20, 40)])
def test_batch_round_trip(tier_factory: TierFactory, page_bytes: int, num_slots: int) -> None:
    tier = tier_factory(num_slots, page_bytes)
    slots = tier.allocate(num_slots)
    src = pages(num_slots, page_bytes, seed=1)
    tier.write(slots, src)
    np.testing.assert_array_equal(read_back(tier, slots, page_bytes), src)
    half = num_slots // 2  # a batch read back in two differently cut halves
    np.testing.assert_array_equal(read_back(tier, slots[half:], page_bytes), src[half:])
    np.testing.assert_array_equal(read_back(tier, slots[:half], page_bytes), src[:half])


@pytest.mark.parametrize("page_bytes", [PAGE, ODD_PAGE])
def test_non_consecutive_slots(tier_factory: TierFactory, page_bytes: int) -> None:
    tier = tier_factory(32, page_bytes)
    slots = [9, 3, 4, 5, 30, 0, 17, 16]
    src = pages(len(slots), page_bytes, seed=2)
    tier.write(slots, src)
    order = [5, 1, 2, 3, 7, 6, 0, 4]
    np.testing.assert_array_equal(read_back(tier, [slots[i] for i in order], page_bytes), src[order])


def test_random_overwrites_match_a_model(tier_factory: TierFactory) -> None:
    tier = tier_factory(48, PAGE)
    rng = np.random.default_rng(3)
    model: dict[int, np.ndarray] = {}
    for round_ in range(12):
        slots = [int(s) for s in rng.permutation(48)[: int(rng.integers(1, 20))]]
        src = pages(len(slots), PAGE, seed=100 + round_)
        tier.write(slots, src)
        model.update(zip(slots, src))
    known = sorted(model)
    np.testing.assert_array_equal(read_back(tier, known, PAGE), np.stack([model[s] for s in known]))


def test_read_a_prefix_of_each_slot(tier_factory: TierFactory) -> None:
    tier = tier_factory(8, PAGE)
    src = pages(8, PAGE, seed=4)
    tier.write(list(range(8)), src)
    for width in (4096, 1000, 1):
        np.testing.assert_array_equal(read_back(tier, [7, 0, 3], width), src[[7, 0, 3], :width])


def test_empty_batch_is_a_no_op(tier_factory: TierFactory) -> None:
    tier = tier_factory(2, PAGE)
    tier.write([], np.empty((0, PAGE), dtype=np.uint8))
    tier.read([], np.empty((0, PAGE), dtype=np.uint8))


# -- pages handed in separately (a PageList), and checksums from the I/O -------------------------
def separate(src: np.ndarray, aligned: bool) -> PageList:
    """The rows of ``src`` as separate arrays: each on a 4 KiB boundary, or each 8 bytes past one."""
    rows = []
    for row in src:
        base = aligned_empty(src.shape[1] + 4096)
        at = 0 if aligned else 8
        base[at:at + src.shape[1]] = row
        rows.append(base[at:at + src.shape[1]])
    return PageList(rows, src.shape[1])


@pytest.mark.parametrize("aligned", [True, False])
@pytest.mark.parametrize(("page_bytes", "num_slots"), [(PAGE, 24), (ODD_PAGE, 6), (1 << 20, 12)])
def test_write_of_separate_pages_round_trips(tier_factory: TierFactory, page_bytes: int, num_slots: int, aligned: bool) -> None:
    tier = tier_factory(num_slots, page_bytes)
    slots = [s for s in reversed(range(num_slots)) if s != 2]  # out of order, with a gap
    src = pages(len(slots), page_bytes, seed=page_bytes + aligned)
    rows = separate(src, aligned)
    tier.write(slots, rows)
    np.testing.assert_array_equal(read_back(tier, slots, page_bytes), src)
    np.testing.assert_array_equal(np.stack(list(rows)), src)  # the caller's pages are unchanged
    again = pages(3, page_bytes, seed=99)   # and a later batch write lands over them as usual
    tier.write(slots[:3], again)
    np.testing.assert_array_equal(read_back(tier, slots[:3], page_bytes), again)
    np.testing.assert_array_equal(read_back(tier, slots[3:], page_bytes), src[3:])


def test_write_of_separate_pages_checks_them(tier_factory: TierFactory) -> None:
    tier = tier_factory(4, PAGE)
    two = PageList([np.zeros(PAGE, np.uint8), np.zeros(PAGE, np.uint8)], PAGE)
    with pytest.raises(InputError, match="3 slots but 2 pages"):
        tier.write([0, 1, 2], two)
    with pytest.raises(InputError, match="out of range"):
        tier.write([0, 4], two)
    with pytest.raises(InputError, match="exceed the slot size"):
        tier.write([0], PageList([np.zeros(tier.slot_bytes + 1, np.uint8)], tier.slot_bytes + 1))
    for bad in (np.zeros(PAGE + 4096, np.uint8), np.zeros(PAGE // 4, np.float32), np.zeros(2 * PAGE, np.uint8)[::2],
                bytearray(PAGE)):  # the list's pages are checked one by one, not only its declared width
        with pytest.raises(InputError, match="page 1 of the list must be a C-contiguous uint8 array"):
            tier.write([0, 1], PageList([np.zeros(PAGE, np.uint8), bad], PAGE))  # type: ignore[list-item]
    tier.write([], PageList([], PAGE))
    tier.close()
    with pytest.raises(StoreClosedError):
        tier.write([0, 1], two)


@pytest.mark.parametrize(("page_bytes", "num_slots"), [(PAGE, 40), (ODD_PAGE, 9), (1 << 20, 24)])
def test_read_with_checksums_hashes_what_it_read(tier_factory: TierFactory, page_bytes: int, num_slots: int) -> None:
    tier = tier_factory(num_slots, page_bytes)
    slots = [s for s in reversed(range(num_slots)) if s % 5 != 3]  # several runs: several chunks
    src = pages(len(slots), page_bytes, seed=page_bytes + 1)
    tier.write(slots, src)
    for width in (page_bytes, 4096, 1):
        dst = np.full((len(slots), width), 0xA5, dtype=np.uint8)
        sums = tier.read(slots, dst, checksums=True)
        np.testing.assert_array_equal(dst, src[:, :width])
        assert sums == [checksum64(row) for row in src[:, :width]]
    ro = np.zeros((1, page_bytes), dtype=np.uint8)
    ro.flags.writeable = False
    with pytest.raises(InputError, match="read-only"):
        tier.read(slots[:1], ro, checksums=True)
    assert tier.read([], np.empty((0, page_bytes), dtype=np.uint8), checksums=True) == []
    assert tier.read(slots, np.empty((len(slots), 0), dtype=np.uint8), checksums=True) == [checksum64(b"")] * len(slots)


@pytest.mark.parametrize("as_list", [False, True])
@pytest.mark.parametrize(("page_bytes", "num_slots"), [(PAGE, 40), (ODD_PAGE, 9), (1 << 20, 24)])
def test_write_with_checksums_hashes_what_it_wrote(tier_factory: TierFactory, page_bytes: int, num_slots: int,
                                                as_list: bool) -> None:
    tier = tier_factory(num_slots, page_bytes)
    slots = [s for s in reversed(range(num_slots)) if s % 5 != 3]
    src = pages(len(slots), page_bytes, seed=page_bytes + 2)
    given = separate(src, aligned=False) if as_list else src
    assert tier.write(slots, given, checksums=True) == [checksum64(row) for row in src]
    np.testing.assert_array_equal(read_back(tier, slots, page_bytes), src)
    with pytest.raises(InputError, match="3 slots but"):
        tier.write(slots[:3], separate(src[:2], True) if as_list else src[:2], checksums=True)
    assert tier.write([], PageList([], page_bytes) if as_list else src[:0], checksums=True) == []


# -- futures ----------------------------------------------------------------------------
def test_async_variants_return_futures(tier_factory: TierFactory) -> None:
    tier = tier_factory(16, ODD_PAGE)
    slots = tier.allocate(16)
    src = pages(16, ODD_PAGE, seed=5)
    put = tier.write_async(slots, src)
    assert isinstance(put, Future)
    assert put.result(timeout=TIMEOUT_S) is None
    assert put.done()
    dst = np.zeros_like(src)
    get = tier.read_async(slots, dst)
    assert get.result(timeout=TIMEOUT_S) is None
    assert get.done()
    np.testing.assert_array_equal(dst, src)


def test_many_async_transfers_in_flight(tier_factory: TierFactory) -> None:
    # More requests than any pool has threads, each big enough to fan out: a pool
    # that waits on itself would time out here instead of passing.
    batches, per, width = 16, 4, 256 << 10
    tier = tier_factory(batches * per, width)
    src = pages(batches * per, width, seed=6)
    puts = [tier.write_async(list(range(b * per, (b + 1) * per)), src[b * per:(b + 1) * per])
            for b in range(batches)]
    for f in puts:
        f.result(timeout=TIMEOUT_S)
    dst = np.zeros_like(src)
    gets = [tier.read_async(list(range(b * per, (b + 1) * per)), dst[b * per:(b + 1) * per])
            for b in range(batches)]
    for f in gets:
        f.result(timeout=TIMEOUT_S)
    np.testing.assert_array_equal(dst, src)


# -- slot bookkeeping ---------------------------------------------------------------------
def test_allocate_until_full(tier_factory: TierFactory) -> None:
    tier = tier_factory(8, PAGE)
    with pytest.raises(CapacityError, match="9"):
        tier.allocate(9)
    assert tier.allocate(5) == [0, 1, 2, 3, 4]
    assert tier.allocate(3) == [5, 6, 7]
    assert tier.num_free == 0
    with pytest.raises(CapacityError):
        tier.allocate(1)
    tier.free([6, 2])
    assert tier.allocate(2) == [2, 6]


def test_free_and_claim_errors(tier_factory: TierFactory) -> None:
    tier = tier_factory(8, PAGE)
    slots = tier.allocate(2)
    tier.free(slots)
    with pytest.raises(InputError, match="freed twice"):
        tier.free([slots[0]])
    with pytest.raises(InputError, match="out of range"):
        tier.free([8])
    tier.claim([3, 5])
    with pytest.raises(InputError, match="claimed twice"):
        tier.claim([5])
    with pytest.raises(InputError, match="out of range"):
        tier.claim([-1])
    assert tier.allocate(4) == [0, 1, 2, 4]


# -- input checks -------------------------------------------------------------------------
BadCase = Callable[[Tier], tuple[list[int], object]]
BAD_BUFFERS: dict[str, BadCase] = {
    "float32": lambda t: ([0, 1], np.zeros((2, PAGE // 4), dtype=np.float32)),
    "1-d": lambda t: ([0, 1], np.zeros(2 * PAGE, dtype=np.uint8)),
    "3-d": lambda t: ([0, 1], np.zeros((2, 2, PAGE // 2), dtype=np.uint8)),
    "strided": lambda t: ([0, 1], np.zeros((2, 2 * PAGE), dtype=np.uint8)[:, ::2]),
    "fortran": lambda t: ([0, 1], np.asfortranarray(np.zeros((2, PAGE), dtype=np.uint8))),
    "too-wide": lambda t: ([0, 1], np.zeros((2, t.slot_bytes + 1), dtype=np.uint8)),
    "rows-vs-slots": lambda t: ([0, 1], np.zeros((3, PAGE), dtype=np.uint8)),
    "slot-too-big": lambda t: ([0, t.num_slots], np.zeros((2, PAGE), dtype=np.uint8)),
    "slot-negative": lambda t: ([-1, 0], np.zeros((2, PAGE), dtype=np.uint8)),
    "not-an-array": lambda t: ([0, 1], bytearray(2 * PAGE)),
}


@pytest.mark.parametrize("op", ["write", "read", "write_async", "read_async"])
@pytest.mark.parametrize("case", list(BAD_BUFFERS))
def test_bad_buffers_raise_input_error(tier_factory: TierFactory, case: str, op: str) -> None:
    tier = tier_factory(4, PAGE)
    slots, buf = BAD_BUFFERS[case](tier)
    with pytest.raises(InputError):
        getattr(tier, op)(slots, buf)


# -- lifecycle ------------------------------------------------------------------------------
def test_use_after_close(tier_factory: TierFactory) -> None:
    tier = tier_factory(4, PAGE)
    buf = pages(1, PAGE, seed=7)
    tier.write([0], buf)
    tier.close()
    tier.close()  # idempotent
    calls: list[Callable[[], object]] = [
        lambda: tier.write([0], buf), lambda: tier.read([0], buf),
        lambda: tier.write_async([0], buf), lambda: tier.read_async([0], buf),
        lambda: tier.allocate(1), lambda: tier.free([0]), lambda: tier.claim([1]),
    ]
    for call in calls:
        with pytest.raises(StoreClosedError):
            call()


def test_context_manager_closes(tier_factory: TierFactory) -> None:
    with tier_factory(2, PAGE) as tier:
        tier.allocate(1)
    with pytest.raises(StoreClosedError):
        tier.allocate(1)


# -- copy hygiene -------------------------------------------------------------------------------
@pytest.mark.parametrize("page_bytes", [PAGE, ODD_PAGE])
def test_untargeted_slots_untouched(tier_factory: TierFactory, page_bytes: int) -> None:
    tier = tier_factory(12, page_bytes)
    everything = list(range(12))
    before = pages(12, page_bytes, seed=8)
    tier.write(everything, before)
    targets = [1, 2, 3, 7, 10]
    new = pages(len(targets), page_bytes, seed=9)
    tier.write(targets, new)
    expected = before.copy()
    expected[targets] = new
    np.testing.assert_array_equal(read_back(tier, everything, page_bytes), expected)


@pytest.mark.parametrize("op", ["write", "write_async"])
def test_source_unchanged_by_write(tier_factory: TierFactory, op: str) -> None:
    tier = tier_factory(8, ODD_PAGE)
    src = pages(8, ODD_PAGE, seed=10)
    kept = src.copy()
    result = getattr(tier, op)([7, 6, 0, 1, 2, 3, 4, 5], src)
    if isinstance(result, Future):
        result.result(timeout=TIMEOUT_S)
    np.testing.assert_array_equal(src, kept)


