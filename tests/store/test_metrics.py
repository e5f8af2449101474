"""The Prometheus exporter renders the store's real counters."""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import page_data
from tierkv.store.api import Store
from tierkv.store.metrics import StoreCollector

prometheus_client = pytest.importorskip("prometheus_client")


def test_exposition_carries_tier_counters(store: Store) -> None:
    tokens = np.arange(32)
    store.put(tokens, page_data(0, 2))
    store.get(tokens, np.zeros((2, page_data(0, 1).shape[1]), np.uint8))
    registry = prometheus_client.CollectorRegistry()
    registry.register(StoreCollector(store))
    text = prometheus_client.generate_latest(registry).decode()
    assert 'tierkv_tier_hits_total{tier="dram"} 2.0' in text
    assert 'tierkv_bytes_moved_total{dst="dram",src="caller"}' in text
    assert "tierkv_pages_stored_total 2.0" in text


def test_exposition_carries_per_tier_io_and_state(store: Store) -> None:
    tokens = np.arange(32)
    store.put(tokens, page_data(0, 2))
    registry = prometheus_client.CollectorRegistry()
    registry.register(StoreCollector(store))
    text = prometheus_client.generate_latest(registry).decode()
    st = store.stats()
    dram = st.tiers["dram"]
    assert f'tierkv_tier_written_bytes_total{{tier="dram"}} {float(dram.bytes_written)}' in text
    assert 'tierkv_tier_read_bytes_total{tier="dram"}' in text and 'tierkv_tier_io_seconds_total{tier="dram"}' in text
    assert 'tierkv_tier_available{tier="dram"} 1.0' in text and "tierkv_peer_pages_total 0.0" in text
