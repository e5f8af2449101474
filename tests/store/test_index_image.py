"""The index image a clean close leaves: used only when nothing changed since, and then
the same store as walking LMDB gives (tierkv/store/index_image.py)."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.conftest import LAYOUT, PB, make_config, page_data
from tierkv.store import index_scan
from tierkv.store.api import Store
from tierkv.store.index import PersistentIndex
from tierkv.store.index_image import IMAGE, read_image, write_image
from tierkv.keys import PageKey

PROMPTS = 6
PAGES = 5          # per prompt: 30 pages on a 40-page NVMe tier, 4 of them in DRAM too


def _tokens(i: int) -> np.ndarray:
    return np.arange(i * 1000, i * 1000 + PAGES * LAYOUT.tokens_per_page, dtype=np.uint32)


def _build(path: Path) -> Path:
    with Store.open(make_config(path, dram_pages=4, nvme_pages=40)) as s:
        for i in range(PROMPTS):
            assert s.put(_tokens(i), page_data(i, PAGES)).stored == PAGES
    return path


def _all_there(path: Path) -> int:
    """Reopen, check every page's bytes; how many pages the NVMe tier held at open."""
    with Store.open(make_config(path, dram_pages=4, nvme_pages=40)) as s:
        held = len(s._manager)
        out = np.empty((PAGES, PB), dtype=np.uint8)
        for i in range(PROMPTS):
            assert s.get(_tokens(i), out).pages == PAGES
            assert np.array_equal(out, page_data(i, PAGES))
        s._manager.check()
    return held


@pytest.fixture
def walks(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The tiers whose records a reopen walked in LMDB."""
    seen: list[str] = []
    real = index_scan.scan_records

    def spy(index: Any, tier: str, *a: Any) -> Any:
        seen.append(tier)
        return real(index, tier, *a)

    monkeypatch.setattr("tierkv.store.manager.scan_records", spy)
    return seen


def test_a_clean_close_leaves_an_image_that_the_next_open_uses_instead_of_walking(
        tmp_path: Path, walks: list[str]) -> None:
    path = _build(tmp_path / "s")
    walks.clear()                   # the first open walked an empty index
    image = path / IMAGE
    assert image.exists() and stat.S_IMODE(image.stat().st_mode) == 0o600
    assert _all_there(path) == PROMPTS * PAGES
    assert walks == []
    assert image.exists()           # the close after that reopen wrote a fresh one
    assert _all_there(path) == PROMPTS * PAGES and walks == []


def test_a_commit_after_the_image_makes_it_stale(tmp_path: Path, walks: list[str]) -> None:
    path = _build(tmp_path / "s")
    walks.clear()                   # the first open walked an empty index
    # Another writer (or a tool) deletes a record after the clean close: the image still lists it.
    with Store.open(make_config(path, dram_pages=4, nvme_pages=40), read_only=True) as reader:
        key = PageKey(reader._keys(_tokens(0), "")[(PAGES - 1) * 16:PAGES * 16])
    index = PersistentIndex(path, ["nvme"], read_only=False)
    index.commit("nvme", delete=[key])
    index.close()
    with Store.open(make_config(path, dram_pages=4, nvme_pages=40)) as s:
        assert walks == ["nvme"]
        assert s.lookup(_tokens(0)).cached_pages == PAGES - 1     # from the index, not from the image
        assert len(s._manager) == PROMPTS * PAGES - 1


@pytest.mark.parametrize("damage", ["torn", "flipped", "no clean marker"])
def test_a_damaged_image_or_an_unclean_close_means_a_walk(tmp_path: Path, walks: list[str], damage: str) -> None:
    path = _build(tmp_path / "s")
    walks.clear()                   # the first open walked an empty index
    image = path / IMAGE
    data = bytearray(image.read_bytes())
    if damage == "torn":
        image.write_bytes(data[:len(data) // 2])
    elif damage == "flipped":
        data[len(data) // 3] ^= 0x40
        image.write_bytes(data)
    else:
        (path / "clean").unlink()
    assert _all_there(path) == PROMPTS * PAGES
    assert walks == ["nvme"]


@pytest.mark.parametrize("wrong", ["a slot out of range", "a record missing"])
def test_an_image_that_disagrees_with_the_index_sends_the_open_to_the_walk(tmp_path: Path, walks: list[str],
                                                                           wrong: str) -> None:
    path = _build(tmp_path / "s")
    walks.clear()                   # the first open walked an empty index
    index = PersistentIndex(path, ["nvme"], read_only=True)
    sid, txnid = index.store_id(), index.last_txnid()
    index.close()
    got = read_image(path, sid, txnid)
    assert set(got) == {"nvme"} and len(got["nvme"]) == PROMPTS * PAGES
    if wrong == "a slot out of range":
        got["nvme"].slot[0] = 10_000    # past the tier's 40 slots, yet stamped as current
    else:
        got["nvme"] = got["nvme"].take(np.arange(len(got["nvme"])) > 0)
    write_image(path, sid, txnid, got)
    assert _all_there(path) == PROMPTS * PAGES
    assert walks == ["nvme"]


def test_an_image_is_read_only_with_its_own_identity_and_transaction(tmp_path: Path) -> None:
    path = _build(tmp_path / "s")
    index = PersistentIndex(path, ["nvme"], read_only=True)
    sid, txnid = index.store_id(), index.last_txnid()
    index.close()
    assert len(read_image(path, sid, txnid)["nvme"]) == PROMPTS * PAGES
    assert read_image(path, os.urandom(16), txnid) == {}
    assert read_image(path, sid, txnid + 1) == {}
    assert read_image(tmp_path, sid, txnid) == {}     # none there


def test_the_image_matches_what_the_walk_reads(tmp_path: Path) -> None:
    path = _build(tmp_path / "s")
    index = PersistentIndex(path, ["nvme"], read_only=True)
    image = read_image(path, index.store_id(), index.last_txnid())["nvme"]
    index.close()
    index = PersistentIndex(path, ["nvme"], read_only=False)
    walked, others, dropped = index_scan.scan_records(index, "nvme", lambda a: np.ones(len(a), dtype=bool),
                                                      lambda r: True)
    index.close()
    assert not others and not dropped
    order = np.argsort(np.frombuffer(image.keys, dtype="V16"))
    for name in ("slot", "nbytes", "checksum", "has_parent"):
        assert np.array_equal(getattr(image, name)[order], getattr(walked, name)), name
    for name in ("keys", "parents"):
        assert np.frombuffer(getattr(image, name), dtype="V16")[order].tobytes() == getattr(walked, name), name


def test_a_record_flipped_on_disk_after_the_close_is_caught_by_the_walk_not_masked(
        tmp_path: Path, walks: list[str]) -> None:
    path = _build(tmp_path / "s")
    walks.clear()
    with Store.open(make_config(path, dram_pages=4, nvme_pages=40), read_only=True) as reader:
        key = PageKey(reader._keys(_tokens(2), "")[:16])
    index = PersistentIndex(path, ["nvme"], read_only=True)
    rec = index.get_many("nvme", [key])[0]
    index.close()
    assert rec is not None
    mdb = path / "index.lmdb" / "data.mdb"
    raw = bytearray(mdb.read_bytes())
    needle = rec.checksum.to_bytes(8, "little")
    hits = [i for i in range(len(raw) - 7) if raw[i:i + 8] == needle]
    assert hits
    for at in hits:
        raw[at] ^= 0xFF
    mdb.write_bytes(bytes(raw))     # no commit: LMDB's transaction id is the image's
    with Store.open(make_config(path, dram_pages=4, nvme_pages=40)) as s:
        assert walks == ["nvme"]    # the child's seal count refused the image
        assert s.lookup(_tokens(2)).cached_pages == 0   # the walk dropped the record, as without an image
        assert s.lookup(_tokens(3)).cached_pages == PAGES
