"""The codec inside the store: pages coded as they enter the NVMe and NVMe-oF tiers.

Round trips through every tier with ``codec`` none, lossless and auto, on real BF16 KV
pages (skipped where ``../shared/data/kv`` is absent) and on random bytes (which do not
compress and must still work at full size); capacity in pages growing with the ratio;
restarts keeping coded pages; damaged coded pages becoming misses, never wrong bytes.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tierkv.store.api import Store
from tierkv.bench.codec import DEFAULT_KV_DIR, kv_pages, load_kv
from tierkv.config import DramConfig, NvmeConfig, NvmeofConfig, StoreConfig
from tierkv.errors import ConfigError
from tierkv.store.index import IndexRecord, PersistentIndex
from tierkv.layout import DType, KVLayout
from tierkv.store.opening import LABEL_BYTES
from tierkv.tiers.aligned import ALIGN, round_up
from tierkv.tiers.blocks import BlockPageTier

KV_FILES = sorted(DEFAULT_KV_DIR.glob("*.safetensors")) if DEFAULT_KV_DIR.is_dir() else []
MODES = ("none", "lossless", "auto")
TPP = 16


@pytest.fixture(scope="module")
def real() -> tuple[KVLayout, np.ndarray]:
    """32 real SmolLM2 BF16 pages (36 KiB, 9 blocks each)."""
    if not KV_FILES:
        pytest.skip(f"no real KV data in {DEFAULT_KV_DIR}")
    return kv_pages(load_kv(KV_FILES[0])[1], TPP, DType.BF16)


def random_pages(n: int) -> tuple[KVLayout, np.ndarray]:
    layout = KVLayout(2, 2, 64, DType.BF16, TPP)
    return layout, np.random.default_rng(3).integers(0, 256, (n, layout.page_bytes), dtype=np.uint8)


@pytest.fixture(params=["real", "random"])
def data(request: pytest.FixtureRequest) -> tuple[KVLayout, np.ndarray]:
    if request.param == "real":
        return request.getfixturevalue("real")  # type: ignore[no-any-return]
    return random_pages(32)


def prompt(i: int, pages: int = 1) -> np.ndarray:
    return np.arange(pages * TPP, dtype=np.int64) + 100_000 * (i + 1)


def config(path: Path, layout: KVLayout, nvme_pages: int, codec: str, dram_pages: int = 0,
           **nvme: object) -> StoreConfig:
    slot = round_up(layout.page_bytes)
    return StoreConfig(path=str(path), model_id="m", layout=layout,
                       dram=DramConfig(dram_pages * layout.page_bytes) if dram_pages else None,
                       nvme=NvmeConfig(nvme_pages * slot, codec=codec, **nvme))  # type: ignore[arg-type]


def get_all(store: Store, tokens: np.ndarray, n: int, page_bytes: int) -> tuple[int, np.ndarray]:
    out = np.zeros((n, page_bytes), dtype=np.uint8)
    return store.get(tokens, out).pages, out


def records(path: Path, tier: str = "nvme") -> list[IndexRecord]:
    """Every index record of a tier, read straight from LMDB."""
    index = PersistentIndex(path, [tier], read_only=True)
    try:
        with index._env.begin(db=index._dbs[tier]) as txn:
            return [IndexRecord.unpack(k, v) for k, v in txn.cursor()]
    finally:
        index.close()


# -- round trips ------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_round_trip_through_dram_and_nvme_and_restart(tmp_path: Path, data: tuple[KVLayout, np.ndarray],
                                                      mode: str) -> None:
    layout, rows = data
    cfg = config(tmp_path / "s", layout, nvme_pages=64, codec=mode, dram_pages=4, bandwidth_gbps=0.002)
    with Store.open(cfg) as s:
        for i in range(8):  # 32 pages through a 4-page DRAM tier: most are demoted to NVMe
            assert s.put(prompt(i, 4), rows[4 * i:4 * i + 4]).stored == 4
        for i in range(8):
            n, out = get_all(s, prompt(i, 4), 4, layout.page_bytes)
            assert n == 4
            np.testing.assert_array_equal(out, rows[4 * i:4 * i + 4])
    with Store.open(cfg) as s:  # a restart: everything was written down at close
        for i in range(8):
            n, out = get_all(s, prompt(i, 4), 4, layout.page_bytes)
            assert n == 4
            np.testing.assert_array_equal(out, rows[4 * i:4 * i + 4])
        assert s.stats().corrupt_pages == 0


def test_lossless_codes_real_pages_and_stores_random_ones_raw(tmp_path: Path,
                                                             real: tuple[KVLayout, np.ndarray]) -> None:
    for name, (layout, rows) in {"real": real, "random": random_pages(32)}.items():
        bpp = round_up(layout.page_bytes) // ALIGN
        cfg = config(tmp_path / name, layout, nvme_pages=32, codec="lossless")
        with Store.open(cfg) as s:
            s.put(prompt(0, 32), rows)
        blocks = [sum(c for _, c in r.extents) for r in records(tmp_path / name)]
        assert len(blocks) == 32
        if name == "real":
            assert sum(blocks) <= 0.75 * 32 * bpp, blocks
        else:
            assert blocks == [bpp] * 32  # incompressible: raw, full size


def test_auto_follows_the_bandwidth(tmp_path: Path, real: tuple[KVLayout, np.ndarray]) -> None:
    layout, rows = real
    bpp = round_up(layout.page_bytes) // ALIGN
    # The codec encodes at 0.1-0.2 GB/s on a loaded 2-core VM: 2 MB/s is a tier it beats.
    for gbps, coded in ((0.002, True), (10_000.0, False)):
        path = tmp_path / str(gbps)
        with Store.open(config(path, layout, nvme_pages=32, codec="auto", bandwidth_gbps=gbps)) as s:
            assert s.stats().tiers["nvme"].codec == {
                "mode": "auto", "coding": None, "reason": "auto: nothing stored since the tier opened", "ratio": None,
                "encode_gbps": None, "decode_gbps": None, "write_gbps": gbps, "read_gbps": gbps}
            s.put(prompt(0, 32), rows)
            choice = s.stats().tiers["nvme"].codec
            json.dumps(s.stats().to_dict())   # the reason travels as JSON (tierkv status, the daemon)
        blocks = sum(sum(c for _, c in r.extents) for r in records(path))
        assert (blocks < 32 * bpp) is coded
        # stats() says what auto chose and why, with the figures it weighed
        assert choice is not None and choice["coding"] is coded and choice["mode"] == "auto"
        assert choice["read_gbps"] == choice["write_gbps"] == gbps
        figures = [choice[k] for k in ("ratio", "encode_gbps", "decode_gbps")]
        assert all(isinstance(f, float) for f in figures), figures
        assert 0.5 < float(figures[0]) < 0.75 and min(float(f) for f in figures) > 0   # type: ignore[arg-type]
        reason = str(choice["reason"])
        assert reason.startswith("auto, coded: faster both ways" if coded else "auto, raw: coding is not faster")
        assert f"tier read {gbps:.3g} and write {gbps:.3g} GB/s" in reason and "s/GiB coded vs" in reason


def test_auto_overlaps_coding_with_io_only_with_a_core_to_spare(real: tuple[KVLayout, np.ndarray]) -> None:
    """A batch larger than PIPELINE_BYTES is pipelined by the tier; auto counts its coding
    as overlapping the I/O only where the process has a core beyond the codec's threads
    (the I/O needs one), else as coded then moved, and says so in the reason."""
    import os

    from tierkv.codec import Codec, CodecMode
    from tierkv.store.coding import CodecChoice, spare_core

    cores = len(os.sched_getaffinity(0))
    assert spare_core(cores - 1) and not spare_core(cores) and not spare_core(cores + 1)
    if cores < 2:
        pytest.skip("one core: no codec thread count leaves a core to spare")
    layout, rows = real
    batch = np.tile(rows, (8, 1))   # 9.4 MB, 6.2 coded: more than one pipelined group each way
    reasons = {}
    for threads in (cores - 1, cores):
        with Codec(layout, threads=threads) as codec:
            choice = CodecChoice(CodecMode.AUTO, codec, hint_gbps=0.002)
            assert choice.compress(batch)   # 2 MB/s: coding wins either way
            reasons[threads] = str(choice.describe()["reason"])
    assert "read (pipelined) " in reasons[cores - 1] and "write (pipelined) " in reasons[cores - 1]
    assert reasons[cores].count("(pipelined, no core to spare: counted serial)") == 2


def test_stats_name_each_tiers_codec(tmp_path: Path, real: tuple[KVLayout, np.ndarray]) -> None:
    layout, rows = real
    for mode in MODES:
        with Store.open(config(tmp_path / mode, layout, nvme_pages=8, codec=mode, dram_pages=2)) as s:
            s.put(prompt(0, 4), rows[:4])
            tiers = s.stats().tiers
        assert tiers["dram"].codec is None   # no codec at the DRAM tier
        choice = tiers["nvme"].codec
        assert choice is not None and choice["mode"] == mode
        if mode == "none":
            assert choice["coding"] is False and choice["reason"] == "codec = none: pages are stored raw"
        elif mode == "lossless":
            assert choice["coding"] is True and choice["reason"] == "codec = lossless: every page is coded"
        else:   # no bandwidth hint: auto stores raw until it has measured the tier both ways
            assert choice["coding"] is False and "until the bandwidth of the tier is measured" in str(choice["reason"])


def test_auto_decides_on_each_tiers_own_pages(tmp_path: Path, real: tuple[KVLayout, np.ndarray],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    # The codec's speed is measured once per process, on whatever pages come first; the
    # ratio must not be: a first store of incompressible pages would otherwise keep
    # every later tier (and this one, after its data turns compressible) storing raw.
    import tierkv.store.coding as store_codec
    monkeypatch.setattr(store_codec, "_MEASURED", {})
    layout, rows = real
    bpp = round_up(layout.page_bytes) // ALIGN
    noise = np.random.default_rng(9).integers(0, 256, rows.shape, dtype=np.uint8)
    with Store.open(config(tmp_path / "a", layout, nvme_pages=64, codec="auto", bandwidth_gbps=0.002)) as s:
        s.put(prompt(0, 32), noise)                  # measured here, on noise: stored raw
        for i in range(store_codec._RESAMPLE_BATCHES + 1):
            s.put(prompt(1 + i), rows[i % 32][None])  # its pages turn compressible
    coded = [r for r in records(tmp_path / "a") if sum(c for _, c in r.extents) < bpp]
    assert coded, "the tier kept storing raw after its pages became compressible"
    with Store.open(config(tmp_path / "b", layout, nvme_pages=32, codec="auto", bandwidth_gbps=0.002)) as s:
        s.put(prompt(0, 32), rows)                   # another tier, real pages from its first batch
    blocks = sum(sum(c for _, c in r.extents) for r in records(tmp_path / "b"))
    assert blocks < 32 * bpp


# -- capacity -----------------------------------------------------------------------------------
def pages_held_before_evicting(path: Path, layout: KVLayout, rows: np.ndarray, codec: str, n: int) -> int:
    with Store.open(config(path, layout, nvme_pages=n, codec=codec)) as s:
        held = 0
        for i in range(4 * n):
            s.put(prompt(i), rows[i % len(rows)][None])
            if s.stats().evictions:
                break
            held += 1
        for i in range(4 * n):  # whatever is resident is exact
            got, out = get_all(s, prompt(i), 1, layout.page_bytes)
            if got:
                np.testing.assert_array_equal(out[0], rows[i % len(rows)])
        return held


def test_capacity_grows_with_lossless(tmp_path: Path, real: tuple[KVLayout, np.ndarray]) -> None:
    layout, rows = real
    n = 16
    assert pages_held_before_evicting(tmp_path / "none", layout, rows, "none", n) == n
    held = pages_held_before_evicting(tmp_path / "lossless", layout, rows, "lossless", n)
    assert held >= 1.3 * n, held


def test_full_tier_keeps_serving_exact_pages(tmp_path: Path, real: tuple[KVLayout, np.ndarray]) -> None:
    """Many evictions over a small block tier: fragmentation never returns wrong bytes."""
    layout, rows = real
    cfg = config(tmp_path / "s", layout, nvme_pages=8, codec="lossless", dram_pages=2)
    with Store.open(cfg) as s:
        for i in range(120):
            s.put(prompt(i % 40, 2), rows[(2 * i) % 32:(2 * i) % 32 + 2])
        hits = 0
        for i in range(40):
            got, out = get_all(s, prompt(i, 2), 2, layout.page_bytes)
            j = (2 * i) % 32
            np.testing.assert_array_equal(out[:got], rows[j:j + got])
            hits += got
        assert hits >= 8
        t = s.stats().tiers["nvme"]
        assert t.used_slots <= t.capacity_slots


# -- restart, switching codecs, damage --------------------------------------------------------------
def test_switching_codec_keeps_raw_pages_and_drops_coded_ones(tmp_path: Path,
                                                              real: tuple[KVLayout, np.ndarray]) -> None:
    layout, rows = real
    path = tmp_path / "s"
    with Store.open(config(path, layout, nvme_pages=32, codec="none")) as s:
        s.put(prompt(0, 8), rows[:8])
    with Store.open(config(path, layout, nvme_pages=32, codec="lossless")) as s:  # slot records, read as blocks
        n, out = get_all(s, prompt(0, 8), 8, layout.page_bytes)
        assert n == 8
        np.testing.assert_array_equal(out, rows[:8])
        s.put(prompt(1, 8), rows[8:16])
    with Store.open(config(path, layout, nvme_pages=32, codec="none")) as s:  # coded pages cannot live in slots
        n, out = get_all(s, prompt(0, 8), 8, layout.page_bytes)
        assert n == 8
        np.testing.assert_array_equal(out, rows[:8])
        assert get_all(s, prompt(1, 8), 8, layout.page_bytes)[0] == 0


@pytest.mark.parametrize("where", ["header", "payload"])
def test_damaged_coded_page_is_a_miss(tmp_path: Path, real: tuple[KVLayout, np.ndarray], where: str) -> None:
    layout, rows = real
    path = tmp_path / "s"
    cfg = config(path, layout, nvme_pages=32, codec="lossless")
    with Store.open(cfg) as s:
        s.put(prompt(0, 6), rows[:6])
    recs = {r.key: r for r in records(path)}
    # The 4th page of the prompt: find its record through its parent chain.
    chain = [r for r in recs.values() if r.parent is None]
    while len(chain) < 6:
        chain.append(next(r for r in recs.values() if r.parent == chain[-1].key))
    victim = chain[3]
    assert sum(c for _, c in victim.extents) < round_up(layout.page_bytes) // ALIGN  # it is coded
    first = victim.extents[0][0]
    offset = LABEL_BYTES + first * ALIGN + (3 if where == "header" else 2000)
    with open(path / "nvme.data", "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x10]))
    with Store.open(cfg) as s:
        n, out = get_all(s, prompt(0, 6), 6, layout.page_bytes)
        assert n == 3
        np.testing.assert_array_equal(out[:3], rows[:3])
        assert s.stats().corrupt_pages == 1
        assert s.lookup(prompt(0, 6)).cached_pages == 3  # quarantined


def test_format_2_store_opens_and_unknown_format_is_refused(tmp_path: Path) -> None:
    layout, rows = random_pages(4)
    path = tmp_path / "s"
    cfg = config(path, layout, nvme_pages=8, codec="none")
    with Store.open(cfg) as s:
        s.put(prompt(0, 4), rows)

    def set_format(v: int) -> None:
        index = PersistentIndex(path, ["nvme"])
        meta = json.loads(index._meta_get(b"store") or b"{}")
        meta["format"] = v
        index._meta_put(b"store", json.dumps(meta, sort_keys=True).encode())
        index.close()

    set_format(2)
    with Store.open(cfg) as s:
        n, out = get_all(s, prompt(0, 4), 4, layout.page_bytes)
        assert n == 4
        np.testing.assert_array_equal(out, rows)
    set_format(99)
    with pytest.raises(ConfigError, match="format 99"):
        Store.open(cfg)


# -- NVMe-oF -----------------------------------------------------------------------------------------
def test_nvmeof_tier_with_lossless(tmp_path: Path, real: tuple[KVLayout, np.ndarray]) -> None:
    layout, rows = real
    slots = 16
    dev = tmp_path / "ns1.img"
    with open(dev, "wb") as f:
        f.truncate(LABEL_BYTES + slots * round_up(layout.page_bytes))
    cfg = StoreConfig(path=str(tmp_path / "s"), model_id="m", layout=layout, dram=DramConfig(2 * layout.page_bytes),
                      nvmeof=NvmeofConfig(device=str(dev), io_timeout_s=5.0, codec="lossless"))
    with Store.open(cfg) as s:
        tier = s._manager.tiers[-1]
        assert isinstance(tier, BlockPageTier) and s.stats().tiers["nvmeof"].capacity_slots == slots
        for i in range(10):  # 20 pages: more than the namespace's 16 raw pages
            s.put(prompt(i, 2), rows[2 * i:2 * i + 2])
        assert s.stats().pages_dropped == 0  # the namespace holds every page that reaches it
        assert s.stats().tiers["nvmeof"].state == "available"
    with Store.open(cfg) as s:
        for i in range(10):
            n, out = get_all(s, prompt(i, 2), 2, layout.page_bytes)
            assert n == 2
            np.testing.assert_array_equal(out, rows[2 * i:2 * i + 2])


def test_reader_of_a_coded_store_decodes_its_pages(tmp_path: Path, real: tuple[KVLayout, np.ndarray]) -> None:
    """Read-only readers open the coded tier too and read each page at its recorded blocks."""
    layout, rows = real
    noise = np.random.default_rng(5).integers(0, 256, (4, layout.page_bytes), dtype=np.uint8)
    cfg = config(tmp_path / "s", layout, nvme_pages=32, codec="lossless")
    with Store.open(cfg) as s:
        s.put(prompt(0, 4), noise)
        s.put(prompt(1, 4), rows[:4])
        s.flush()                                   # readers see what the group commit published
        with Store.open(cfg, read_only=True) as reader:
            n, out = get_all(reader, prompt(0, 4), 4, layout.page_bytes)
            assert n == 4
            np.testing.assert_array_equal(out, noise)
            n, out = get_all(reader, prompt(1, 4), 4, layout.page_bytes)
            assert n == 4
            np.testing.assert_array_equal(out, rows[:4])
            # Pages the writer stores after the reader opened are seen too.
            s.put(prompt(2, 4), rows[4:8])
            s.flush()
            n, out = get_all(reader, prompt(2, 4), 4, layout.page_bytes)
            assert n == 4
            np.testing.assert_array_equal(out, rows[4:8])


def test_reader_serves_a_coded_prefix_longer_than_the_raw_capacity(tmp_path: Path) -> None:
    """A coded tier holds more pages than raw slots; a read-only opener must serve them all."""
    layout = KVLayout(2, 2, 64, DType.BF16, TPP)
    n = 8
    vals = np.random.default_rng(0).normal(0, 1, (n, layout.page_bytes // 2)).astype(np.float32)
    bf16 = (vals.view(np.uint32) >> 16).astype(np.uint16) & 0xFFF0   # low-entropy mantissas: they code small
    rows = bf16.view(np.uint8).reshape(n, layout.page_bytes).copy()
    cfg = config(tmp_path / "s", layout, 4, "lossless")
    tokens = prompt(0, n)
    with Store.open(cfg) as writer:
        for k in range(2, n + 1, 2):
            writer.put(tokens[:k * TPP], rows[:k])
        held, _ = get_all(writer, tokens, n, layout.page_bytes)
        assert held > 4  # more pages than the tier's raw slots
        writer.flush()
        with Store.open(cfg, read_only=True) as reader:
            got, out = get_all(reader, tokens, n, layout.page_bytes)
    assert got == held
    np.testing.assert_array_equal(out[:got], rows[:got])


def test_page_handles_past_32_bits_stay_exact_in_the_page_table(tmp_path: Path) -> None:
    """A coded tier's page handles come from a counter that never reuses one: after about
    4.3e9 writes they pass 2**32, which a 32-bit slot column wrapped (found in review)."""
    import itertools

    layout = KVLayout(2, 2, 64, DType.BF16, 16)
    pages = np.random.default_rng(3).integers(0, 256, (12, layout.page_bytes), dtype=np.uint8)
    cfg = StoreConfig(path=str(tmp_path / "s"), model_id="m", layout=layout,
                      nvme=NvmeConfig(8 * round_up(layout.page_bytes), codec="lossless"))
    with Store.open(cfg) as s:
        tier = next(t for t in s._manager.tiers if isinstance(t, BlockPageTier))
        tier._handles = itertools.count(2**32 - 3)   # as in a process that has run for days

        def prompt(i: int) -> np.ndarray:
            return np.arange(16, dtype=np.int64) + 100_000 * (i + 1)

        for i in range(12):                          # 8 pages fit: later puts evict earlier ones
            assert s.put(prompt(i), pages[i:i + 1]).stored == 1
        s._manager.check()
        out = np.empty((1, layout.page_bytes), dtype=np.uint8)
        served = [i for i in range(12) if s.get(prompt(i), out).pages]
        assert len(served) == 8
        for i in served:
            assert s.get(prompt(i), out).pages == 1 and np.array_equal(out[0], pages[i])
