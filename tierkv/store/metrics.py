"""Optional Prometheus exporter of a store's counters (needs ``prometheus_client``).

``start_exporter(store, port)`` serves ``/metrics`` from a background thread; each
scrape takes one ``store.stats()`` snapshot, so the hot path pays nothing. Metric
names are prefixed ``tierkv_``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from tierkv.errors import ConfigError

if TYPE_CHECKING:
    from tierkv.store.api import Store


class StoreCollector:
    """A prometheus_client collector over one store."""

    def __init__(self, store: Store) -> None:
        self._store = store

    def collect(self) -> Iterator[object]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        st = self._store.stats()
        hits = CounterMetricFamily("tierkv_tier_hits", "Pages served from each tier (peer: from other nodes)",
                                   labels=["tier"])
        used = GaugeMetricFamily("tierkv_tier_used_slots", "Occupied slots per tier", labels=["tier"])
        cap = GaugeMetricFamily("tierkv_tier_capacity_slots", "Slots per tier", labels=["tier"])
        read = CounterMetricFamily("tierkv_tier_read_bytes", "Bytes read from each tier", labels=["tier"])
        written = CounterMetricFamily("tierkv_tier_written_bytes", "Bytes written to each tier", labels=["tier"])
        io_s = CounterMetricFamily("tierkv_tier_io_seconds", "Seconds spent in each tier's I/O", labels=["tier"])
        up = GaugeMetricFamily("tierkv_tier_available", "1 while the tier is reachable, 0 while degraded",
                               labels=["tier"])
        policy = GaugeMetricFamily("tierkv_tier_policy_bytes", "Memory of each tier's eviction policy "
                                   "(tiers whose policy cannot tell are left out)", labels=["tier"])
        for name, t in st.tiers.items():
            if t.policy_bytes is not None:
                policy.add_metric([name], t.policy_bytes)
            hits.add_metric([name], t.hits)
            used.add_metric([name], t.used_slots)
            cap.add_metric([name], t.capacity_slots)
            read.add_metric([name], t.bytes_read)
            written.add_metric([name], t.bytes_written)
            io_s.add_metric([name], t.io_seconds)
            up.add_metric([name], 1.0 if t.state == "available" else 0.0)
        if st.peer_pages:       # so that the tiers' hits add up to pages_hit
            hits.add_metric(["peer"], st.peer_pages)
        moved = CounterMetricFamily("tierkv_bytes_moved", "Bytes moved per tier pair", labels=["src", "dst"])
        for pair, nbytes in st.bytes_moved.items():
            src, dst = pair.split("->")
            moved.add_metric([src, dst], nbytes)
        yield from (hits, used, cap, read, written, io_s, up, policy, moved)
        yield GaugeMetricFamily("tierkv_page_table_bytes",
                                "Memory of the page table (per-page columns; keys and map unless in a policy's key table)",
                                value=st.page_table_bytes)
        yield GaugeMetricFamily("tierkv_index_file_bytes", "Bytes of the persistent index file in use",
                                value=st.index_file_bytes)
        for field in ("lookups", "pages_requested", "pages_hit", "pages_stored", "pages_dropped",
                      "evictions", "promotions", "corrupt_pages", "peer_pages", "derived_pages", "lossy_pages",
                      "lossy_converted"):
            yield CounterMetricFamily(f"tierkv_{field}", f"Store-wide {field.replace('_', ' ')}",
                                      value=getattr(st, field))
        yield GaugeMetricFamily("tierkv_lossy_pending", "Pages queued for the lossy tier's conversion",
                                value=st.lossy_pending)
        yield GaugeMetricFamily("tierkv_lossy_waiting", "Pages the lossy tier keeps back (children, pins)",
                                value=st.lossy_waiting)


def start_exporter(store: Store, port: int, addr: str = "127.0.0.1") -> object:
    """Serve the store's metrics on ``http://addr:port/metrics``; returns the registry."""
    try:
        from prometheus_client import CollectorRegistry, start_http_server
    except ImportError:
        raise ConfigError("the Prometheus exporter needs prometheus_client: pip install 'tierkv[metrics]'") from None
    registry = CollectorRegistry()
    registry.register(StoreCollector(store))  # type: ignore[arg-type]
    start_http_server(port, addr=addr, registry=registry)
    return registry
