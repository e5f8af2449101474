"""Reopening persistent tiers whose indexes disagree after a crash.

A demotion NVMe -> NVMe-oF commits the page's NVMe-oF record first and the NVMe delete
with a later commit; a crash in between leaves the key recorded in both tiers. Real
tiers (O_DIRECT files, the NVMe-oF tier over a file) and a real LMDB index.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import xxhash

from tierkv.store.index import IndexRecord, PersistentIndex
from tierkv.keys import PageKey
from tierkv.store.manager import BlockManager
from tierkv.policy import make_policy
from tierkv.tiers.aligned import round_up
from tierkv.tiers.base import TierId
from tierkv.tiers.nvme import NvmeTier
from tierkv.tiers.nvmeof import NvmeofTier, StaticLink

PAGE = 8192
K = PageKey(bytes(range(16)))
NVME, NVMEOF = TierId("nvme"), TierId("nvmeof")  # the tiers' names: their kinds' unless given others


@pytest.fixture
def parts(tmp_path: Path) -> Iterator[tuple[PersistentIndex, NvmeTier, NvmeofTier]]:
    ns = tmp_path / "ns.img"
    with open(ns, "wb") as f:
        f.truncate(8 * round_up(PAGE))
    nvme = NvmeTier(tmp_path / "nvme.data", 4, PAGE)
    fabric = NvmeofTier(StaticLink(ns), 8, PAGE)
    index = PersistentIndex(tmp_path, ["nvme", "nvmeof"])
    yield index, nvme, fabric
    nvme.close()
    fabric.close()
    index.close()


def manager(index: PersistentIndex, nvme: NvmeTier, fabric: NvmeofTier) -> BlockManager:
    m = BlockManager([nvme, fabric], {t.name: make_policy("lru") for t in (nvme, fabric)}, index)
    m.adopt_persistent(nvme.name)
    m.adopt_persistent(fabric.name)
    return m


def test_a_page_recorded_in_two_tiers_keeps_both_copies(parts: tuple[PersistentIndex, NvmeTier, NvmeofTier]) -> None:
    index, nvme, fabric = parts
    index.commit("nvme", put=[IndexRecord(K, 2, PAGE, 77, None)])
    index.commit("nvmeof", put=[IndexRecord(K, 5, PAGE, 77, None)])
    m = manager(index, nvme, fabric)
    loc = m.locate(K)
    assert loc is not None and dict(loc.slots) == {NVME: 2, NVMEOF: 5}
    assert m.used_slots(NVME) == 1 and m.used_slots(NVMEOF) == 1
    # Filling NVMe evicts K from it: no KeyError, no leaked slot, the NVMe-oF copy stays.
    new = [(PageKey(bytes([i]) * 16), None) for i in range(1, 5)]
    m.plan_store(new, PAGE)
    loc = m.locate(K)
    assert loc is not None and dict(loc.slots) == {NVMEOF: 5}
    assert m.used_slots(NVME) == 4


def test_a_key_recorded_with_other_bytes_in_another_tier_is_trusted_nowhere(
        parts: tuple[PersistentIndex, NvmeTier, NvmeofTier]) -> None:
    index, nvme, fabric = parts
    index.commit("nvme", put=[IndexRecord(K, 2, PAGE, 77, None)])
    index.commit("nvmeof", put=[IndexRecord(K, 5, PAGE, 78, None)])
    m = manager(index, nvme, fabric)
    assert m.locate(K) is None
    assert m.used_slots(NVME) == 0 and m.used_slots(NVMEOF) == 0
    assert index.get_many("nvme", [K]) == [None] and index.get_many("nvmeof", [K]) == [None]


def _key(i: int) -> PageKey:
    return PageKey(bytes([i]) * 16)


def test_bulk_adopt_keeps_whole_records_and_deletes_the_rest(parts: tuple[PersistentIndex, NvmeTier, NvmeofTier],
                                                             caplog: pytest.LogCaptureFixture) -> None:
    index, nvme, fabric = parts
    index.commit("nvme", put=[
        IndexRecord(_key(1), 0, PAGE, 11, None),
        IndexRecord(_key(2), 1, PAGE, 12, _key(1)),
        IndexRecord(_key(3), 1, PAGE, 13, _key(2)),          # shares slot 1 with key 2, later in key order
        IndexRecord(_key(4), 9, PAGE, 14, None),             # slot out of range (4 slots)
        IndexRecord(_key(5), 2, PAGE + 1, 15, None),         # longer than a slot
        IndexRecord(_key(6), 3, PAGE, 16, _key(9)),          # parent never recorded: a placeholder row
        IndexRecord(_key(7), 0, PAGE, 17, None, ((6, PAGE // 4096),)),   # block runs: slot 3 is taken
    ])
    sealed = IndexRecord(_key(8), 2, PAGE, 18, None).pack()
    with index._env.begin(db=index._dbs["nvme"], write=True) as txn:   # one flipped bit: fails its seal
        txn.put(_key(8), sealed[:-1] + bytes([sealed[-1] ^ 1]))
    m = BlockManager([nvme, fabric], {t.name: make_policy("lru") for t in (nvme, fabric)}, index)
    assert m.adopt_persistent(nvme.name) == 3
    assert sorted(e.key for e in m.snapshots()) == [_key(1), _key(2), _key(6)]
    e = m.entry(_key(2))
    assert e is not None and e.parent == _key(1) and e.checksum == 12 and e.slots == {NVME: 1}
    assert m.used_slots(NVME) == 3 and nvme.num_free == 1
    assert m.resident.prefix_len(_key(1) + _key(2) + _key(3)) == 2
    m.check()
    assert index.count("nvme") == 3                                    # the others were deleted
    assert "fail validation" in caplog.text and "seal" in caplog.text


def test_record_seals_in_c_match_the_python_seals(monkeypatch: pytest.MonkeyPatch) -> None:
    from tierkv.store import index_scan

    if index_scan._native is None:
        pytest.skip("tierkv._native is not built")
    rng = random.Random(7)
    size, body = index_scan.RECORD_DTYPE.itemsize, index_scan.RECORD_DTYPE.itemsize - 8
    keys, values = rng.randbytes(16 * 500), rng.randbytes(size * 500)
    native = index_scan._seals(keys, values, size, body)
    monkeypatch.setattr(index_scan, "_native", None)
    assert native.tolist() == index_scan._seals(keys, bytearray(values), size, body).tolist()
    assert native[3] == xxhash.xxh3_64_intdigest(keys[48:64] + values[3 * size:3 * size + body])
    monkeypatch.undo()
    with pytest.raises(ValueError, match="not one batch of records"):
        index_scan._native.seal_records(keys, values[:-1], 16, size, body)


@pytest.mark.parametrize("native", [True, False])
def test_records_packed_in_bulk_are_byte_for_byte_what_one_record_packs(monkeypatch: pytest.MonkeyPatch,
                                                                        native: bool) -> None:
    """The put path packs a batch's records from its columns; a reopen reads them as records."""
    import numpy as np

    from tierkv.store import index_scan

    if native and index_scan._native is None:
        pytest.skip("tierkv._native is not built")
    if not native:
        monkeypatch.setattr(index_scan, "_native", None)
    rng = random.Random(11)
    n = 300
    recs = [IndexRecord(PageKey(rng.randbytes(16)), rng.choice([0, 1, rng.getrandbits(32), rng.getrandbits(64)]),
                        rng.getrandbits(32), rng.getrandbits(64),
                        PageKey(rng.randbytes(16)) if rng.random() < 0.7 else None) for _ in range(n)]
    # Where a page has no parent the columns carry anything (the manager puts its own key there).
    parents = b"".join(r.parent or rng.randbytes(16) for r in recs)
    arrays = index_scan.RecordArrays(b"".join(r.key for r in recs), np.array([r.slot for r in recs], dtype=np.uint64),
                                     np.array([r.nbytes for r in recs], dtype=np.uint32),
                                     np.array([r.checksum for r in recs], dtype=np.uint64), parents,
                                     np.array([r.parent is not None for r in recs]))
    values = index_scan.packed_values(arrays)
    assert values == [r.pack() for r in recs]
    assert [IndexRecord.unpack(r.key, v) for r, v in zip(recs, values)] == recs


def test_packed_records_commit_and_reopen_as_records(parts: tuple[PersistentIndex, NvmeTier, NvmeofTier]) -> None:
    from tierkv.store.index import PackedRecords

    index, _, _ = parts
    recs = [IndexRecord(_key(1), 0, PAGE, 11, None), IndexRecord(_key(2), 1, PAGE, 12, _key(1))]
    packed = PackedRecords([r.key for r in recs], [r.pack() for r in recs])
    assert list(packed) == recs
    index.commit("nvme", put=packed)
    assert index.get_many("nvme", [_key(1), _key(2), _key(3)]) == [*recs, None]
    with pytest.raises(ValueError, match="2 keys for 1 packed records"):
        PackedRecords(packed.keys, packed.values[:1])
