"""``tierkv bench dualpath`` end to end, small: three node daemons in network namespaces,
the storage NICs shaped by tc, every policy loading every page bit-exact, the prefill
node reading all the bytes under pe-only and part of them under split. Throughput is the
benchmark's to report (docs/benchmarks.md), not this test's: the machine is shared."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tierkv.bench.dualpath import run_dualpath_bench
from tierkv.bench.netns import Namespaces, NetnsError


@pytest.fixture(autouse=True)
def _needs_netns() -> None:
    try:
        with Namespaces() as nets:
            a, b = nets.add("a"), nets.add("b")
            (dev, _), _ = nets.link(a, b)
            nets.shape(a, dev, 100)
    except NetnsError as exc:
        pytest.skip(f"network namespaces, veth and tbf are needed: {exc}")


def test_every_policy_loads_every_page_and_split_uses_both_nics(tmp_path: object) -> None:
    r = run_dualpath_bench(requests=3, pages=16, storage_mbit=800, rounds=1, where=str(tmp_path))
    assert r["mismatches"] == 0
    for name, p in r["policies"].items():
        assert p["pages_loaded"] == 3 * 16 and p["pages_missed"] == 0, name
        assert p["helper_errors"] == 0, name
    assert r["policies"]["pe-only"]["prefill_bytes_fraction"] == 1.0
    assert 0 < r["split_prefill_bytes_fraction"] < 1
    assert r["policies"]["pe-only"]["throughput_vs_pe_only"] == 1.0


def test_the_cli_prints_json_and_checks_its_options() -> None:
    bad = subprocess.run([sys.executable, "-m", "tierkv", "bench", "dualpath", "--storage-mbit", "0", "--json"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "--storage-mbit must be" in bad.stderr
    wrong = subprocess.run([sys.executable, "-m", "tierkv", "bench", "store", "--requests", "2"],
                           capture_output=True, text=True, timeout=60)
    assert wrong.returncode != 0 and "dualpath suite" in wrong.stderr
    ok = subprocess.run([sys.executable, "-m", "tierkv", "bench", "dualpath", "--requests", "2", "--pages", "8",
                         "--runs", "1", "--json"], capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr[-2000:]
    out = json.loads(ok.stdout)
    assert set(out["policies"]) == {"pe-only", "shorter-queue", "split"} and out["mismatches"] == 0
