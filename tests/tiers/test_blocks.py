"""Block-addressed tiers beyond the conformance suite: the contiguous allocator, extents,
and what coding does to a BlockPageTier's blocks, over a real O_DIRECT file.

The coded tiers run the whole conformance suite too (``nvme-coded`` and ``nvmeof-coded``
in conftest.py); these tests look at what only a block-addressed tier has.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest

from tierkv.codec import Codec, CodecMode
from tierkv.errors import CapacityError, InputError
from tierkv.store.index import IndexRecord
from tierkv.keys import PageKey
from tierkv.layout import DType, KVLayout
from tierkv.store.coding import CodecChoice
from tierkv.tiers.aligned import ALIGN
from tierkv.tiers.blocks import BlockPageTier, UndecodablePageError, block_list, to_extents
from tierkv.tiers.hugepages import HUGE_PAGE
from tierkv.tiers.nvme import NvmeTier

from tests.tiers.test_aligned import huge_kib, needs_thp

LAYOUT = KVLayout(2, 2, 64, DType.BF16, 16)  # 16 KiB pages: 4 blocks
PB = LAYOUT.page_bytes
BPP = PB // ALIGN


def smooth_pages(n: int, seed: int = 0) -> np.ndarray:
    """BF16 pages of small-range values: they code to well under half their size."""
    rng = np.random.default_rng(seed)
    x = rng.normal(0, 1, (n, PB // 2)).astype(np.float32)
    return (x.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(n, PB).copy()


@pytest.fixture
def tier(tmp_path: Path) -> Iterator[BlockPageTier]:
    blocks = NvmeTier(tmp_path / "blocks.dat", 8 * BPP, ALIGN)
    t = BlockPageTier(blocks, 8, PB, CodecChoice(CodecMode.LOSSLESS, Codec(LAYOUT)))
    yield t
    t.close()


def test_extents_round_trip() -> None:
    assert to_extents([4, 5, 6, 9, 10, 2]) == ((4, 3), (9, 2), (2, 1))
    assert block_list(((4, 3), (9, 2))) == [4, 5, 6, 9, 10]
    rec = IndexRecord(PageKey(bytes(range(16))), 4, PB, 123, None, ((4, 3), (9, 2)))
    assert IndexRecord.unpack(rec.key, rec.pack()) == rec
    # A page over 16 MiB whose blocks are all scattered: one run per block.
    scattered = IndexRecord(PageKey(bytes(range(16))), 0, 5000 * ALIGN, 9, None,
                            tuple((2 * b, 1) for b in range(5000)))
    assert IndexRecord.unpack(scattered.key, scattered.pack()) == scattered
    plain = IndexRecord(PageKey(bytes(16)), 7, PB, 5, PageKey(bytes(range(16))))
    assert len(plain.pack()) == 8 + 4 + 8 + 16 + 1 + 8  # slot records stay format-2 bytes
    assert IndexRecord.unpack(plain.key, plain.pack()) == plain


def test_coded_pages_take_fewer_blocks_and_read_back(tier: BlockPageTier) -> None:
    rows = smooth_pages(6)
    handles = tier.allocate(6)
    assert tier.num_free == 2
    tier.write(handles, rows)
    used = [sum(c for _, c in tier.extents(h) or ()) for h in handles]
    assert all(k < BPP for k in used)
    assert tier.num_free > 2  # the unused blocks of each reservation came back
    back = np.zeros_like(rows)
    tier.read(handles, back)
    np.testing.assert_array_equal(back, rows)
    tier.read(handles[2:4][::-1], back[:2])
    np.testing.assert_array_equal(back[:2], rows[2:4][::-1])


@needs_thp
def test_coded_staging_buffers_are_on_huge_pages(tier: BlockPageTier) -> None:
    rows = smooth_pages(6, seed=3)
    handles = tier.allocate(6)
    tier.write(handles, rows)
    back = np.zeros_like(rows)
    tier.read(handles, back)
    np.testing.assert_array_equal(back, rows)
    idle = tier._scratch._idle   # the staged, packed and read blocks, kept for the next batch
    assert idle and all(int(b.ctypes.data) % HUGE_PAGE == 0 and huge_kib(int(b.ctypes.data)) for b in idle)


def test_random_pages_are_stored_raw(tier: BlockPageTier) -> None:
    rows = np.random.default_rng(1).integers(0, 256, (8, PB), dtype=np.uint8)
    handles = tier.allocate(8)
    tier.write(handles, rows)
    assert [tier.extents(h) for h in handles] == [((i * BPP, BPP),) for i in range(8)]
    back = np.zeros_like(rows)
    tier.read(handles, back)
    np.testing.assert_array_equal(back, rows)
    with pytest.raises(CapacityError):
        tier.allocate(1)


def test_claim_extents_and_damaged_blob(tier: BlockPageTier) -> None:
    rows = smooth_pages(2)
    handles = tier.allocate(2)
    tier.write(handles, rows)
    ext = tier.extents(handles[1])
    assert ext is not None
    with pytest.raises(InputError):
        tier.claim_extents(ext)  # taken already
    first = ext[0][0]
    tier.blocks.write([first], np.frombuffer(b"XX" + bytes(ALIGN - 2), dtype=np.uint8).reshape(1, ALIGN))
    back = np.zeros_like(rows)
    with pytest.raises(UndecodablePageError) as info:
        tier.read(handles, back)
    assert info.value.rows == (1,)
    np.testing.assert_array_equal(back[0], rows[0])


def test_reader_views_are_bounded_and_read_back(tier: BlockPageTier) -> None:
    src = smooth_pages(2, seed=3)
    handles = tier.allocate(2)
    tier.write(handles, src)
    exts = [tier.extents(h) for h in handles]
    assert all(exts)
    blocks = tier.blocks.num_slots
    # A long-lived reader sees many more distinct extents than the tier holds pages.
    for i in range(3 * blocks):
        tier.view(((i % (blocks - 1), 1),))
    assert len(tier._views) <= blocks
    out = np.zeros_like(src)
    tier.read([tier.view(e) for e in exts], out)  # type: ignore[arg-type]
    np.testing.assert_array_equal(out, src)


def test_slot_wide_reads_of_coded_pages_pad_with_zeros(tmp_path: Path) -> None:
    """A page narrower than its slot (4,352 of 8,192 bytes) reads back slot-wide like a raw one."""
    from tests.codec.conftest import normal_pages

    layout = KVLayout(1, 1, 68, DType.BF16, 16)
    assert layout.page_bytes == 4352
    rows = normal_pages(layout, 4)
    blocks = NvmeTier(tmp_path / "narrow.dat", 4 * 2, ALIGN)
    with BlockPageTier(blocks, 4, layout.page_bytes, CodecChoice(CodecMode.LOSSLESS, Codec(layout))) as t:
        handles = t.allocate(4)
        t.write(handles, rows)
        assert any(sum(c for _, c in t.extents(h) or ()) < 2 for h in handles)   # some are coded
        wide = np.full((4, t.slot_bytes), 0xEE, dtype=np.uint8)
        t.read(handles, wide)
    np.testing.assert_array_equal(wide[:, :layout.page_bytes], rows)
    assert not wide[:, layout.page_bytes:].any()


def test_a_coded_handle_rewritten_with_raw_pages_grows_back(tier: BlockPageTier) -> None:
    h = tier.allocate(2)
    tier.write(h, smooth_pages(2))
    assert all(sum(c for _, c in tier.extents(s) or ()) < BPP for s in h)
    rand = np.random.default_rng(1).integers(0, 256, (2, PB), dtype=np.uint8)
    tier.write(h, rand)                              # raw: every block of a page again
    assert all(sum(c for _, c in tier.extents(s) or ()) == BPP for s in h)
    back = np.zeros_like(rand)
    tier.read(h, back)
    assert np.array_equal(back, rand)
    tier.write(h, smooth_pages(2, seed=3))           # and shrinks again
    back = np.zeros_like(rand)
    tier.read(h, back)
    assert np.array_equal(back, smooth_pages(2, seed=3))


def test_a_rewrite_that_needs_more_blocks_than_are_free_changes_nothing(tmp_path: Path) -> None:
    zeros = np.zeros((1, PB), np.uint8)              # codes to one block
    with BlockPageTier(NvmeTier(tmp_path / "b.dat", 2 * BPP, ALIGN), 2, PB,
                       CodecChoice(CodecMode.LOSSLESS, Codec(LAYOUT))) as t:
        handles = []
        for _ in range(5):                           # 5 pages in 2 raw pages' blocks
            h = t.allocate(1)
            t.write(h, zeros)
            handles += h
        before = [t.extents(s) for s in handles]
        with pytest.raises(CapacityError, match="rewriting 2 pages needs"):
            t.write(handles[:2], np.random.default_rng(5).integers(0, 256, (2, PB), dtype=np.uint8))
        assert [t.extents(s) for s in handles] == before
        back = np.ones((5, PB), np.uint8)
        t.read(handles, back)
        assert not back.any()


def lossy_rows(n: int, seed: int = 0, bits: float = 4.0, smooth: bool = False) -> np.ndarray:
    """Rows as a store holds lossy pages: a lossy blob at ``bits`` an element, then zeros."""
    from tierkv.lossy.alloc import allocate
    from tierkv.lossy.format import encode

    rng = np.random.default_rng(seed)
    out = np.zeros((n, PB), np.uint8)
    for i in range(n):
        page = rng.standard_normal(LAYOUT.page_shape).astype(np.float32)
        if smooth:   # mostly zeros: what the lossless codec would pack tighter than the blob
            page = np.where(rng.random(page.shape) < 0.05, np.round(page * 2) / 4, 0).astype(np.float32)
        blob = encode(page, allocate(page, bits), "bf16", bits)
        out[i, :len(blob)] = np.frombuffer(blob, np.uint8)
    return out


@pytest.mark.parametrize("mode", [CodecMode.LOSSLESS, CodecMode.AUTO])
def test_lossy_rows_are_stored_as_their_blob_whatever_the_codec_chooses(tmp_path: Path, mode: CodecMode) -> None:
    blocks = NvmeTier(tmp_path / "blocks.dat", 8 * BPP, ALIGN)
    with BlockPageTier(blocks, 8, PB, CodecChoice(mode, Codec(LAYOUT))) as t:
        rows = np.concatenate([lossy_rows(3), smooth_pages(1, 4), np.random.default_rng(5).integers(
            0, 256, (1, PB), dtype=np.uint8)])
        # A row that starts like a lossy page but has bytes after its blob: stored as any page.
        forged = lossy_rows(1, 9)
        forged[0, -1] = 7
        rows = np.concatenate([rows, forged])
        handles = t.allocate(len(rows))
        t.write(handles, rows)
        used = [sum(c for _, c in t.extents(h) or ()) for h in handles]
        assert used[:3] == [1, 1, 1]                     # 4 bits of 16: a quarter of the page's 4 blocks
        assert used[4] == BPP                            # random bytes raw (the forged row: as the codec chooses)
        back = np.zeros_like(rows)
        t.read(handles, back)
        np.testing.assert_array_equal(back, rows)
        wide = np.zeros((len(rows), BPP * ALIGN), np.uint8)
        t.read(handles[:3], wide[:3])
        np.testing.assert_array_equal(wide[:3], rows[:3])


def test_a_lossy_row_the_codec_would_pack_tighter_keeps_its_blob_in_a_mixed_batch(tmp_path: Path) -> None:
    """At 12 bits a smooth page's blob takes more blocks than the codec would code the row
    in: the row is still stored as its blob, whole, beside coded and raw rows (a review
    found it cut to the codec's size, and the next page written over its end)."""
    blocks = NvmeTier(tmp_path / "blocks.dat", 16 * BPP, ALIGN)
    with BlockPageTier(blocks, 16, PB, CodecChoice(CodecMode.LOSSLESS, Codec(LAYOUT))) as t:
        rows = np.concatenate([lossy_rows(1, 3, 12.0, smooth=True), np.random.default_rng(6).integers(
            0, 256, (1, PB), dtype=np.uint8), np.zeros((1, PB), np.uint8), smooth_pages(2, 7),
            lossy_rows(1, 8, 12.0, smooth=True)])
        handles = t.allocate(len(rows))
        t.write(handles, rows)
        back = np.zeros_like(rows)
        t.read(handles, back)
        np.testing.assert_array_equal(back, rows)


def test_coded_batches_of_several_groups_pipeline_and_name_each_bad_page(tmp_path: Path) -> None:
    """A coded write of more than one group (about 4 MiB of raw pages) codes the next
    group while this one's blocks are written, and a coded read of more than one group
    (about 4 MiB of blocks) reads the next while this one decodes: every page comes
    back exact, with its checksum, the ratio is the whole batch's, and pages damaged in
    two different groups are both named, after all were read."""
    from tierkv.store.checksum import checksum_rows
    from tierkv.tiers import blocks as blocks_module

    n = 2 * blocks_module._GROUP_BLOCKS   # pages of under half a raw page: three groups or more
    medium = NvmeTier(tmp_path / "blocks.dat", n * BPP, ALIGN)
    tier = BlockPageTier(medium, n, PB, CodecChoice(CodecMode.LOSSLESS, Codec(LAYOUT)))
    try:
        rows = smooth_pages(n, seed=5)
        handles = tier.allocate(n)
        assert n > blocks_module._GROUP_BLOCKS // BPP   # more than one group to write
        tier.write(handles, rows)
        counts = [sum(c for _, c in tier.extents(h) or ()) for h in handles]
        with Codec(LAYOUT) as codec:   # the tier's ratio is the batch's, not its last group's
            ratio = sum(len(b) for b in codec.encode(rows)) / rows.nbytes
        assert tier.choice.ratio is not None and abs(tier.choice.ratio - ratio) < 1e-9
        assert len(blocks_module._groups(counts, blocks_module._GROUP_BLOCKS)) >= 3
        back = np.zeros_like(rows)
        assert tier.read(handles, back, checksums=True) == checksum_rows(rows)
        np.testing.assert_array_equal(back, rows)
        bad = [3, n - 2]   # one in the first group, one in the last
        for i in bad:
            ext = tier.extents(handles[i])
            assert ext is not None
            medium.write([ext[0][0]], np.frombuffer(b"XX" + bytes(ALIGN - 2), dtype=np.uint8).reshape(1, ALIGN))
        back[:] = 0
        with pytest.raises(UndecodablePageError) as info:
            tier.read(handles, back)
        assert info.value.rows == tuple(bad)
        good = np.setdiff1d(np.arange(n), bad)
        np.testing.assert_array_equal(back[good], rows[good])
    finally:
        tier.close()


def _pipelined_tier(path: Path, n: int) -> tuple[NvmeTier, BlockPageTier]:
    medium = NvmeTier(path, n * BPP, ALIGN)
    return medium, BlockPageTier(medium, n, PB, CodecChoice(CodecMode.LOSSLESS, Codec(LAYOUT)))


def test_a_pipelined_rewrite_that_fits_as_a_batch_fits(tmp_path: Path) -> None:
    """On a full tier, a rewrite whose first group grows back as much as its second
    shrinks fits as a batch: the group that cannot fit alone goes with the rest (a
    review found it refused with CapacityError after earlier groups were written)."""
    from tierkv.tiers import blocks as blocks_module

    per = blocks_module._GROUP_BLOCKS // BPP
    rng = np.random.default_rng(0)
    medium, tier = _pipelined_tier(tmp_path / "blocks.dat", 2 * per)
    with tier:
        handles = tier.allocate(2 * per)
        tier.write(handles, np.concatenate([smooth_pages(per, 1), rng.integers(0, 256, (per, PB), dtype=np.uint8)]))
        tier.allocate(medium.num_free // BPP)   # the tier is full
        rows = np.concatenate([rng.integers(0, 256, (per, PB), dtype=np.uint8), smooth_pages(per, 2)])
        tier.write(handles, rows)
        back = np.zeros_like(rows)
        tier.read(handles, back)
        np.testing.assert_array_equal(back, rows)


def test_a_failed_group_write_stops_the_batch_and_leaves_no_io(tmp_path: Path) -> None:
    import time

    from tierkv.errors import TierIOError
    from tierkv.tiers import blocks as blocks_module

    n = 3 * (blocks_module._GROUP_BLOCKS // BPP) + 5
    medium, tier = _pipelined_tier(tmp_path / "blocks.dat", n)
    with tier:
        handles = tier.allocate(n)
        original, calls, live = medium.write, [], []

        def write(slots: Sequence[int], buf: np.ndarray) -> None:
            calls.append(1)
            live.append(1)
            try:
                time.sleep(0.05)
                if len(calls) == 2:
                    raise TierIOError("injected")
                original(slots, buf)
            finally:
                live.pop()

        medium.write = write   # type: ignore[method-assign, assignment]
        with pytest.raises(TierIOError, match="injected"):
            tier.write(handles, smooth_pages(n, 3))
        assert len(calls) == 2 and not live   # no later group written, nothing in flight
        tier.free(handles)
        assert medium.num_free == medium.num_slots


def test_a_close_during_a_pipelined_write_says_the_tier_is_closed(tmp_path: Path) -> None:
    import threading
    import time

    from tierkv.errors import StoreClosedError
    from tierkv.tiers import blocks as blocks_module

    n = 4 * (blocks_module._GROUP_BLOCKS // BPP)
    medium, tier = _pipelined_tier(tmp_path / "blocks.dat", n)
    handles = tier.allocate(n)
    original = medium.write
    def slow_write(slots: Sequence[int], buf: np.ndarray) -> None:
        time.sleep(0.3)
        original(slots, buf)

    medium.write = slow_write   # type: ignore[method-assign, assignment]
    errors: list[BaseException] = []

    def run() -> None:
        try:
            tier.write(handles, smooth_pages(n, 4))
        except BaseException as e:   # noqa: BLE001 - the test looks at what it was
            errors.append(e)

    writer = threading.Thread(target=run)
    writer.start()
    time.sleep(0.35)
    tier.close()
    writer.join()
    assert len(errors) == 1 and isinstance(errors[0], StoreClosedError), errors


def test_a_read_without_a_codec_names_every_coded_row(tmp_path: Path) -> None:
    """Coded pages read through a tier without a codec (direct API use) are all named,
    across groups, and the raw ones are still read."""
    from tierkv.tiers import blocks as blocks_module

    n = 2 * blocks_module._GROUP_BLOCKS
    medium, tier = _pipelined_tier(tmp_path / "blocks.dat", n)
    rows = smooth_pages(n, seed=6)
    rows[7] = np.random.default_rng(1).integers(0, 256, PB, dtype=np.uint8)   # stored raw
    handles = tier.allocate(n)
    tier.write(handles, rows)
    exts = [tier.extents(h) for h in handles]
    tier.close()
    medium = NvmeTier(tmp_path / "blocks.dat", n * BPP, ALIGN)
    bare = BlockPageTier(medium, n, PB, CodecChoice(CodecMode.NONE, None))
    with bare:
        mine = [bare.claim_extents(e) for e in exts if e is not None]
        back = np.zeros_like(rows)
        with pytest.raises(UndecodablePageError, match="no codec") as info:
            bare.read(mine, back)
        assert info.value.rows == tuple(i for i in range(n) if i != 7)
        np.testing.assert_array_equal(back[7], rows[7])


def test_what_auto_calls_pipelined_is_what_the_tier_pipelines(tmp_path: Path) -> None:
    """The auto model's pipelined flags follow the tier's grouping: writes by raw pages,
    reads by the coded blocks moved (a review found a 5 MiB batch at ratio 0.68 called
    pipelined for its read, which the tier read in one group)."""
    from tierkv.store.coding import pipelines
    from tierkv.tiers import blocks as blocks_module

    for n in (8, 300, (5 << 20) // PB, 2 * blocks_module._GROUP_BLOCKS):
        rows = smooth_pages(n, seed=n)
        medium, tier = _pipelined_tier(tmp_path / f"{n}.dat", n)
        with tier:
            handles = tier.allocate(n)
            tier.write(handles, rows)
            counts = [sum(c for _, c in tier.extents(h) or ()) for h in handles]
            ratio = sum(counts) * ALIGN / rows.nbytes
            write_piped, read_piped = pipelines(rows, ratio)
            assert write_piped == (n > blocks_module._GROUP_BLOCKS // BPP)
            assert read_piped == (len(blocks_module._groups(counts, blocks_module._GROUP_BLOCKS)) > 1), n


def test_coded_batches_reuse_their_buffers_and_leave_no_stale_bytes_on_the_medium(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pipelined coded write and read take their staging, packing and read buffers from
    the tier's scratch pool: once warm, a batch allocates none. The reused buffers hold
    the last batch's bytes, so the blocks of a rewrite with shorter blobs must still end
    in zeros after each blob: read straight from the medium, they do."""
    from tierkv.codec import peek_header
    from tierkv.tiers import aligned
    from tierkv.tiers import blocks as blocks_module

    n = 2 * blocks_module._GROUP_BLOCKS // BPP + 7   # two groups and a part
    medium, tier = _pipelined_tier(tmp_path / "blocks.dat", n)
    made: list[int] = []
    real = aligned.aligned_empty

    def counting(nbytes: int, huge: bool = False) -> np.ndarray:
        made.append(nbytes)
        return real(nbytes, huge=huge)

    monkeypatch.setattr(aligned, "aligned_empty", counting)
    try:
        handles = tier.allocate(n)
        noisy = smooth_pages(n, seed=1)
        noisy.view(np.uint16)[:, ::3] ^= np.uint16(0x00FF)   # longer blobs
        quiet = smooth_pages(n, seed=2)
        quiet.view(np.uint16)[:, 1::2] = quiet.view(np.uint16)[:, ::2]   # shorter ones
        back = np.empty_like(noisy)
        tier.write(handles, noisy)
        tier.read(handles, back)
        np.testing.assert_array_equal(back, noisy)
        warm = len(made)
        assert 0 < warm <= 4
        tier.write(handles, quiet)
        tier.read(handles, back)
        np.testing.assert_array_equal(back, quiet)
        assert len(made) == warm   # every buffer of the second batch came from the pool
        for h in handles:
            ext = tier.extents(h)
            assert ext is not None
            blocks = [b for start, count in ext for b in range(start, start + count)]
            raw = np.empty((len(blocks), ALIGN), dtype=np.uint8)
            medium.read(blocks, raw)
            flat = raw.reshape(-1)
            used = 40 + peek_header(flat[:40].tobytes()).payload_bytes
            assert len(blocks) < BPP and not flat[used:].any(), f"stale bytes after the blob of page {h}"
    finally:
        tier.close()


def test_pages_placed_one_by_one_take_the_lowest_run_each(tmp_path: Path) -> None:
    """Where no run holds a whole batch, each page takes the lowest run of its blocks:
    the search for one at least as long as the last goes on from there, a shorter one
    starts again from the bottom (a hole too short for the last page may fit it)."""
    medium = NvmeTier(tmp_path / "blocks.dat", 8 * BPP, ALIGN)
    tier = BlockPageTier(medium, 8, PB, CodecChoice(CodecMode.NONE, None))
    try:
        handles = tier.allocate(8)
        assert [tier.extents(h) for h in handles] == [((i * BPP, BPP),) for i in range(8)]   # one run
        tier.free([handles[1], handles[3], handles[5]])
        again = tier.allocate(3)   # no run of 3 pages: the three holes, lowest first
        assert [tier.extents(h) for h in again] == [((BPP, BPP),), ((3 * BPP, BPP),), ((5 * BPP, BPP),)]
        tier.free(again)
        assert medium.allocate(2) == [BPP, BPP + 1]     # page 1's hole less two: two left at BPP + 2
        tier._place_each([100, 101], [BPP, 2])
        assert tier.extents(100) == ((3 * BPP, BPP),)   # the first hole of BPP blocks
        assert tier.extents(101) == ((BPP + 2, 2),)     # below it: the hole of two
    finally:
        tier.close()


def test_freeing_pages_is_all_or_nothing(tier: BlockPageTier) -> None:
    rows = smooth_pages(4, seed=9)
    handles = tier.allocate(4)
    tier.write(handles, rows)
    free = tier.num_free
    for bad in ([handles[0], 999], [handles[1], handles[1]]):
        with pytest.raises(InputError, match="freed twice or never allocated"):
            tier.free(bad)
        assert tier.num_free == free
    back = np.zeros_like(rows)
    tier.read(handles, back)
    np.testing.assert_array_equal(back, rows)
    tier.free(handles)
    assert tier.num_free == 8   # every block back (coded pages held fewer than a raw page's)


def test_a_free_that_fails_on_a_reader_handle_leaves_every_page(tier: BlockPageTier) -> None:
    """A reader's view handle holds no blocks: freeing it with allocated pages raises and
    frees none of them (their blocks neither leaked nor half freed)."""
    handles = tier.allocate(2)
    view = tier.view(((6 * BPP, BPP),))   # blocks nobody holds
    free = tier.blocks.num_free
    with pytest.raises(InputError, match="freed twice"):
        tier.free(handles + [view])
    assert tier.blocks.num_free == free and all(tier.extents(h) is not None for h in handles)
    tier.free(handles)
    assert tier.blocks.num_free == free + 2 * BPP
