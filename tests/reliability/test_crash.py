"""Crash consistency: a writer killed with SIGKILL mid-storm loses only in-flight pages.

A child process runs put/get storms against one store (a small DRAM tier, so demotions
to the O_DIRECT NVMe tier, promotions back and LMDB commits run all the time) and is
killed at a random moment, again and again on the same store (10 times; 100 with
``--soak``). After each kill the parent reopens the store and checks that every page it
returns has exactly the bytes written for its key (and so its checksum), that no two
pages share a slot, and that every used NVMe slot is owned by an index record (space of
lost in-flight writes is reclaimed).
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

from tests.conftest import PB, make_config, page_data
from tierkv.store.api import Store
from tierkv.tiers.base import TierId

ROOT = Path(__file__).resolve().parents[2]
PAGES = 3
N_PROMPTS = 300

CHILD = """
import sys
import numpy as np
from tests.conftest import PB, make_config, page_data
from tests.reliability.test_crash import prompt, PAGES, N_PROMPTS
from tierkv.store.api import Store
rng = np.random.default_rng(int(sys.argv[2]))
store = Store.open(make_config(sys.argv[1], 4, 48))
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


def _kill_child_midway(path: Path, seed: int) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(path), str(seed)], cwd=ROOT, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert child.stdout is not None
    line = child.stdout.readline()
    assert line.strip() == "ready", child.stderr.read() if child.stderr else line
    time.sleep(random.Random(seed).uniform(0.05, 0.5))  # the random moment of the crash
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL


def _check_store(path: Path) -> int:
    """Reopen after a crash; returns how many pages were served (all verified)."""
    found = 0
    with Store.open(make_config(path, 4, 48)) as s:
        m = s._manager
        nvme = s.stats().tiers["nvme"]
        slots = [m.entry(k).slots[TierId("nvme")] for k in list(m._entries)]  # type: ignore[union-attr]
        assert len(slots) == len(set(slots)), "two pages share an NVMe slot"
        assert nvme.used_slots == len(slots), "used NVMe slots not owned by an index record"
        for i in range(N_PROMPTS):
            out = np.zeros((PAGES, PB), dtype=np.uint8)
            n = s.get(prompt(i), out).pages
            assert np.array_equal(out[:n], page_data(i, PAGES)[:n]), f"prompt {i}: wrong bytes returned"
            found += n
    return found


def test_sigkill_storms_lose_only_in_flight_pages(tmp_path: Path, soak: bool) -> None:
    path = tmp_path / "store"
    kills = 100 if soak else 10
    found = [0] * kills
    for attempt in range(kills):
        _kill_child_midway(path, attempt)
        found[attempt] = _check_store(path)
    assert max(found) > 0  # the crashes happened after real, durable writes
