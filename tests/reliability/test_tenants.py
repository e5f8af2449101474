"""Tenant isolation: the same tokens under different salts never share a page, on any
tier and through every path, and a lookup tells one tenant nothing of another's cache."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tests.conftest import PB, make_config, page_data
from tierkv.store.api import Store
from tierkv.keys import namespace_digest, page_keys
from tierkv.tiers.base import TierKind

TENANTS = ("alice", "bob", "")


def tokens() -> np.ndarray:
    return np.arange(64, dtype=np.int64)  # 4 pages, the same for every tenant


def data(t: int) -> np.ndarray:
    return page_data(100 + t, 4)


def load(store: Store, tenant: str) -> tuple[int, np.ndarray]:
    out = np.zeros((4, PB), dtype=np.uint8)
    return store.get(tokens(), out, tenant=tenant).pages, out


def test_keys_differ_per_tenant() -> None:
    from tests.conftest import LAYOUT
    keys = [set(page_keys(tokens(), LAYOUT, namespace_digest("m", LAYOUT, t))) for t in TENANTS]
    assert not (keys[0] & keys[1]) and not (keys[0] & keys[2]) and not (keys[1] & keys[2])


def test_every_path_keeps_tenants_apart(tmp_path: Path) -> None:
    # DRAM holds one tenant's prompt: the rest demote. LRU, so that which tier holds
    # what is predictable; tenant isolation does not depend on the policy.
    cfg = make_config(tmp_path / "s", 4, 64, policy="lru")
    with Store.open(cfg) as s:
        for t, name in enumerate(TENANTS[:2]):
            assert s.put(tokens(), data(t), tenant=name).stored == 4
        assert TierKind.NVME in s.lookup(tokens(), tenant="alice").tiers  # alice was demoted
        for t, name in enumerate(TENANTS[:2]):
            n, out = load(s, name)
            assert n == 4 and np.array_equal(out, data(t))
        assert s.prefetch(tokens(), tenant="alice").result(timeout=30) == 4
        n, out = load(s, "alice")
        assert n == 4 and np.array_equal(out, data(0))
        assert s.lookup(tokens(), tenant="").cached_pages == 0
    with Store.open(cfg) as s:  # the persisted index after a restart
        for t, name in enumerate(TENANTS[:2]):
            n, out = load(s, name)
            assert n == 4 and np.array_equal(out, data(t))
        assert s.lookup(tokens(), tenant="mallory").cached_pages == 0
    with Store.open(cfg, read_only=True) as r:  # and a second process's view
        assert r.lookup(tokens(), tenant="mallory").cached_pages == 0
        n, out = load(r, "bob")
        assert n == 4 and np.array_equal(out, data(1))


def test_lookup_reveals_nothing_about_other_tenants(tmp_path: Path) -> None:
    with Store.open(make_config(tmp_path / "a", 4, 16)) as empty, Store.open(make_config(tmp_path / "b", 4, 16)) as busy:
        busy.put(tokens(), data(0), tenant="alice")
        busy.pin(tokens(), tenant="alice")
        assert busy.lookup(tokens(), tenant="bob") == empty.lookup(tokens(), tenant="bob")
        assert busy.lookup(tokens(), tenant="bob").tier_ranks == b""
        n, out = load(busy, "bob")
        assert n == 0 and not out.any()
