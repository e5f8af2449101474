"""Concurrency: threads doing put, get, lookup, prefetch, pin, unpin and eviction at once.

For a bounded time (3 s; 60 s with ``--soak``) worker threads hammer one store with a
small DRAM tier over an NVMe tier, while a monitor checks capacities and a pin keeper
checks that its pinned prompt never leaves the store. Every get is verified byte for
byte. A watchdog fails the test if any thread is still running well past the deadline
(a deadlock), and a read-only reader process shares the store the whole time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import tierkv.store.api as api
from tests.conftest import PB, make_config, page_data
from tierkv.store.api import Store

ROOT = Path(__file__).resolve().parents[2]
PAGES = 2
N_PROMPTS = 40
PINNED = 999

READER = """
import json, sys, time
import numpy as np
from tests.conftest import PB, make_config, page_data
from tests.reliability.test_concurrency import prompt, PAGES, N_PROMPTS
from tierkv.store.api import Store
served = wrong = 0
deadline = time.monotonic() + float(sys.argv[2])
with Store.open(make_config(sys.argv[1], 4, 64), read_only=True) as store:
    while time.monotonic() < deadline:
        for i in range(N_PROMPTS):
            out = np.zeros((PAGES, PB), dtype=np.uint8)
            n = store.get(prompt(i), out).pages
            served += n
            wrong += int(not np.array_equal(out[:n], page_data(i, PAGES)[:n]))
print(json.dumps({"served": served, "wrong": wrong}), flush=True)
"""


def prompt(i: int) -> np.ndarray:
    return np.arange(PAGES * 16, dtype=np.int64) + 100_000 * (i + 1)


class Harness:
    """Shared state of one run: failures are collected, the deadline is common."""

    def __init__(self, store: Store, seconds: float) -> None:
        self.store = store
        self.deadline = time.monotonic() + seconds
        self.errors: list[str] = []
        self.ops = 0
        self._lock = threading.Lock()

    def running(self) -> bool:
        return time.monotonic() < self.deadline and not self.errors

    def fail(self, msg: str) -> None:
        with self._lock:
            self.errors.append(msg)

    def count(self) -> None:
        with self._lock:
            self.ops += 1


def worker(h: Harness, seed: int) -> None:
    rng = np.random.default_rng(seed)
    out = np.empty((PAGES, PB), dtype=np.uint8)
    while h.running():
        i = int(rng.integers(N_PROMPTS))
        op = rng.random()
        if op < 0.35:
            h.store.put(prompt(i), page_data(i, PAGES))
        elif op < 0.7:
            n = h.store.get(prompt(i), out).pages
            if not np.array_equal(out[:n], page_data(i, PAGES)[:n]):
                h.fail(f"wrong bytes for prompt {i}")
        elif op < 0.8:
            h.store.lookup(prompt(i))
        elif op < 0.9:
            h.store.prefetch(prompt(i)).result(timeout=30)
        else:
            if h.store.pin(prompt(i)):
                h.store.unpin(prompt(i))
        h.count()


def pin_keeper(h: Harness) -> None:
    """Pins one prompt and checks it stays cached while other threads evict around it."""
    h.store.put(prompt(PINNED), page_data(PINNED, PAGES))
    if h.store.pin(prompt(PINNED)) != PAGES:
        h.fail("could not pin the keeper's pages")
        return
    out = np.empty((PAGES, PB), dtype=np.uint8)
    while h.running():
        if h.store.lookup(prompt(PINNED)).cached_pages != PAGES:
            h.fail("a pinned page was evicted")
        n = h.store.get(prompt(PINNED), out).pages
        if n != PAGES or not np.array_equal(out, page_data(PINNED, PAGES)):
            h.fail("pinned pages came back wrong or missing")
    h.store.unpin(prompt(PINNED))


def monitor(h: Harness) -> None:
    while h.running():
        for name, t in h.store.stats().tiers.items():
            if t.used_slots > t.capacity_slots:
                h.fail(f"{name} holds {t.used_slots} of {t.capacity_slots} slots")


def guarded(h: Harness, fn: Callable[[], None]) -> Callable[[], None]:
    """Any exception in a thread fails the test (a thread must not die silently)."""
    def run() -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - reported through the harness
            h.fail(f"{type(exc).__name__}: {exc}")
    return run


def run_threads(targets: list[Callable[[], None]], grace_s: float, deadline: float) -> list[threading.Thread]:
    threads = [threading.Thread(target=t, daemon=True) for t in targets]
    for t in threads:
        t.start()
    for t in threads:  # the watchdog: a thread alive long past the deadline is stuck
        t.join(timeout=max(0.0, deadline - time.monotonic()) + grace_s)
    return [t for t in threads if t.is_alive()]


@pytest.mark.parametrize("unlocked", [False, True], ids=["locked-copies", "unlocked-copies"])
def test_threads_and_a_reader_process_keep_every_invariant(tmp_path: Path, soak: bool, unlocked: bool,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """``unlocked``: every copy into and out of DRAM runs without the store's lock (by
    default only those of 1 MiB or more, which these small pages never reach)."""
    if unlocked:
        monkeypatch.setattr(api, "UNLOCKED_COPY_BYTES", 0)
    seconds = 60.0 if soak else 3.0
    cfg = make_config(tmp_path / "s", 4, 64)
    with Store.open(cfg) as store:
        for i in range(N_PROMPTS):
            store.put(prompt(i), page_data(i, PAGES))
        store.flush()                               # the reader sees what the group commit published
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        reader = subprocess.Popen([sys.executable, "-c", READER, cfg.path, str(seconds)], cwd=ROOT, env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        h = Harness(store, seconds)
        targets = [guarded(h, lambda s=s: worker(h, s)) for s in range(4)]  # type: ignore[misc]
        targets += [guarded(h, lambda: pin_keeper(h)), guarded(h, lambda: monitor(h))]
        stuck = run_threads(targets, grace_s=60.0, deadline=h.deadline)
        out, err = reader.communicate(timeout=120)
    assert not stuck, f"{len(stuck)} threads deadlocked"
    assert not h.errors, h.errors[:5]
    assert h.ops > 100
    assert reader.returncode == 0, err
    result = json.loads(out.strip().splitlines()[-1])
    assert result["wrong"] == 0 and result["served"] > 0
