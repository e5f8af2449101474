"""``Store.stats()``: the snapshot as a dict is named for what it is (``to_dict``) and ``json.dumps``
takes it as is, derived figures included."""

from __future__ import annotations

import json

import numpy as np

from tests.conftest import page_data
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
