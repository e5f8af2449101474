"""Two processes on one store: a writer and a read-only reader in a separate process.

The reader sees what the writer committed to the NVMe tier, including pages committed
after the reader opened, and never gets wrong bytes while the writer keeps evicting and
reusing slots under it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from tests.conftest import make_config, page_data
from tierkv.store.api import Store

ROOT = Path(__file__).resolve().parents[2]

READER = """
import json, sys
import numpy as np
from tests.conftest import PB, make_config, page_data
from tests.store.test_multiprocess import prompt
from tierkv.store.api import Store
path, first, last, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
served = wrong = 0
with Store.open(make_config(path, 0, 24), read_only=True) as store:
    print("open", flush=True)
    sys.stdin.readline()  # the writer has committed more since we opened
    for _ in range(rounds):
        for i in range(first, last):
            out = np.zeros((2, PB), dtype=np.uint8)
            n = store.get(prompt(i), out).pages
            served += n
            wrong += int(not np.array_equal(out[:n], page_data(i, 2)[:n]))
print(json.dumps({"served": served, "wrong": wrong}), flush=True)
"""


def prompt(i: int) -> np.ndarray:
    return np.arange(32, dtype=np.int64) + 1000 * i


def _reader(path: Path, first: int, last: int, rounds: int) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen([sys.executable, "-c", READER, str(path), str(first), str(last), str(rounds)],
                            cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _finish(child: subprocess.Popen[str]) -> dict[str, int]:
    out, err = child.communicate(timeout=120)
    assert child.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_reader_process_sees_pages_committed_after_it_opened(tmp_path: Path) -> None:
    cfg = make_config(tmp_path / "s", 0, 24)
    with Store.open(cfg) as writer:
        writer.put(prompt(0), page_data(0, 2))
        child = _reader(tmp_path / "s", 0, 4, 1)
        assert child.stdout is not None and child.stdout.readline().strip() == "open"
        for i in range(1, 4):
            writer.put(prompt(i), page_data(i, 2))
        writer.flush()                              # readers see what the group commit published
        assert child.stdin is not None
        child.stdin.write("go\n")
        child.stdin.flush()
        assert _finish(child) == {"served": 8, "wrong": 0}


def test_reader_never_gets_wrong_bytes_while_the_writer_reuses_slots(tmp_path: Path) -> None:
    cfg = make_config(tmp_path / "s", 0, 24)  # 12 prompts of 2 pages fit; 40 force evictions
    with Store.open(cfg) as writer:
        for i in range(12):
            writer.put(prompt(i), page_data(i, 2))
        writer.flush()
        child = _reader(tmp_path / "s", 0, 40, 20)
        assert child.stdout is not None and child.stdout.readline().strip() == "open"
        assert child.stdin is not None
        child.stdin.write("go\n")
        child.stdin.flush()
        for round_ in range(10):
            for i in range(40):
                writer.put(prompt(i), page_data(i, 2))
        result = _finish(child)
    assert result["wrong"] == 0
    assert result["served"] > 0
