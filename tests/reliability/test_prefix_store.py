"""The prefix invariant in the real store: no cached page outlives its parent, in any tier.

A small DRAM tier over a small NVMe tier (O_DIRECT file, LMDB index), prompts that
share, extend and repeat each other, pins: pages leave DRAM leaves first, so a child
is demoted before its parent, and the NVMe tier must neither evict the parent under it
nor let the parent drop for want of room (both happened; found by a review).
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import LAYOUT, PB, make_config
from tierkv.store.api import Store

TPP = LAYOUT.tokens_per_page


@pytest.mark.parametrize("policy", ["gittins", "lru-leaf"])
@pytest.mark.parametrize("seed", range(3))
def test_no_cached_page_outlives_its_parent(tmp_path: Path, policy: str, seed: int) -> None:
    rng = random.Random(seed)
    prompts: list[list[int]] = []
    pinned: list[list[int]] = []
    nxt = 1
    buf = np.zeros((12, PB), np.uint8)
    with Store.open(make_config(tmp_path / "s", dram_pages=4, nvme_pages=16, policy=policy)) as s:
        m = s._manager
        for step in range(300):
            x = rng.random()
            if prompts and x < 0.35:
                toks = list(rng.choice(prompts))
            elif prompts and x < 0.8:
                base = rng.choice(prompts)
                cut, n = rng.randint(0, len(base) // TPP) * TPP, rng.randint(1, 5) * TPP
                toks, nxt = base[:cut] + list(range(nxt, nxt + n)), nxt + n
            else:
                n = rng.randint(1, 6) * TPP
                toks, nxt = list(range(nxt, nxt + n)), nxt + n
            toks = toks[:12 * TPP]
            prompts = (prompts + [toks])[-40:]
            pages = len(toks) // TPP
            s.get(toks, buf[:pages])
            s.put(toks, np.full((pages, PB), step % 251, np.uint8))
            y = rng.random()
            if y < 0.1:
                s.pin(toks)
                pinned.append(toks)
            elif y < 0.2 and pinned:
                s.unpin(pinned.pop(rng.randrange(len(pinned))))
            held = {e.key: e for e in m.snapshots()}
            orphans = [k for k, e in held.items() if e.parent is not None and e.parent not in held]
            assert not orphans, f"step {step}: {len(orphans)} cached pages without their parent"
            m.check()
            for t in m.tiers:
                mine = sum(1 for e in held.values() if t.name in e.slots)
                assert t.num_slots - t.num_free == mine == len(m._policies[t.name])
