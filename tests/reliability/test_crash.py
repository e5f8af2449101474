"""Crash consistency: a writer killed with SIGKILL mid-storm loses only in-flight pages.

A child process runs put/get storms against one store (a small DRAM tier, so demotions
to the O_DIRECT NVMe tier, promotions back and LMDB commits run all the time) and is
killed at a random moment, again and again on the same store (10 times; 100 with
``--soak``), once with each ``[store] durability``: "put" (every batch synced and
committed before put returns) and "window" (group commit, 20 ms windows). After each kill
the parent reopens the store and checks that every page it returns has exactly the bytes
written for its key (and so its checksum), that no two pages share a slot, and that every
used NVMe slot is owned by an index record (space of lost in-flight writes is reclaimed).
The child compacts the index's runs every few commits, so kills land in compactions too.

A second test counts losses: the child puts new prompts into an NVMe-only store large
enough that nothing is evicted, and prints each prompt once it is acknowledged durable:
when its put returned ("put"), or when a ``flush()`` after it returned ("window"). After
each kill every acknowledged prompt must be served in full, byte for byte.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import PB, make_config, page_data
from tierkv.store.api import Store
from tierkv.keys import split_keys

ROOT = Path(__file__).resolve().parents[2]
PAGES = 3
N_PROMPTS = 300

CHILD = """
import sys
import numpy as np
from tests.conftest import PB, make_config, page_data
from tests.reliability.test_crash import prompt, PAGES, N_PROMPTS
from tierkv.store import manager
from tierkv.store.api import Store
manager.COMPACT_MIN, manager.COMPACT_CHUNK = 8, 24   # the index's runs compacted every few commits
rng = np.random.default_rng(int(sys.argv[2]))
store = Store.open(make_config(sys.argv[1], 4, 48, durability=sys.argv[3], commit_window_s=0.02))
print("ready", flush=True)
out = np.empty((PAGES, PB), dtype=np.uint8)
while True:
    i = int(rng.integers(N_PROMPTS))
    if rng.random() < 0.6:
        store.put(prompt(i), page_data(i, PAGES))
    else:
        store.get(prompt(i), out)          # hits on NVMe promote to DRAM
"""


def prompt(i: int) -> np.ndarray:
    return np.random.default_rng(i + 7).integers(0, 30000, PAGES * 16, dtype=np.int64)


def _kill_child_midway(path: Path, seed: int, durability: str, code: str = CHILD) -> str:
    """Run ``code`` on the store, SIGKILL it at a random moment; returns what it printed."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    child = subprocess.Popen([sys.executable, "-c", code, str(path), str(seed), durability], cwd=ROOT, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert child.stdout is not None
    line = child.stdout.readline()
    assert line.strip() == "ready", child.stderr.read() if child.stderr else line
    time.sleep(random.Random(seed).uniform(0.05, 0.5))  # the random moment of the crash
    child.send_signal(signal.SIGKILL)
    out, _ = child.communicate(timeout=30)
    assert child.returncode == -signal.SIGKILL
    return out


def _check_store(path: Path, durability: str) -> int:
    """Reopen after a crash; returns how many pages were served (all verified)."""
    found = 0
    with Store.open(make_config(path, 4, 48, durability=durability)) as s:
        m = s._manager
        nvme = s.stats().tiers["nvme"]
        # Every page the child ever stored is a page of one of these prompts.
        keys = {k for i in range(N_PROMPTS) for k in split_keys(s._keys(prompt(i), ""))}
        where = [m.locate(k) for k in keys]
        slots = [slot for loc in where if loc is not None for name, slot in loc.slots if name == "nvme"]
        assert len(slots) == len(set(slots)), "two pages share an NVMe slot"
        assert nvme.used_slots == len(slots), "used NVMe slots not owned by an index record"
        for i in range(N_PROMPTS):
            out = np.zeros((PAGES, PB), dtype=np.uint8)
            n = s.get(prompt(i), out).pages
            assert np.array_equal(out[:n], page_data(i, PAGES)[:n]), f"prompt {i}: wrong bytes returned"
            found += n
    return found


@pytest.mark.parametrize("durability", ["put", "window"])
def test_sigkill_storms_lose_only_in_flight_pages(tmp_path: Path, soak: bool, durability: str) -> None:
    path = tmp_path / "store"
    kills = 100 if soak else 10
    found = [0] * kills
    for attempt in range(kills):
        _kill_child_midway(path, attempt, durability)
        found[attempt] = _check_store(path, durability)
    assert max(found) > 0  # the crashes happened after real, durable writes


ACKED_PUTS = 100    # prompts one child life puts at most (then it waits to be killed)
ACK_CHILD = """
import sys, time
from tests.conftest import make_config, page_data
from tests.reliability.test_crash import prompt, PAGES, ACKED_PUTS, acked_capacity
from tierkv.store.api import Store
first, mode = int(sys.argv[2]) * ACKED_PUTS, sys.argv[3]
store = Store.open(make_config(sys.argv[1], 0, acked_capacity(), durability=mode, commit_window_s=0.02))
print("ready", flush=True)
waiting = []
for i in range(first, first + ACKED_PUTS):
    assert store.put(prompt(i), page_data(i, PAGES)).stored == PAGES
    waiting.append(i)
    if mode == "window" and len(waiting) % 4:
        continue                      # window mode: a barrier every 4 puts
    if mode == "window":
        store.flush()
    print(" ".join(map(str, waiting)), flush=True)
    waiting.clear()
time.sleep(60)
"""


def acked_capacity(kills: int = 100) -> int:
    """NVMe pages for every life's puts: nothing is ever evicted, so nothing may be lost."""
    return kills * ACKED_PUTS * PAGES


@pytest.mark.parametrize("durability", ["put", "window"])
def test_sigkill_loses_no_acknowledged_page(tmp_path: Path, soak: bool, durability: str) -> None:
    path = tmp_path / "store"
    kills = 100 if soak else 10
    acked: set[int] = set()
    for attempt in range(kills):
        printed = _kill_child_midway(path, attempt, durability, ACK_CHILD)
        acked |= {int(i) for i in printed.split()}
        with Store.open(make_config(path, 0, acked_capacity(), durability=durability)) as s:
            for i in sorted(acked):
                out = np.zeros((PAGES, PB), dtype=np.uint8)
                n = s.get(prompt(i), out).pages
                assert np.array_equal(out[:n], page_data(i, PAGES)[:n]), f"prompt {i}: wrong bytes returned"
                assert n == PAGES, f"{durability}: prompt {i} was acknowledged durable, {n} of {PAGES} pages came back"
    assert acked, "no put was acknowledged before the kills: the test checked nothing"
