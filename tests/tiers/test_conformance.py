"""The tier conformance suite: every tier listed in conftest.py passes every test here.

Bit-exact round trips, concurrent transfers, handle bookkeeping, input checks, use after
close, and copy hygiene (the source is unchanged, untargeted pages are untouched).
Pages are addressed only by the handles ``allocate`` (or a claim) returned: slot
numbers on a slot-addressed tier, opaque numbers on a block-addressed one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from tierkv.errors import CapacityError, InputError, StoreClosedError
from tierkv.store.checksum import checksum64
from tierkv.store.pages import PageList
from tierkv.tiers.aligned import aligned_empty
from tierkv.tiers.base import Extents, Tier

PAGE = 8192
ODD_PAGE = 370000  # not a multiple of 4096 (360 KiB = 368640 is one), so an NVMe slot is wider
TIMEOUT_S = 60
TierFactory = Callable[[int, int], Tier]  # the ``tier_factory`` fixture: (num_slots, page_bytes) -> tier
Place = int | Extents  # where a persistent page lies: its slot, or its blocks on a block-addressed tier


def pages(n: int, width: int, seed: int) -> np.ndarray:
    """``n`` rows of ``width`` random bytes; every third row (from row 1) holds only
    values 0..3, so a tier that codes pages stores those coded and the others raw."""
    rng = np.random.default_rng(seed)
    rows = np.frombuffer(rng.bytes(n * width), dtype=np.uint8).reshape(n, width).copy()
    rows[1::3] &= 3
    return rows


def read_back(tier: Tier, handles: Sequence[int], width: int) -> np.ndarray:
    dst = np.full((len(handles), width), 0xA5, dtype=np.uint8)
    tier.read(handles, dst)
    return dst


def never_allocated(tier: Tier, handles: Sequence[int]) -> int:
    """A handle the tier has not handed out, given every handle it has (out of range on a slot tier)."""
    return max(handles, default=-1) + tier.num_slots + 1


def place_of(tier: Tier, handle: int) -> Place:
    """What an index records for a page, to claim it back at a reopen (the two addressing modes)."""
    if tier.block_addressed:
        extents = tier.extents(handle)
        assert extents
        return extents
    return handle


def claim(tier: Tier, place: Place) -> int:
    """Claim a recorded page as a reopen does; returns its handle."""
    if isinstance(place, tuple):
        return tier.claim_extents(place)
    tier.claim([place])
    return place


# -- round trips ----------------------------------------------------------------------
@pytest.mark.parametrize("page_bytes", [4096, PAGE + 1, ODD_PAGE, 2 << 20])
def test_single_page_round_trip(tier_factory: TierFactory, page_bytes: int) -> None:
    tier = tier_factory(4, page_bytes)
    handles = tier.allocate(1)
    src = pages(1, page_bytes, seed=page_bytes)
    tier.write(handles, src)
    np.testing.assert_array_equal(read_back(tier, handles, page_bytes), src)


@pytest.mark.parametrize(("page_bytes", "num_slots"), [(PAGE, 64), (ODD_PAGE, 24), (1 << 20, 40)])
def test_batch_round_trip(tier_factory: TierFactory, page_bytes: int, num_slots: int) -> None:
    tier = tier_factory(num_slots, page_bytes)
    handles = tier.allocate(num_slots)
    assert len(set(handles)) == num_slots
    src = pages(num_slots, page_bytes, seed=1)
    tier.write(handles, src)
    np.testing.assert_array_equal(read_back(tier, handles, page_bytes), src)
    half = num_slots // 2  # a batch read back in two differently cut halves
    np.testing.assert_array_equal(read_back(tier, handles[half:], page_bytes), src[half:])
    np.testing.assert_array_equal(read_back(tier, handles[:half], page_bytes), src[:half])


@pytest.mark.parametrize("page_bytes", [PAGE, ODD_PAGE])
def test_handles_in_any_order(tier_factory: TierFactory, page_bytes: int) -> None:
    tier = tier_factory(32, page_bytes)
    every = tier.allocate(32)
    handles = [every[i] for i in (9, 3, 4, 5, 30, 0, 17, 16)]
    src = pages(len(handles), page_bytes, seed=2)
    tier.write(handles, src)
    order = [5, 1, 2, 3, 7, 6, 0, 4]
    np.testing.assert_array_equal(read_back(tier, [handles[i] for i in order], page_bytes), src[order])


def test_random_overwrites_match_a_model(tier_factory: TierFactory) -> None:
    tier = tier_factory(48, PAGE)
    every = tier.allocate(48)
    rng = np.random.default_rng(3)
    model: dict[int, np.ndarray] = {}
    for round_ in range(12):
        handles = [every[int(i)] for i in rng.permutation(48)[: int(rng.integers(1, 20))]]
        src = pages(len(handles), PAGE, seed=100 + round_)  # a page may turn from coded to raw and back
        tier.write(handles, src)
        model.update(zip(handles, src))
    known = sorted(model)
    np.testing.assert_array_equal(read_back(tier, known, PAGE), np.stack([model[h] for h in known]))


def test_read_a_prefix_of_each_page(tier_factory: TierFactory) -> None:
    tier = tier_factory(8, PAGE)
    handles = tier.allocate(8)
    src = pages(8, PAGE, seed=4)
    tier.write(handles, src)
    for width in (4096, 1000, 1):
        picked = [handles[i] for i in (7, 1, 0, 3, 4)]
        np.testing.assert_array_equal(read_back(tier, picked, width), src[[7, 1, 0, 3, 4], :width])


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
def test_write_of_separate_pages_round_trips(tier_factory: TierFactory, page_bytes: int, num_slots: int,
                                             aligned: bool) -> None:
    tier = tier_factory(num_slots, page_bytes)
    every = tier.allocate(num_slots)
    handles = [every[i] for i in reversed(range(num_slots)) if i != 2]  # out of order, with a gap
    src = pages(len(handles), page_bytes, seed=page_bytes + aligned)
    rows = separate(src, aligned)
    tier.write(handles, rows)
    np.testing.assert_array_equal(read_back(tier, handles, page_bytes), src)
    np.testing.assert_array_equal(np.stack(list(rows)), src)  # the caller's pages are unchanged
    again = pages(3, page_bytes, seed=99)   # and a later batch write lands over them as usual
    tier.write(handles[:3], again)
    np.testing.assert_array_equal(read_back(tier, handles[:3], page_bytes), again)
    np.testing.assert_array_equal(read_back(tier, handles[3:], page_bytes), src[3:])


def test_write_of_separate_pages_checks_them(tier_factory: TierFactory) -> None:
    tier = tier_factory(4, PAGE)
    handles = tier.allocate(3)
    two = PageList([np.zeros(PAGE, np.uint8), np.zeros(PAGE, np.uint8)], PAGE)
    with pytest.raises(InputError, match="3 slots but 2 pages"):
        tier.write(handles, two)
    with pytest.raises(InputError):
        tier.write([handles[0], never_allocated(tier, handles)], two)
    with pytest.raises(InputError, match="exceed the slot size"):
        tier.write(handles[:1], PageList([np.zeros(tier.slot_bytes + 1, np.uint8)], tier.slot_bytes + 1))
    for bad in (np.zeros(PAGE + 4096, np.uint8), np.zeros(PAGE // 4, np.float32), np.zeros(2 * PAGE, np.uint8)[::2],
                bytearray(PAGE)):  # the list's pages are checked one by one, not only its declared width
        with pytest.raises(InputError, match="page 1 of the list must be a C-contiguous uint8 array"):
            tier.write(handles[:2], PageList([np.zeros(PAGE, np.uint8), bad], PAGE))  # type: ignore[list-item]
    tier.write([], PageList([], PAGE))
    tier.close()
    with pytest.raises(StoreClosedError):
        tier.write(handles[:2], two)


def test_rows_of_a_tiers_own_buffer_are_marked_checked_and_stay_so() -> None:
    """A demotion writes views of the DRAM tier's buffer: known good rows, not checked one by one."""
    from tierkv.store.transfer import direct_copy
    from tierkv.tiers.dram import DramTier

    src, dst = DramTier(4, PAGE), DramTier(4, PAGE)
    data = pages(2, PAGE, seed=3)
    src.write([0, 1], data)
    rows, _ = direct_copy(src, [1, 0], dst, [2, 3], PAGE)
    assert isinstance(rows, PageList) and rows.checked and rows[1:].checked and rows.take([1]).checked
    np.testing.assert_array_equal(read_back(dst, [2, 3], PAGE), data[::-1])
    assert not PageList([np.zeros(PAGE, np.uint8)], PAGE).checked   # a caller's rows are checked


@pytest.mark.parametrize(("page_bytes", "num_slots"), [(PAGE, 40), (ODD_PAGE, 9), (1 << 20, 24)])
def test_read_with_checksums_hashes_what_it_read(tier_factory: TierFactory, page_bytes: int, num_slots: int) -> None:
    tier = tier_factory(num_slots, page_bytes)
    every = tier.allocate(num_slots)
    handles = [every[i] for i in reversed(range(num_slots)) if i % 5 != 3]  # several runs: several chunks
    src = pages(len(handles), page_bytes, seed=page_bytes + 1)
    tier.write(handles, src)
    for width in (page_bytes, 4096, 1):
        dst = np.full((len(handles), width), 0xA5, dtype=np.uint8)
        sums = tier.read(handles, dst, checksums=True)
        np.testing.assert_array_equal(dst, src[:, :width])
        assert sums == [checksum64(row) for row in src[:, :width]]
    ro = np.zeros((1, page_bytes), dtype=np.uint8)
    ro.flags.writeable = False
    with pytest.raises(InputError, match="read-only"):
        tier.read(handles[:1], ro, checksums=True)
    assert tier.read([], np.empty((0, page_bytes), dtype=np.uint8), checksums=True) == []
    assert tier.read(handles, np.empty((len(handles), 0), dtype=np.uint8),
                     checksums=True) == [checksum64(b"")] * len(handles)


@pytest.mark.parametrize("as_list", [False, True])
@pytest.mark.parametrize(("page_bytes", "num_slots"), [(PAGE, 40), (ODD_PAGE, 9), (1 << 20, 24)])
def test_write_with_checksums_hashes_what_it_wrote(tier_factory: TierFactory, page_bytes: int, num_slots: int,
                                                   as_list: bool) -> None:
    tier = tier_factory(num_slots, page_bytes)
    every = tier.allocate(num_slots)
    handles = [every[i] for i in reversed(range(num_slots)) if i % 5 != 3]
    src = pages(len(handles), page_bytes, seed=page_bytes + 2)
    given = separate(src, aligned=False) if as_list else src
    assert tier.write(handles, given, checksums=True) == [checksum64(row) for row in src]
    np.testing.assert_array_equal(read_back(tier, handles, page_bytes), src)
    with pytest.raises(InputError, match="3 slots but"):
        tier.write(handles[:3], separate(src[:2], True) if as_list else src[:2], checksums=True)
    assert tier.write([], PageList([], page_bytes) if as_list else src[:0], checksums=True) == []


# -- concurrency ----------------------------------------------------------------------------
def test_concurrent_transfers_on_disjoint_pages(tier_factory: TierFactory) -> None:
    # More callers than any tier has I/O threads, each batch big enough to fan out: a
    # tier whose transfers wait on each other's threads would time out here.
    batches, per, width = 16, 4, 256 << 10
    tier = tier_factory(batches * per, width)
    handles = tier.allocate(batches * per)
    src = pages(batches * per, width, seed=6)
    parts = [(handles[b * per:(b + 1) * per], slice(b * per, (b + 1) * per)) for b in range(batches)]
    dst = np.zeros_like(src)
    with ThreadPoolExecutor(max_workers=batches) as callers:
        for f in [callers.submit(tier.write, hs, src[rows]) for hs, rows in parts]:
            f.result(timeout=TIMEOUT_S)
        for f in [callers.submit(tier.read, hs, dst[rows]) for hs, rows in parts]:
            f.result(timeout=TIMEOUT_S)
    np.testing.assert_array_equal(dst, src)


# -- handle bookkeeping ---------------------------------------------------------------------
def test_allocate_until_full(tier_factory: TierFactory) -> None:
    tier = tier_factory(8, PAGE)
    assert tier.num_free == 8
    with pytest.raises(CapacityError, match="9"):
        tier.allocate(9)
    first = tier.allocate(5)
    rest = tier.allocate(3)
    assert len(set(first + rest)) == 8
    assert tier.num_free == 0
    with pytest.raises(CapacityError):
        tier.allocate(1)
    tier.free([rest[1], first[2]])
    assert tier.num_free == 2
    again = tier.allocate(2)
    assert len(set(again)) == 2 and not set(again) & set(first + rest) - {rest[1], first[2]}
    assert tier.num_free == 0
    src = pages(2, PAGE, seed=20)   # the handles handed out again hold pages as any others
    tier.write(again, src)
    np.testing.assert_array_equal(read_back(tier, again, PAGE), src)


def test_free_errors(tier_factory: TierFactory) -> None:
    tier = tier_factory(8, PAGE)
    handles = tier.allocate(2)
    tier.free(handles)
    with pytest.raises(InputError, match="freed twice"):
        tier.free([handles[0]])
    with pytest.raises(InputError):
        tier.free([never_allocated(tier, handles)])
    assert tier.num_free == 8


def test_claimed_pages_are_kept_out_of_allocation(tier_factory: TierFactory) -> None:
    """A reopen claims back the pages its index recorded (by slot, or by the extents a
    block-addressed tier reported); allocate never hands out their room again."""
    tier = tier_factory(8, PAGE)
    handles = tier.allocate(3)
    src = pages(3, PAGE, seed=21)
    tier.write(handles, src)
    places = [place_of(tier, h) for h in handles]
    tier.free(handles)                       # as a restarted tier knows nothing of them
    claimed = [claim(tier, p) for p in places]
    for p in places:
        with pytest.raises(InputError, match="claimed twice"):
            claim(tier, p)
    others = tier.allocate(5)
    tier.write(others, pages(5, PAGE, seed=22))
    np.testing.assert_array_equal(read_back(tier, claimed, PAGE), src)
    with pytest.raises(InputError, match="out of range"):
        claim(tier, ((-1, 1),) if tier.block_addressed else -1)


# -- input checks -------------------------------------------------------------------------
BadCase = Callable[[Tier, list[int]], tuple[list[int], object]]
BAD_BUFFERS: dict[str, BadCase] = {
    "float32": lambda t, h: (h, np.zeros((2, PAGE // 4), dtype=np.float32)),
    "1-d": lambda t, h: (h, np.zeros(2 * PAGE, dtype=np.uint8)),
    "3-d": lambda t, h: (h, np.zeros((2, 2, PAGE // 2), dtype=np.uint8)),
    "strided": lambda t, h: (h, np.zeros((2, 2 * PAGE), dtype=np.uint8)[:, ::2]),
    "fortran": lambda t, h: (h, np.asfortranarray(np.zeros((2, PAGE), dtype=np.uint8))),
    "too-wide": lambda t, h: (h, np.zeros((2, t.slot_bytes + 1), dtype=np.uint8)),
    "rows-vs-handles": lambda t, h: (h, np.zeros((3, PAGE), dtype=np.uint8)),
    "unknown-handle": lambda t, h: ([h[0], never_allocated(t, h)], np.zeros((2, PAGE), dtype=np.uint8)),
    "negative-handle": lambda t, h: ([-1, h[0]], np.zeros((2, PAGE), dtype=np.uint8)),
    "not-an-array": lambda t, h: (h, bytearray(2 * PAGE)),
}


@pytest.mark.parametrize("op", ["write", "read"])
@pytest.mark.parametrize("case", list(BAD_BUFFERS))
def test_bad_buffers_raise_input_error(tier_factory: TierFactory, case: str, op: str) -> None:
    tier = tier_factory(4, PAGE)
    handles = tier.allocate(2)
    src = pages(2, PAGE, seed=7)
    tier.write(handles, src)
    given, buf = BAD_BUFFERS[case](tier, handles)
    with pytest.raises(InputError):
        getattr(tier, op)(given, buf)
    np.testing.assert_array_equal(read_back(tier, handles, PAGE), src)  # a refused call changed nothing


# -- lifecycle ------------------------------------------------------------------------------
def test_use_after_close(tier_factory: TierFactory) -> None:
    tier = tier_factory(4, PAGE)
    handles = tier.allocate(2)
    buf = pages(1, PAGE, seed=7)
    tier.write(handles[:1], buf)
    place = place_of(tier, handles[1])
    tier.close()
    tier.close()  # idempotent
    calls: list[Callable[[], object]] = [
        lambda: tier.write(handles[:1], buf), lambda: tier.read(handles[:1], buf),
        lambda: tier.allocate(1), lambda: tier.free(handles[:1]), lambda: tier.flush(),
        lambda: claim(tier, place), lambda: tier.claim([0]),
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
def test_untargeted_pages_untouched(tier_factory: TierFactory, page_bytes: int) -> None:
    tier = tier_factory(12, page_bytes)
    every = tier.allocate(12)
    before = pages(12, page_bytes, seed=8)
    tier.write(every, before)
    targets = [1, 2, 3, 7, 10]
    new = pages(len(targets), page_bytes, seed=9)[::-1].copy()  # coded pages become raw and raw ones coded
    tier.write([every[i] for i in targets], new)
    expected = before.copy()
    expected[targets] = new
    np.testing.assert_array_equal(read_back(tier, every, page_bytes), expected)


def test_source_unchanged_by_write(tier_factory: TierFactory) -> None:
    tier = tier_factory(8, ODD_PAGE)
    every = tier.allocate(8)
    src = pages(8, ODD_PAGE, seed=10)
    kept = src.copy()
    tier.write([every[i] for i in (7, 6, 0, 1, 2, 3, 4, 5)], src)
    np.testing.assert_array_equal(src, kept)
