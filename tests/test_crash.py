"""Crash consistency: a writer killed with SIGKILL mid-write loses only in-flight pages.

A child process stores deterministic pages in a loop, with a small DRAM tier so that
demotions to the O_DIRECT NVMe tier and LMDB commits run all the time; the parent
kills it at a random moment, reopens the store and checks that every page it returns
has exactly the bytes written for its key, and that slot accounting matches the index.
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
from tierkv.api import Store

ROOT = Path(__file__).resolve().parent.parent
PAGES = 3
N_PROMPTS = 400

CHILD = """
import sys
import numpy as np
from tests.conftest import make_config, page_data
from tests.test_crash import prompt, PAGES, N_PROMPTS
from tierkv.api import Store
store = Store.open(make_config(sys.argv[1], 4, 48))
print("ready", flush=True)
for round_ in range(1000):
    for i in range(N_PROMPTS):
        store.put(prompt(i), page_data(i, PAGES))
"""


def prompt(i: int) -> np.ndarray:
    return np.random.default_rng(i + 7).integers(0, 30000, PAGES * 16, dtype=np.int64)


def _kill_child_midway(path: Path, seed: int) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(path)], cwd=ROOT, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert child.stdout is not None
    line = child.stdout.readline()
    assert line.strip() == "ready", child.stderr.read() if child.stderr else line
    time.sleep(random.Random(seed).uniform(0.05, 0.6))  # the random moment of the crash
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL


def _check_store(path: Path) -> int:
    found = 0
    with Store.open(make_config(path, 4, 48)) as s:
        st = s.stats().tiers["nvme"]
        assert st.used_slots == len(s._manager)  # every used slot is owned by an index record
        for i in range(N_PROMPTS):
            out = np.zeros((PAGES, PB), dtype=np.uint8)
            n = s.get(prompt(i), out).pages
            assert np.array_equal(out[:n], page_data(i, PAGES)[:n]), f"prompt {i}: wrong bytes returned"
            found += n
    return found


def test_sigkill_during_writes_loses_only_in_flight_pages(tmp_path: Path) -> None:
    path = tmp_path / "store"
    total_found = 0
    for attempt in range(4):
        _kill_child_midway(path, attempt)
        total_found += _check_store(path)
    assert total_found > 0  # the crashes happened after real, durable writes
