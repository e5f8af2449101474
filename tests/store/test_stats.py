"""``Store.stats()``: the snapshot as a dict is named for what it is (``to_dict``) and ``json.dumps``
takes it as is, derived figures included."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from tests.conftest import PB, make_config, page_data
from tierkv.store.api import Store


def test_to_dict_is_a_json_ready_dict(store: Store) -> None:
    pages = page_data(1, 3)
    tokens = np.arange(3 * 16, dtype=np.int64)
    store.put(tokens, pages)
    store.get(tokens, np.empty_like(pages))
    stats = store.stats()
    doc = stats.to_dict()
    assert isinstance(doc, dict) and not hasattr(stats, "to_json")
    assert json.loads(json.dumps(doc)) == doc
    assert doc["pages_stored"] == 3 and doc["pages_hit"] == 3 and doc["hit_rate"] == 1.0 and doc["misses"] == 0
    tiers = doc["tiers"]
    assert isinstance(tiers, dict)
    dram = tiers["dram"]
    assert dram["hits"] == 3 and dram["occupancy"] == dram["used_slots"] / dram["capacity_slots"]


def test_the_metadata_memory_shows_and_grows_with_the_pages(tmp_path: Path) -> None:
    """The page table's and each policy's memory, and the index file, as the store measures them."""
    from tierkv.policy.leaves import native_available

    with Store.open(make_config(tmp_path / "store", dram_pages=256, nvme_pages=3000)) as store:
        before = store.stats()
        assert before.page_table_bytes == store._manager.table.memory_bytes > 0
        n = 0
        for i in range(40):   # enough pages to grow the table and the policies past their first capacity
            tokens = np.arange(64 * 16, dtype=np.int64) + i * 64 * 16
            n += store.put(tokens, np.zeros((64, PB), np.uint8)).stored
        after = store.stats()
    assert n > 1024 and after.page_table_bytes > before.page_table_bytes
    for name, t in after.tiers.items():
        if native_available():
            assert t.policy_bytes is not None and t.policy_bytes > (before.tiers[name].policy_bytes or 0), name
        else:
            assert t.policy_bytes is None
    persistent = any(t.kind in ("nvme", "nvmeof") for t in after.tiers.values())
    assert (after.index_file_bytes > before.index_file_bytes) == persistent
    assert json.loads(json.dumps(after.to_dict()))["page_table_bytes"] == after.page_table_bytes


def test_stats_after_close_and_from_a_newer_or_older_daemon(tmp_path: Path) -> None:
    """A closed store still answers stats() (its index is gone: 0 bytes); a client takes a
    daemon's stats with fields it does not know, and without fields it knows."""
    from tierkv.serve.client import stats_of

    store = Store.open(make_config(tmp_path / "store"))
    tokens = np.arange(3 * 16, dtype=np.int64)
    store.put(tokens, page_data(1, 3))
    assert store.stats().index_file_bytes > 0
    store.close()
    closed = store.stats()
    assert closed.index_file_bytes == 0 and closed.pages_stored == 3
    doc: dict[str, Any] = closed.to_dict()
    newer = {**doc, "a_later_counter": 7, "tiers": {n: {**t, "a_later_figure": 1.0} for n, t in doc["tiers"].items()}}
    assert stats_of(newer) == closed
    older = {k: v for k, v in doc.items() if k not in ("page_table_bytes", "index_file_bytes")}
    older["tiers"] = {n: {k: v for k, v in t.items() if k != "policy_bytes"} for n, t in doc["tiers"].items()}
    got = stats_of(older)
    assert got.page_table_bytes == 0 and got.pages_stored == 3 and all(t.policy_bytes is None for t in got.tiers.values())
