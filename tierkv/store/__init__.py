"""The store's runtime: :class:`~tierkv.store.api.Store` and what it is built from.

- :mod:`~tierkv.store.api`: the public ``Store`` (put, get, lookup, pin, stats, close);
  :mod:`~tierkv.store.opening` builds its tiers, index and manager from a config.
- :mod:`~tierkv.store.manager`: the block manager, which plans where pages live and
  never touches bytes; :mod:`~tierkv.store.moves` the plans it hands out;
  :mod:`~tierkv.store.pins` the pin ledger.
- :mod:`~tierkv.store.transfer`: executes plans through one ``(src, dst)`` copy table;
  :mod:`~tierkv.store.pages` and :mod:`~tierkv.store.checksum` the page buffers and
  their checksums; :mod:`~tierkv.store.coding` the codec choice at tier boundaries.
- :mod:`~tierkv.store.index` and :mod:`~tierkv.store.index_check`: the LMDB index of
  persistent tiers and its check in a child process.
- :mod:`~tierkv.store.peering`: peer DRAM tiers of other nodes;
  :mod:`~tierkv.store.results`, :mod:`~tierkv.store.stats` and
  :mod:`~tierkv.store.metrics`: what callers get back and the Prometheus exporter.

Nothing is imported here: ``from tierkv import Store`` loads what it needs on first use.
"""
