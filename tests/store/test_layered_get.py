"""Store.get(..., landed=record): pages read layer by layer, each layer announced as it lands."""

from __future__ import annotations

import logging
import mmap
import os
import threading
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import LAYOUT, PB, make_config, page_data
from tierkv.errors import InputError
from tierkv.store import landed as L
from tierkv.store.api import Store
from tierkv.store.transfer import Transfers
from tierkv.tiers.aligned import aligned_empty
from tierkv.tiers.base import TierKind
from tierkv.tiers.dram import DramTier
from tierkv.tiers.nvme import NvmeTier

TPP = LAYOUT.tokens_per_page
PER = PB // LAYOUT.num_layers


def prompt(seed: int, pages: int) -> np.ndarray:
    return np.random.default_rng(seed + 2000).integers(0, 50000, pages * TPP, dtype=np.int64)


@pytest.fixture
def watched(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, np.ndarray, int, int]]:
    """Each announcement of a layered get: (layer k, the caller's rows then, record words)."""
    seen: list[tuple[int, np.ndarray, int, int]] = []
    real = Transfers.read_layered

    def spy(self: Transfers, lead, out, ranges, after, **kw):  # type: ignore[no-untyped-def]
        def wrapped(k: int) -> None:
            after(k)
            seen.append((k, watched_rows[0].copy(), L.read(record[0], L.PAGES), L.read(record[0], L.LAYERS)))
            if scribble and k == len(ranges) - 1:   # the caller writes into its rows before the check
                watched_rows[0][scribble[0]] ^= 0xFF
        return real(self, lead, out, ranges, wrapped, **kw)

    monkeypatch.setattr(Transfers, "read_layered", spy)
    return seen


watched_rows: list[np.ndarray] = []
record: list[np.ndarray] = []
scribble: list[int] = []   # a row the caller overwrites once every layer has landed


def layered_get(s: Store, tokens: np.ndarray, n: int, aligned: bool = True) -> tuple[int, np.ndarray, np.ndarray]:
    # Aligned rows take the pages straight from O_DIRECT; others get each group copied out.
    # The others start 16 bytes past a page, never aligned to what O_DIRECT needs (numpy's
    # own buffer of this size came from the heap: 512-byte aligned one time in 32, and then
    # read in place, its later layers landing before they were announced).
    out = aligned_empty(n * PB).reshape(n, PB) if aligned else aligned_empty(n * PB + 16)[16:].reshape(n, PB)
    rec = L.new_record()
    L.publish(rec, L.LAYERS, 99)   # stale words from a previous get: the get resets them
    watched_rows[:] = [out]
    record[:] = [rec]
    got = s.get(tokens, out, landed=rec)
    return got.pages, out, rec


@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "unaligned"])
@pytest.mark.parametrize("dram,nvme,promote", [(8, 0, True), (0, 8, False), (2, 8, False), (2, 8, True)])
def test_layers_land_in_order_with_the_same_bytes_as_a_get(tmp_path: Path, watched: list, dram: int, nvme: int,
                                                           promote: bool, aligned: bool) -> None:
    cfg = make_config(tmp_path / "s", dram, nvme, promote_on_hit=promote)
    tokens, data = prompt(1, 6), page_data(1, 5)
    with Store.open(cfg) as s:
        s.put(tokens[:5 * TPP], data)
        tiers = s.lookup(tokens).tiers
        n, out, rec = layered_get(s, tokens, 6, aligned)   # one page more than the store holds
        assert n == 5 and np.array_equal(out[:5], data) and not out[5].any()
        assert (L.read(rec, L.PAGES), L.read(rec, L.LAYERS)) == (5, LAYOUT.num_layers)
        assert [k for k, *_ in watched] == list(range(LAYOUT.num_layers))
        for k, rows, pages, layers in watched:
            assert (pages, layers) == (5, k + 1)
            done = (k + 1) * PER
            assert np.array_equal(rows[:5, :done], data[:, :done])   # the layers announced are there
            if not aligned:   # copied out group by group (aligned rows take reads still in flight)
                assert not rows[:, done:].any()                        # the later ones not yet
        after = s.lookup(tokens).tiers
        assert s.stats().tiers[TierKind.NVME.value if nvme and not dram else TierKind.DRAM.value].hits > 0
    with Store.open(make_config(tmp_path / "twin", dram, nvme, promote_on_hit=promote)) as twin:
        twin.put(tokens[:5 * TPP], data)   # a plain get promotes (or not) the same pages
        assert twin.lookup(tokens).tiers == tiers
        twin.get(tokens, np.zeros((6, PB), dtype=np.uint8))
        assert twin.lookup(tokens).tiers == after


def test_a_page_that_fails_its_checksum_ends_the_result_though_its_layers_were_announced(
        tmp_path: Path, watched: list) -> None:
    cfg = make_config(tmp_path / "s", 0, 8, promote_on_hit=False)
    tokens, data = prompt(2, 4), page_data(2, 4)
    with Store.open(cfg) as s:
        s.put(tokens, data)
        s.flush()
        nvme = s._manager.tiers[0]
        assert isinstance(nvme, NvmeTier)
        slot = s._manager.leading(s._keys(tokens, ""), 4)[2].slots[nvme.name]
        fd = os.open(cfg.nvme_path(), os.O_WRONLY)
        try:   # bit rot in page 2's last layer
            os.pwrite(fd, b"\xff" * 64, nvme.header_bytes + slot * nvme.slot_bytes + PB - 4096)
        finally:
            os.close(fd)
        n, out, rec = layered_get(s, tokens, 4)
        assert n == 2 and np.array_equal(out[:2], data[:2])
        assert L.read(rec, L.PAGES) == 4 and L.read(rec, L.LAYERS) == LAYOUT.num_layers
        assert s.lookup(tokens).cached_pages == 2   # quarantined, as a plain get does
        assert s.stats().corrupt_pages == 1


def test_a_caller_writing_into_its_rows_gets_no_good_page_quarantined(tmp_path: Path, watched: list) -> None:
    # The pages land in the caller's rows (nothing is promoted): a row the caller changes
    # before the check fails it there, and the page is read again into the store's own
    # row, found good, and put back; nothing is quarantined for the other readers.
    cfg = make_config(tmp_path / "s", 0, 8, promote_on_hit=False)
    tokens, data = prompt(9, 3), page_data(9, 3)
    with Store.open(cfg) as s:
        s.put(tokens, data)
        scribble[:] = [1]
        try:
            n, out, _rec = layered_get(s, tokens, 3)
        finally:
            scribble.clear()
        assert n == 3 and np.array_equal(out, data)
        assert s.stats().corrupt_pages == 0 and s.lookup(tokens).cached_pages == 3


def test_a_tier_that_cannot_read_ranges_reads_whole_pages_then_announces_every_layer(tmp_path: Path) -> None:
    # 6 KiB layers: O_DIRECT cannot read one alone, so the NVMe tier reads whole pages.
    from tierkv.config import NvmeConfig, StoreConfig
    from tierkv.layout import KVLayout

    odd = KVLayout(num_layers=2, num_kv_heads=2, head_dim=48, dtype="bf16", tokens_per_page=16)
    cfg = StoreConfig(path=str(tmp_path / "s"), model_id="m", layout=odd, dram=None,
                      nvme=NvmeConfig(8 * odd.page_bytes), promote_on_hit=False)
    data = np.random.default_rng(3).integers(0, 256, (3, odd.page_bytes), dtype=np.uint8)
    tokens = prompt(3, 3)
    with Store.open(cfg) as s:
        s.put(tokens, data)
        tier = s._manager.tiers[0]
        assert isinstance(tier, NvmeTier)
        out = np.zeros((3, odd.page_bytes), dtype=np.uint8)
        if tier.direct:
            assert not tier.reads_ranges(0, odd.page_bytes // 2, out)
        rec = L.new_record()
        assert s.get(tokens, out, landed=rec).pages == 3
        assert np.array_equal(out, data) and L.read(rec, L.LAYERS) == 2 and L.read(rec, L.PAGES) == 3


def test_a_miss_announces_no_pages(store: Store) -> None:
    rec = L.new_record()
    L.publish(rec, L.PAGES, 7)
    out = np.zeros((2, PB), dtype=np.uint8)
    assert store.get(prompt(4, 2), out, landed=rec).pages == 0
    assert L.read(rec, L.PAGES) == 0


@pytest.mark.parametrize("bad", [np.zeros(2, dtype=np.int64), np.zeros(3, dtype=np.uint64), [0, 0],
                                 np.zeros(2, dtype=np.uint64)[::-1]])
def test_a_record_that_is_not_two_aligned_uint64_words_is_refused(store: Store, bad: object) -> None:
    with pytest.raises(InputError, match="landing record"):
        store.get(prompt(5, 1), np.zeros((1, PB), dtype=np.uint8), landed=bad)  # type: ignore[arg-type]


def test_tier_range_reads_check_their_range(tmp_path: Path) -> None:
    with Store.open(make_config(tmp_path / "s", 4, 8)) as s:
        for tier in s._manager.tiers:
            dst = np.zeros((1, PB), dtype=np.uint8)
            with pytest.raises(InputError, match="byte range"):
                tier.read_range([0], dst, 4096, 4096)
            with pytest.raises(InputError, match="byte range"):
                tier.read_range([0], dst, 0, PB + 4096)


def test_a_lend_names_the_rows_of_dram_pages_and_holds_them_until_it_ends(tmp_path: Path) -> None:
    with Store.open(make_config(tmp_path / "s", 4, 16, promote_on_hit=False)) as s:
        tokens, data = prompt(6, 3), page_data(6, 3)
        s.put(tokens, data)
        dram = s._manager.tiers[0]
        assert isinstance(dram, DramTier)
        lent = s.lend(tokens, want=3)
        assert (lent.pages, lent.tokens) == (3, 3 * TPP)
        pool = dram.buffer
        assert all(np.array_equal(pool[slot], data[i]) for i, slot in enumerate(lent.slots))
        # The pages leave DRAM meanwhile (other puts push them down): their rows are not reused.
        for k in range(3):
            s.put(prompt(100 + k, 4), page_data(100 + k, 4))
        assert all(np.array_equal(pool[slot], data[i]) for i, slot in enumerate(lent.slots))
        s.end_lend(lent.token)
        with pytest.raises(InputError, match="no lend"):
            s.end_lend(lent.token)
        assert s.stats().tiers[TierKind.DRAM.value].hits == 3


def test_a_lend_stops_at_the_first_page_below_dram(tmp_path: Path) -> None:
    with Store.open(make_config(tmp_path / "s", 2, 16, promote_on_hit=False)) as s:
        tokens = prompt(7, 4)
        s.put(tokens[:2 * TPP], page_data(7, 2))
        s.put(prompt(8, 2), page_data(8, 2))          # pushes the first prompt's pages to NVMe
        assert s.lookup(tokens).tiers[0] is TierKind.NVME
        lent = s.lend(tokens, want=4)
        assert (lent.pages, lent.slots) == (0, ())
        s.end_lend(lent.token)                          # a lend of nothing ends as well
        before = s.stats()
        assert s.lend(tokens, want=2, whole=True).pages == 0   # all or nothing, and nothing counted
        assert s.stats().pages_requested == before.pages_requested
        with pytest.raises(InputError, match="want"):
            s.lend(tokens, want=5)


def test_a_close_ends_lends_its_borrowers_never_ended(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    """Review: a close waited for every lend to end, so an in-process borrower that never
    called end_lend hung it forever. It now waits CLOSE_LEND_GRACE_S, ends them with a
    warning, and writes the DRAM pages back as ever; the borrower's mapping of the pool
    still reads its pages, and its late end_lend is a no-op."""
    monkeypatch.setattr(Store, "CLOSE_LEND_GRACE_S", 0.3)
    cfg = make_config(tmp_path / "s", 4, 16, promote_on_hit=False)
    s = Store.open(cfg)
    tokens, data = prompt(9, 3), page_data(9, 3)
    s.put(tokens, data)
    lent = s.lend(tokens, want=3)
    fd, slots, slot_bytes, _ = s.lend_pool()
    view = np.frombuffer(mmap.mmap(os.dup(fd), slots * slot_bytes, prot=mmap.PROT_READ), np.uint8)
    view = view.reshape(slots, slot_bytes)
    done = threading.Event()

    def close() -> None:
        s.close()
        done.set()
    closer = threading.Thread(target=close, daemon=True)
    caplog.set_level(logging.WARNING, logger="tierkv.store.api")
    closer.start()
    assert done.wait(10), "close hung on a lend nobody ended"
    closer.join()
    assert "1 lend(s) of DRAM rows still open" in caplog.text
    assert all(np.array_equal(view[slot, :PB], data[i]) for i, slot in enumerate(lent.slots))
    s.end_lend(lent.token)                               # after the close: nothing to do, no error
    with Store.open(cfg) as again:                       # the lent pages were written back at close
        out = np.zeros((3, PB), np.uint8)
        assert again.get(tokens, out).pages == 3 and np.array_equal(out, data)


def test_a_close_waits_for_a_lend_ended_within_the_grace(tmp_path: Path) -> None:
    s = Store.open(make_config(tmp_path / "s", 4, 16, promote_on_hit=False))
    tokens = prompt(10, 2)
    s.put(tokens, page_data(10, 2))
    lent = s.lend(tokens, want=2)
    closer = threading.Thread(target=s.close)
    closer.start()
    closer.join(0.2)
    assert closer.is_alive()                             # waiting for the borrower
    s.end_lend(lent.token)
    closer.join(10)
    assert not closer.is_alive()


def test_a_close_with_a_lend_open_does_not_miss_the_end_of_a_copy(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Review: close waited for copies apart from lends, but was woken only when no copy
    at all ran; with a lend open, the end of a get's unlocked copy never woke it, and
    the close waited for the lend after all (for ever, if nobody ended it)."""
    monkeypatch.setattr(Store, "CLOSE_LEND_GRACE_S", 0.3)
    s = Store.open(make_config(tmp_path / "s", 4, 16, promote_on_hit=False))
    tokens = prompt(11, 2)
    s.put(tokens, page_data(11, 2))
    s.lend(tokens, want=2)                                # never ended
    dram = s._manager.tiers[0]
    assert isinstance(dram, DramTier)
    with s._lock:                                         # a copy running without the lock, as a big get's
        copy = s._begin_unlocked(dram, [0])
    done = threading.Event()

    def close() -> None:
        s.close()
        done.set()
    threading.Thread(target=close, daemon=True).start()
    assert not done.wait(0.2)                             # the copy is waited for
    with s._lock:
        s._end_unlocked(dram, copy)
    assert done.wait(10), "close missed the end of the copy"


def test_a_layered_get_reads_in_place_into_rows_at_the_tiers_alignment(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows aligned as the NVMe tier's file takes O_DIRECT (STATX_DIOALIGN, less than a
    page on this project's disks) take the pages straight from the reads; rows aligned
    less go through the store's own rows, then are copied; the same bytes either way."""
    cfg = make_config(tmp_path / "s", 0, 8)
    tokens, data = prompt(7, 4), page_data(7, 4)
    with Store.open(cfg) as s:
        align = s._manager.tiers[0].mem_align
        if align >= 4096:
            pytest.skip(f"{tmp_path}'s filesystem reports no O_DIRECT memory alignment below a page")
        s.put(tokens, data)
        copied: list[int] = []
        own = s._private_rows

        def counted(n: int, width: int) -> np.ndarray:
            copied.append(n)
            return own(n, width)

        monkeypatch.setattr(s, "_private_rows", counted)
        for shift, private in ((align, False), (align // 2, True)):
            out = aligned_empty(4 * PB + shift)[shift:].reshape(4, PB)
            rec = L.new_record()
            assert s.get(tokens, out, landed=rec).pages == 4
            np.testing.assert_array_equal(out, data)
            assert bool(copied) is private, shift
            copied.clear()
