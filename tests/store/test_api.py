"""The Store API: round trips through each tier, demotion, promotion, reopen, pins, errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import LAYOUT, PB, make_config, page_data
from tierkv.store.api import Store
from tierkv.errors import CapacityError, InputError, StoreBusyError, StoreClosedError, TierKVError
from tierkv.tiers.base import TierKind

TPP = LAYOUT.tokens_per_page


def prompt(seed: int, pages: int) -> np.ndarray:
    return np.random.default_rng(seed + 1000).integers(0, 50000, pages * TPP, dtype=np.int64)


def load(store: Store, tokens: np.ndarray, n: int) -> tuple[int, np.ndarray]:
    out = np.zeros((n, PB), dtype=np.uint8)
    got = store.get(tokens, out)
    return got.pages, out


@pytest.mark.parametrize("dram,nvme", [(8, 0), (0, 8), (4, 16)])
def test_round_trip_each_tier(tmp_path: Path, dram: int, nvme: int) -> None:
    with Store.open(make_config(tmp_path / "s", dram, nvme)) as s:
        tokens, data = prompt(1, 4), page_data(1, 4)
        assert s.put(tokens, data).stored == 4
        n, out = load(s, tokens, 4)
        assert n == 4 and np.array_equal(out, data)
        expect = TierKind.DRAM if dram else TierKind.NVME
        assert s.lookup(tokens).tiers == (expect,) * 4


def test_torch_pages_in_layout_dtype(store: Store) -> None:
    tokens = prompt(2, 3)
    pages = torch.randn(3, *LAYOUT.page_shape).to(torch.bfloat16)
    assert store.put(tokens, pages).stored == 3
    out = torch.zeros_like(pages)
    assert store.get(tokens, out).pages == 3
    assert torch.equal(out.view(torch.int16), pages.view(torch.int16))


@pytest.mark.parametrize("dram,nvme", [(8, 0), (0, 8), (2, 16)])
def test_put_takes_a_list_of_separate_pages(tmp_path: Path, dram: int, nvme: int) -> None:
    cfg = make_config(tmp_path / "s", dram, nvme)
    tokens, data = prompt(11, 6), page_data(11, 6)
    as_bf16 = torch.from_numpy(data.copy()).view(torch.bfloat16).reshape(6, *LAYOUT.page_shape)
    listed = [data[0].copy(), data[1:2].copy(),                       # numpy [pb] and [1, pb]
              torch.from_numpy(data[2].copy()), as_bf16[3].clone(),   # uint8 [pb], bf16 [*page_shape]
              torch.from_numpy(data[4:5].copy()), as_bf16[5:6].clone()]  # uint8 [1, pb], bf16 [1, *page_shape]
    with Store.open(cfg) as s:
        res = s.put(tokens, listed)
        assert (res.stored, res.already_present) == (6, 0)
        n, out = load(s, tokens, 6)
        assert n == 6 and np.array_equal(out, data)
        assert s.put(tokens, tuple(listed)).already_present == 6  # a tuple too; all cached already
    if nvme:  # the checksums recorded for listed pages hold: a reopened store verifies every read
        with Store.open(cfg) as s:
            n, out = load(s, tokens, 6)
            assert n == min(6, nvme) and np.array_equal(out[:n], data[:n])


def test_list_put_demotes_and_skips_cached_pages(tmp_path: Path) -> None:
    with Store.open(make_config(tmp_path / "s", 4, 16)) as s:
        first, later = prompt(12, 3), prompt(13, 3)
        s.put(first, list(page_data(12, 3)))
        s.put(later, [row for row in page_data(13, 3)])  # DRAM holds 4: pages go down to NVMe
        assert TierKind.NVME in s.lookup(first).tiers + s.lookup(later).tiers
        longer = np.concatenate([first, prompt(14, 2)])
        grown = np.concatenate([page_data(12, 3), page_data(14, 2)])
        res = s.put(longer, list(grown))
        assert (res.stored, res.already_present) == (2, 3)
        for tokens, data in ((first, page_data(12, 3)), (later, page_data(13, 3)), (longer, grown)):
            n, out = load(s, tokens, len(data))
            assert n == len(data) and np.array_equal(out, data)


@pytest.mark.parametrize("bad,match", [
    ([np.zeros(PB, np.float32)], r"put\(pages=...\)\[0\]: a numpy page must be raw bytes, uint8 of shape"),
    ([np.zeros(PB, np.uint8), np.zeros(PB + 1, np.uint8)], r"\[1\]: a numpy page must be raw bytes"),
    ([torch.zeros(*LAYOUT.page_shape, dtype=torch.bfloat16).transpose(0, 1)], "contiguous"),
    ("not pages", "or a list or tuple of pages, got str"),
    ([np.zeros((2, PB), np.uint8)], "shape"),
    ([np.zeros(2 * PB, np.uint8)[::2]], "C-contiguous"),
    ([torch.zeros(*LAYOUT.page_shape, dtype=torch.float16)], "bfloat16 of shape"),
    ([torch.zeros(2, *LAYOUT.page_shape, dtype=torch.bfloat16)], "bfloat16 of shape"),
    ([torch.zeros(2 * PB, dtype=torch.uint8)[::2]], "contiguous"),
    ([np.zeros(PB, np.uint8)] * 9, "full pages"),
    ([b"x" * PB], "torch.Tensor or numpy.ndarray, got bytes"),
])
def test_bad_page_lists_raise_input_error(store: Store, bad: object, match: str) -> None:
    with pytest.raises(InputError, match=match):
        store.put(prompt(7, 8), bad)  # type: ignore[arg-type]
    assert store.stats().pages_stored == 0


def test_get_into_a_list_says_it_takes_one_batch(store: Store) -> None:
    tokens = prompt(15, 2)
    store.put(tokens, page_data(15, 2))
    with pytest.raises(InputError, match="one batch buffer"):
        store.get(tokens, [np.zeros(PB, np.uint8), np.zeros(PB, np.uint8)])  # type: ignore[arg-type]


def test_demotion_and_promotion_are_bit_exact(store: Store) -> None:
    prompts = [(prompt(i, 2), page_data(i, 2)) for i in range(6)]  # 12 pages, DRAM holds 4
    for tokens, data in prompts:
        store.put(tokens, data)
    st = store.stats()
    assert st.bytes_moved.get("dram->nvme", 0) > 0, st.bytes_moved
    tokens, data = prompts[0]
    assert store.lookup(tokens).tiers == (TierKind.NVME, TierKind.NVME)
    n, out = load(store, tokens, 2)
    assert n == 2 and np.array_equal(out, data)
    assert store.lookup(tokens).tiers == (TierKind.DRAM, TierKind.DRAM)  # promoted on hit
    for tokens, data in prompts:
        n, out = load(store, tokens, 2)
        assert n == 2 and np.array_equal(out, data)


def test_capacity_never_exceeded_and_lru_drops(tmp_path: Path) -> None:
    with Store.open(make_config(tmp_path / "s", 2, 4)) as s:
        for i in range(10):
            s.put(prompt(i, 1), page_data(i, 1))
            st = s.stats()
            for t in st.tiers.values():
                assert t.used_slots <= t.capacity_slots
        assert s.lookup(prompt(0, 1)).cached_pages == 0  # oldest dropped
        assert s.lookup(prompt(9, 1)).cached_pages == 1
        assert s.stats().pages_dropped > 0


def test_pinned_pages_never_evicted(tmp_path: Path) -> None:
    with Store.open(make_config(tmp_path / "s", 2, 0)) as s:
        s.put(prompt(0, 1), page_data(0, 1))
        assert s.pin(prompt(0, 1)) == 1
        for i in range(1, 8):
            s.put(prompt(i, 1), page_data(i, 1))
        assert s.lookup(prompt(0, 1)).cached_pages == 1
        assert s.unpin(prompt(0, 1)) == 1
        assert s.unpin(prompt(0, 1)) == 0
        for i in range(8, 12):
            s.put(prompt(i, 1), page_data(i, 1))
        assert s.lookup(prompt(0, 1)).cached_pages == 0


def test_all_pinned_means_dropped_not_evicted(tmp_path: Path) -> None:
    with Store.open(make_config(tmp_path / "s", 2, 0)) as s:
        s.put(prompt(0, 2), page_data(0, 2))
        s.pin(prompt(0, 2))
        res = s.put(prompt(5, 1), page_data(5, 1))
        assert (res.stored, res.dropped) == (0, 1)
        assert s.lookup(prompt(0, 2)).cached_pages == 2


def test_partial_prefix_and_extension(store: Store) -> None:
    tokens, data = prompt(3, 4), page_data(3, 4)
    store.put(tokens[: 2 * TPP + 5], data[:2])  # a partial third page gets no key
    r = store.lookup(tokens)
    assert (r.cached_pages, r.cached_tokens, r.total_pages) == (2, 2 * TPP, 4)
    res = store.put(tokens, data)
    assert (res.stored, res.already_present) == (2, 2)
    n, out = load(store, tokens, 4)
    assert n == 4 and np.array_equal(out, data)


def test_get_leaves_rows_past_the_hit_untouched(store: Store) -> None:
    tokens, data = prompt(4, 3), page_data(4, 3)
    store.put(tokens[: 2 * TPP], data[:2])
    out = np.full((3, PB), 7, dtype=np.uint8)
    assert store.get(tokens, out).pages == 2
    assert np.array_equal(out[:2], data[:2]) and (out[2] == 7).all()


def test_tenants_do_not_share_pages(store: Store) -> None:
    tokens = prompt(5, 2)
    store.put(tokens, page_data(5, 2), tenant="alice")
    assert store.lookup(tokens, tenant="alice").cached_pages == 2
    assert store.lookup(tokens, tenant="bob").cached_pages == 0
    assert store.lookup(tokens).cached_pages == 0


def test_reopen_after_close_finds_every_page(tmp_path: Path) -> None:
    cfg = make_config(tmp_path / "s", 4, 32)
    prompts = [(prompt(i, 3), page_data(i, 3)) for i in range(5)]
    with Store.open(cfg) as s:
        for tokens, data in prompts:
            s.put(tokens, data)
    with Store.open(cfg) as s:
        for tokens, data in prompts:
            n, out = load(s, tokens, 3)
            assert n == 3 and np.array_equal(out, data)


def test_prefetch_promotes_to_dram(store: Store) -> None:
    prompts = [(prompt(i, 2), page_data(i, 2)) for i in range(4)]
    for tokens, data in prompts:
        store.put(tokens, data)
    tokens, data = prompts[0]
    assert TierKind.NVME in store.lookup(tokens).tiers
    assert store.prefetch(tokens).result(timeout=30) == 2
    assert store.lookup(tokens).tiers == (TierKind.DRAM, TierKind.DRAM)
    n, out = load(store, tokens, 2)
    assert n == 2 and np.array_equal(out, data)


def test_read_only_second_open_sees_committed_pages(tmp_path: Path) -> None:
    cfg = make_config(tmp_path / "s", 0, 16)
    tokens, data = prompt(6, 3), page_data(6, 3)
    with Store.open(cfg) as writer:
        writer.put(tokens, data)
        writer.flush()                              # readers see what the group commit published
        with pytest.raises(StoreBusyError):
            Store.open(cfg)
        with Store.open(cfg, read_only=True) as reader:
            assert reader.lookup(tokens).cached_pages == 3
            n, out = load(reader, tokens, 3)
            assert n == 3 and np.array_equal(out, data)
            with pytest.raises(InputError):
                reader.put(tokens, data)


def test_writer_after_a_reader_in_one_process_is_refused_and_loses_nothing(tmp_path: Path) -> None:
    # LMDB gives one environment per file per process: a writer opened while a read-only
    # Store holds a read-only one must be refused, not take the env's ReadonlyError for a
    # damaged index and set every durable page aside.
    from tierkv.errors import ConfigError
    cfg = make_config(tmp_path / "s", 0, 8)
    tokens, data = prompt(2, 2), page_data(2, 2)
    with Store.open(cfg) as writer:
        writer.put(tokens, data)
    with Store.open(cfg, read_only=True) as reader:
        with pytest.raises(ConfigError, match="open read-only in this process"):
            Store.open(cfg)
        assert reader.lookup(tokens).cached_pages == 2
    assert not list((tmp_path / "s").glob("index.lmdb.corrupt-*"))
    with Store.open(cfg) as writer:
        n, out = load(writer, tokens, 2)
        assert n == 2 and np.array_equal(out, data)


def test_layout_mismatch_on_reopen_is_refused(tmp_path: Path) -> None:
    from dataclasses import replace

    from tierkv.errors import ConfigError
    cfg = make_config(tmp_path / "s", 0, 8)
    Store.open(cfg).close()
    tokens = np.arange(16 * 2, dtype=np.int64)
    with Store.open(cfg) as s:
        s.put(tokens, page_data(5, 2))
    data = Path(cfg.nvme_path())
    size = data.stat().st_size
    for other in (replace(cfg, layout=replace(LAYOUT, tokens_per_page=32)),   # a bigger page: a bigger file
                  replace(cfg, nvme=replace(cfg.nvme, capacity_bytes=16 * PB))):
        with pytest.raises(ConfigError, match="geometry"):
            Store.open(other)
        assert data.stat().st_size == size   # a refused open leaves the store as it was
    with Store.open(cfg) as s:              # and the original settings still open it, pages intact
        n, out = load(s, tokens, 2)
        assert n == 2 and np.array_equal(out, page_data(5, 2))


@pytest.mark.parametrize("bad,match", [
    (np.zeros((2, PB), dtype=np.float32), "uint8"),
    (np.zeros((2, PB + 1), dtype=np.uint8), "shape"),
    (np.zeros((2, PB * 2), dtype=np.uint8)[:, ::2], "contiguous"),
    (torch.zeros(2, *LAYOUT.page_shape, dtype=torch.float16), "dtype"),
    (torch.zeros(2, 3, dtype=torch.bfloat16), "shape"),
    (torch.zeros(2, *LAYOUT.page_shape, dtype=torch.bfloat16).transpose(1, 2), "contiguous"),
    (np.zeros((9, PB), dtype=np.uint8), "full pages"),
    ([[0] * PB], "torch.Tensor or numpy"),
])
def test_bad_pages_raise_input_error(store: Store, bad: object, match: str) -> None:
    with pytest.raises(InputError, match=match):
        store.put(prompt(7, 8), bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("tokens,match", [
    (np.zeros((2, 16), dtype=np.int64), "one-dimensional"),
    (np.array([1.5] * 16), "integers"),
    (np.array([-1] * 16), r"\[0, "),
    (np.array([1 << 33] * 16), r"\[0, "),
])
def test_bad_tokens_raise_input_error(store: Store, tokens: np.ndarray, match: str) -> None:
    with pytest.raises(InputError, match=match):
        store.lookup(tokens)


def test_oversize_batch_raises_capacity_error(tmp_path: Path) -> None:
    with Store.open(make_config(tmp_path / "s", 2, 4)) as s:
        with pytest.raises(CapacityError, match="hold"):
            s.put(prompt(8, 8), page_data(8, 8))


def test_read_only_output_buffer(store: Store) -> None:
    out = np.zeros((1, PB), dtype=np.uint8)
    out.flags.writeable = False
    with pytest.raises(InputError, match="read-only"):
        store.get(prompt(9, 1), out)


def test_closed_store_raises(store: Store) -> None:
    store.close()
    for call in (lambda: store.lookup(prompt(0, 1)), lambda: store.put(prompt(0, 1), page_data(0, 1)),
                 lambda: store.get(prompt(0, 1), np.zeros((1, PB), np.uint8)), lambda: store.pin(prompt(0, 1)),
                 lambda: store.prefetch(prompt(0, 1))):
        with pytest.raises(StoreClosedError):
            call()
    store.close()  # idempotent


def test_every_error_is_a_tierkv_error() -> None:
    for exc in (InputError, CapacityError, StoreBusyError, StoreClosedError):
        assert issubclass(exc, TierKVError)


def test_store_files_are_private(store: Store, store_config) -> None:  # type: ignore[no-untyped-def]
    root = Path(store_config.path)
    assert root.stat().st_mode & 0o077 == 0
    for p in [root / "nvme.data", root / "writer.lock", *(root / "index.lmdb").iterdir()]:
        assert p.stat().st_mode & 0o077 == 0, p


def test_extending_a_prompt_never_evicts_its_own_prefix(tmp_path: Path) -> None:
    with Store.open(make_config(tmp_path / "s", 4, 0, policy="lru")) as s:
        tokens, data = prompt(20, 4), page_data(20, 4)
        s.put(tokens[: 2 * TPP], data[:2])           # the prompt's first two pages: oldest
        s.put(prompt(21, 2), page_data(21, 2))       # DRAM is full
        assert s.put(tokens, data).stored == 2       # LRU alone would evict pages 0-1 here
        n, out = load(s, tokens, 4)
        assert n == 4 and np.array_equal(out, data)
        assert s.lookup(prompt(21, 2)).cached_pages == 0  # the other prompt made room


def test_importing_the_api_does_not_load_torch() -> None:
    # torch takes seconds to import (minutes in the emulated rig guest); a store without
    # an HBM tier and callers passing numpy pages never need it.
    import subprocess
    import sys
    code = "import sys, tierkv.store.api, tierkv.cli.main; assert 'torch' not in sys.modules, 'torch was imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_opening_a_dram_store_without_a_gpu_does_not_load_torch(tmp_path: Path) -> None:
    import subprocess
    import sys

    from tierkv.tiers.dram import _nvidia_driver
    if _nvidia_driver():
        pytest.skip("an NVIDIA driver is present: the DRAM tier pins its buffer through torch")
    code = ("import sys, numpy as np\n"
            "from tests.conftest import make_config, page_data, PB\n"
            "from tierkv.store.api import Store\n"
            f"s = Store.open(make_config({str(tmp_path / 's')!r}, 4, 8))\n"
            "t = np.arange(16, dtype=np.int64); s.put(t, page_data(0, 1)); s.close()\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])


def test_last_tier_keeps_a_parent_whose_child_lives_above(tmp_path: Path) -> None:
    # DRAM 2 pages over NVMe 2 pages, LRU. p is demoted to NVMe, then its child c is
    # stored in DRAM; when NVMe must make room, LRU's victim would be p (the oldest),
    # which would leave c in DRAM with no parent: the lookup of [p, c] would find nothing.
    cfg = make_config(tmp_path / "s", 2, 2, policy="lru", persist_on_close=False)
    p_tokens, c_tokens = prompt(1, 1), prompt(2, 1)
    pc = np.concatenate([p_tokens, c_tokens])
    with Store.open(cfg) as s:
        s.put(p_tokens, page_data(1, 1))
        s.put(prompt(3, 1), page_data(3, 1))                   # x1
        s.put(prompt(4, 1), page_data(4, 1))                   # x2: p goes down to NVMe
        s.put(pc, np.concatenate([page_data(1, 1), page_data(2, 1)]))  # c in DRAM, x1 down
        assert s.lookup(pc).tiers == (TierKind.NVME, TierKind.DRAM)
        s.put(prompt(5, 1), page_data(5, 1))                   # x2 down: NVMe must evict
        assert s.lookup(pc).tiers == (TierKind.NVME, TierKind.DRAM)
        n, out = load(s, pc, 2)
        assert n == 2 and np.array_equal(out, np.concatenate([page_data(1, 1), page_data(2, 1)]))
        assert s.lookup(prompt(3, 1)).cached_pages == 0      # x1 was evicted instead


def test_each_engine_thread_announces_its_own_requests(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two engine threads interleaving get and put: each request reaches the policies once."""
    from concurrent.futures import ThreadPoolExecutor

    seen: list[int] = []
    monkeypatch.setattr(store._manager, "note_request", lambda keys: seen.append(len(keys)))
    a, b = ThreadPoolExecutor(1), ThreadPoolExecutor(1)   # one thread each, like two engine workers
    ta, tb = np.arange(32, dtype=np.int64), np.arange(48, dtype=np.int64) + 7_000
    out = np.zeros((3, PB), np.uint8)
    try:
        a.submit(store.get, ta, out[:2]).result()
        b.submit(store.get, tb, out).result()
        a.submit(store.put, ta, page_data(1, 2)).result()
        b.submit(store.put, tb, page_data(2, 3)).result()
    finally:
        a.shutdown()
        b.shutdown()
    assert seen == [2, 3]


def test_tier_counters_count_real_reads_and_real_hits(tmp_path: Path) -> None:
    """A promoted hit is read from NVMe once (not once more for the copy up), and a
    prefetch reads without being a hit: per-tier hits add up to pages_hit."""
    cfg = make_config(tmp_path / "s", 4, 16)
    tokens, data = prompt(7, 3), page_data(7, 3)
    with Store.open(cfg) as s:
        s.put(tokens, data)
    with Store.open(cfg) as s:                       # reopened: the pages are on NVMe only
        n, out = load(s, tokens, 3)
        st = s.stats()
        assert n == 3 and np.array_equal(out, data) and st.promotions == 3
        assert st.tiers["nvme"].bytes_read == 3 * PB, "a promoted hit was counted as two reads"
        assert st.bytes_moved["nvme->caller"] == st.bytes_moved["nvme->dram"] == 3 * PB
        assert st.tiers["dram"].bytes_written == 3 * PB
    with Store.open(cfg) as s:
        assert s.prefetch(tokens).result(timeout=30) == 3
        st = s.stats()
        assert st.tiers["nvme"].hits == 0 and st.pages_hit == 0, "a prefetch is not a hit"
        assert "nvme->caller" not in st.bytes_moved and st.tiers["nvme"].bytes_read == 3 * PB
        assert load(s, tokens, 3)[0] == 3
        st = s.stats()
        assert st.tiers["dram"].hits == 3 and sum(t.hits for t in st.tiers.values()) == st.pages_hit == 3


def test_unpin_releases_what_pin_took_and_no_more(store: Store) -> None:
    tokens, data = prompt(9, 4), page_data(9, 4)
    store.put(tokens[:2 * TPP], data[:2])
    assert store.pin(tokens) == 2                   # pages 0-1 cached then
    store.put(tokens, data)                         # pages 2-3 arrive later, unpinned
    assert store.unpin(tokens) == 2
    assert store.unpin(tokens) == 0                 # nothing left to release, nothing below zero
    assert store.pin(tokens[:TPP]) == 1 and store.unpin(tokens) == 1


def pins_of(store: Store, tokens: np.ndarray) -> list[int | None]:
    from tierkv.keys import split_keys
    entries = [store._manager.entry(k) for k in split_keys(store._keys(tokens, ""))]
    return [e.pins if e is not None else None for e in entries]


def test_two_holders_of_one_prefix_each_release_their_own_pin(store: Store) -> None:
    # X pinned page 0 alone (pages 1-2 came later); W pinned 0-2. X's unpin must not eat
    # W's pin on page 1, or W's unpin leaves page 2 pinned for good.
    w_tokens, data = prompt(3, 3), page_data(3, 3)
    x_tokens = w_tokens[:2 * TPP]
    store.put(w_tokens[:TPP], data[:1])
    assert store.pin(x_tokens) == 1
    store.put(w_tokens, data)
    assert store.pin(w_tokens) == 3
    assert store.unpin(x_tokens) == 1
    assert pins_of(store, w_tokens) == [1, 1, 1]
    assert store.unpin(w_tokens) == 3
    assert pins_of(store, w_tokens) == [0, 0, 0]


def test_a_page_gone_and_stored_again_does_not_strand_the_pins_after_it(tmp_path: Path) -> None:
    import os

    from tierkv.keys import split_keys
    cfg = make_config(tmp_path / "s", 0, 8)
    tokens, data = prompt(4, 3), page_data(4, 3)
    with Store.open(cfg) as s:
        s.put(tokens, data)
        assert s.pin(tokens) == 3
        nvme = s._manager.tiers[0]
        slot = s._manager.entry(split_keys(s._keys(tokens, ""))[1]).slots[nvme.name]
        fd = os.open(cfg.nvme_path(), os.O_WRONLY)
        try:                                        # bit rot in page 1: it fails its checksum
            os.pwrite(fd, b"\xff" * 64, nvme.header_bytes + slot * nvme.slot_bytes)
        finally:
            os.close(fd)
        assert load(s, tokens, 3)[0] == 1
        s.put(tokens, data)                         # recomputed and stored again, unpinned
        assert pins_of(s, tokens) == [1, 0, 1]
        assert s.unpin(tokens) == 2                 # pages 0 and 2; page 1's pin left with it
        assert pins_of(s, tokens) == [0, 0, 0]


def test_a_second_close_waits_for_the_first_to_release_the_store(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    import threading
    cfg = make_config(tmp_path / "s", 4, 8)
    s = Store.open(cfg)
    s.put(prompt(1, 2), page_data(1, 2))
    inside, go = threading.Event(), threading.Event()
    shutdown = s._prefetcher.shutdown

    def slow_shutdown(wait: bool = True) -> None:    # a long prefetch still finishing
        inside.set()
        assert go.wait(30)
        shutdown(wait=wait)

    monkeypatch.setattr(s._prefetcher, "shutdown", slow_shutdown)
    first = threading.Thread(target=s.close)
    first.start()
    assert inside.wait(30)
    second = threading.Thread(target=s.close)
    second.start()
    second.join(0.3)
    waited = second.is_alive()
    go.set()
    assert waited, "the second close returned while the first still held the store"
    first.join(30)
    second.join(30)
    assert not first.is_alive() and not second.is_alive()
    with Store.open(cfg) as again:                  # released: the writer lock is free
        assert again.lookup(prompt(1, 2)).cached_pages == 2


def test_pages_a_promotion_pushes_out_are_counted(tmp_path: Path) -> None:
    # 2 DRAM + 4 NVMe pages hold three 2-page prompts; promoting prompt 0 into DRAM
    # demotes prompt 2 onto NVMe, which drops prompt 1: stats must say so.
    with Store.open(make_config(tmp_path / "s", 2, 4, promote_on_hit=True)) as s:
        for i in range(3):
            s.put(prompt(i, 2), page_data(i, 2))
        before = s.stats()
        assert load(s, prompt(0, 2), 2)[0] == 2
        after = s.stats()
        gone = sum(s.lookup(prompt(i, 2)).cached_pages == 0 for i in range(3))
        assert gone == 1 and after.promotions - before.promotions == 2
        assert after.pages_dropped - before.pages_dropped == 2
        assert after.evictions - before.evictions == 4     # 2 demoted to NVMe, 2 dropped from it


def test_a_pin_of_a_quarantined_page_is_not_matched_to_its_next_incarnation(tmp_path: Path) -> None:
    import os

    cfg = make_config(tmp_path / "s", 0, 8, promote_on_hit=False)
    a, b = prompt(20, 1), prompt(21, 1)
    with Store.open(cfg) as s:
        s.put(a, page_data(20, 1))
        assert s.pin(a) == 1
        nvme = s._manager.tiers[0]
        slot = s._manager.leading(s._keys(a, ""), 1)[0].slots[nvme.name]
        s.flush()
        fd = os.open(cfg.nvme_path(), os.O_WRONLY)
        try:                                        # bit rot: a's page fails its checksum and goes
            os.pwrite(fd, b"\xff" * 64, nvme.header_bytes + slot * nvme.slot_bytes)
        finally:
            os.close(fd)
        assert load(s, a, 1)[0] == 0
        s.put(b, page_data(21, 1))                  # b takes the freed row
        s.put(a, page_data(20, 1))                  # a comes back on another row
        assert s.pin(a) == 1
        assert s.unpin(a) == 0                      # the first pin: its page left, nothing to release
        assert pins_of(s, a) == [1]                 # the second holder's pin stands
        assert s.unpin(a) == 1
        assert pins_of(s, a) == [0]


@pytest.mark.parametrize("policy", ["gittins", "lru-leaf"])
def test_a_clean_close_writes_the_prefix_back_over_the_tail_of_a_full_nvme_tier(tmp_path: Path, policy: str) -> None:
    # DRAM holds a prompt's first 2 pages, a full NVMe tier the other 4: the write-back at
    # close makes room by evicting the tail, so a restart serves the longest prefix that fits.
    cfg = make_config(tmp_path / "s", 2, 4, policy=policy)
    tokens, data = prompt(30, 6), page_data(30, 6)
    with Store.open(cfg) as s:
        assert s.put(tokens, data).stored == 6
    with Store.open(cfg) as s:
        assert s.lookup(tokens).cached_pages == 4
        n, out = load(s, tokens, 4)
        assert n == 4 and np.array_equal(out, data[:4])


def test_lookup_by_keys_is_lookup_by_tokens(store: Store) -> None:
    from tierkv.keys import as_token_array, chain_keys, namespace_digest

    tokens, data = prompt(21, 3), page_data(21, 3)
    store.put(tokens, data, tenant="t")
    longer = np.concatenate([tokens, prompt(22, 2)])
    keys = chain_keys(as_token_array(longer), TPP, namespace_digest("test-model", LAYOUT, "t"))
    assert store.lookup_keys(keys) == store.lookup(longer, tenant="t")
    assert store.lookup_keys(keys).cached_pages == 3 and store.lookup_keys(b"").total_pages == 0
    for bad in (keys[:-1], "text"):
        with pytest.raises(InputError, match="16 per page"):
            store.lookup_keys(bad)  # type: ignore[arg-type]


def test_a_lookup_in_stretches_finds_a_cached_prefix_past_the_first_stretches(tmp_path: Path) -> None:
    """Lookups hash a stretch at a time and stop at the first miss (64 pages, then 512, ...):
    a prefix of 650 cached pages is found whole, as the lookup by every key finds it; a
    bad id in a stretch never hashed is still an InputError; each lookup counts once."""
    from tierkv.keys import as_token_array, chain_keys, namespace_digest

    n = 650
    tokens = np.arange(6000 * TPP, dtype=np.int64) * 7 + 3   # stretches: 64, 512, 4096, 1328 pages
    with Store.open(make_config(tmp_path / "s", dram_pages=n + 8, nvme_pages=0)) as s:
        assert s.put(tokens[:n * TPP], page_data(1, n)).stored == n
        before = s.stats().lookups
        found = s.lookup(tokens)
        assert (found.cached_pages, found.total_pages) == (n, 6000)
        every = chain_keys(as_token_array(tokens), TPP, namespace_digest("test-model", LAYOUT, ""))
        assert s.lookup_keys(every) == found
        assert s.lookup(tokens[:64 * TPP]).cached_pages == 64 and s.lookup(tokens[:576 * TPP]).cached_pages == 576
        assert s.lookup(tokens.tolist(), count=False) == found
        assert s.stats().lookups == before + 4   # the lookups by tokens, once each, and the one by keys
        bad = tokens.copy()
        bad[-1] = -1   # in the fourth stretch: the third holds the miss
        with pytest.raises(InputError, match=r"\[-1, "):
            s.lookup(bad)


def test_a_lookup_hashes_no_further_than_its_first_miss(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A new prompt hashes one stretch (64 pages); one whose first 100 pages are cached
    hashes the stretch that holds its first miss and stops (64 + 512)."""
    import types

    from tierkv import keys

    native = pytest.importorskip("tierkv._native", reason="the stretches count through the C chain")
    hashed: list[int] = []

    def counting(namespace: bytes, tokens: np.ndarray, tokens_per_page: int, n_pages: int) -> bytes:
        hashed.append(n_pages)
        return native.chain_xxh3_128(namespace, tokens, tokens_per_page, n_pages)  # type: ignore[no-any-return]

    tokens = np.arange(6000 * TPP, dtype=np.int64)
    with Store.open(make_config(tmp_path / "s", dram_pages=108, nvme_pages=0)) as s:
        assert s.put(tokens[:100 * TPP], page_data(2, 100)).stored == 100
        monkeypatch.setattr(keys, "_native", types.SimpleNamespace(chain_xxh3_128=counting,
                                                                   narrow_ids=native.narrow_ids))
        assert s.lookup(tokens + 1).cached_pages == 0
        assert hashed == [64]
        hashed.clear()
        assert s.lookup(tokens).cached_pages == 100
        assert hashed == [64, 512]


def test_a_caller_writing_its_buffer_during_a_get_cannot_poison_a_promoted_page(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """The caller's buffer may be shared (a node-service client's segment) or written by
    another thread: pages from NVMe are verified and promoted from the store's own buffer."""
    prompts = [(prompt(i, 2), page_data(i, 2)) for i in range(6)]   # DRAM holds 4: the first go to NVMe
    for tokens, data in prompts:
        store.put(tokens, data)
    tokens, data = prompts[0]
    assert store.lookup(tokens).tiers == (TierKind.NVME, TierKind.NVME)
    out = np.zeros((2, PB), np.uint8)
    read = store._transfers.read

    def read_then_scribble(lead, dst, serve=True):  # type: ignore[no-untyped-def]
        got = read(lead, dst, serve)
        out[:] = 0xEE            # the caller writes its buffer between the check and the promotion
        return got
    monkeypatch.setattr(store._transfers, "read", read_then_scribble)
    assert store.get(tokens, out).pages == 2
    monkeypatch.undo()
    assert store.lookup(tokens).tiers == (TierKind.DRAM, TierKind.DRAM)   # promoted
    again = np.zeros((2, PB), np.uint8)
    assert store.get(tokens, again).pages == 2 and np.array_equal(again, data)
