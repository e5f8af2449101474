"""``Store.stats()``: the snapshot as a dict is named for what it is (``to_dict``) and ``json.dumps``
takes it as is, derived figures included."""

from __future__ import annotations

import json
from pathlib import Path

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
