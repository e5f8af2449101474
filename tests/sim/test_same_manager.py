"""``tierkv sim`` and ``tierkv replay`` run one block manager: the same workload, tier
capacities, policy and promotion serve exactly the same pages from each tier.

The replay drives a real store (DRAM, an O_DIRECT NVMe file, LMDB); the simulator drives
the same :class:`~tierkv.store.manager.BlockManager` over byte-less tiers. Any drift
between the two (a call made in another order, a rule of the store's not followed by the
simulator) shows up as a different per-tier hit count, compared exactly. That the
comparison can fail is checked too: a simulator one DRAM slot off, or with another policy,
does not match.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tierkv.cli.main import main

TRACE = Path(__file__).resolve().parents[3] / "shared" / "data" / "traces" / "mooncake_conversation_trace.jsonl"
PAGE = 4096             # bytes per page in the replay: small files, the same pages
SYNTHETIC = ["--synthetic-requests", "500", "--seed", "3"]
MOONCAKE = ["--trace", str(TRACE), "--limit", "1200"]   # its reuse comes late: big tiers
TIERS = ("dram", "nvme")
SHM = Path("/dev/shm")


def _run(capsys: pytest.CaptureFixture[str], argv: list[str]) -> dict[str, Any]:
    """A command's one JSON object."""
    assert main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    assert isinstance(doc, dict)
    return doc


@pytest.fixture
def workdir(tmp_path: Path) -> Iterator[Path]:
    """Where the replay's store goes: tmpfs where there is one (its syncs cost nothing there)."""
    if not SHM.is_dir():
        yield tmp_path
        return
    path = Path(tempfile.mkdtemp(prefix="tierkv-test-", dir=SHM))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _replay(capsys: pytest.CaptureFixture[str], workdir: Path, workload: list[str], dram: int, nvme: int,
            policy: str, promote: bool) -> dict[str, int]:
    """Per-tier hits (and totals) of a replay through a real store of ``dram`` + ``nvme`` pages."""
    config = workdir / "replay.toml"
    config.write_text(f'[store]\npath = "{workdir / "unused"}"\nmodel_id = "m"\npolicy = "{policy}"\n'
                      f"promote_on_hit = {str(promote).lower()}\n\n[tiers.dram]\ncapacity_bytes = {dram * PAGE}\n\n"
                      f"[tiers.nvme]\ncapacity_bytes = {nvme * PAGE}\no_direct = false\n")   # tmpfs has no O_DIRECT
    store = workdir / "store"
    shutil.rmtree(store, ignore_errors=True)   # a fresh store each time, never a warm one
    doc = _run(capsys, ["replay", *workload, "--config", str(config), "--page-bytes", str(PAGE),
                        "--dram", str(dram * PAGE), "--nvme", str(nvme * PAGE), "--workdir", str(store), "--json"])
    assert "warm_start" not in doc["workload"]
    tiers = doc["store"]["tiers"]
    assert [tiers[t]["capacity_slots"] for t in TIERS] == [dram, nvme]
    assert doc["config"]["policy"] == policy and doc["config"]["promote_on_hit"] is promote
    out = {t: int(tiers[t]["hits"]) for t in TIERS}
    out.update(hit=int(doc["blocks_hit"]), rejected=int(doc["puts_rejected"]))
    return out


def _sim(capsys: pytest.CaptureFixture[str], workload: list[str], dram: int, nvme: int, policy: str,
         promote: bool) -> dict[str, int]:
    """The same figures from ``tierkv sim`` (its rates times the blocks requested)."""
    doc = _run(capsys, ["sim", *workload, "--tiers", f"{dram},{nvme}", "--policy", policy,
                        *([] if promote else ["--no-promote"]), "--json"])
    (r,) = doc["results"]
    total = r["blocks_requested"]
    out = {t: round(r["tier_hit_rate"][t] * total) for t in TIERS}
    out.update(hit=r["blocks_hit"], rejected=r["puts_rejected"])
    return out


def _workload(name: str) -> list[str]:
    if name == "mooncake":
        if not TRACE.is_file():
            pytest.skip("the Mooncake trace is not in ../shared")
        return MOONCAKE
    return SYNTHETIC


@pytest.mark.parametrize(("workload", "dram", "nvme", "policy", "promote"), [
    ("synthetic", 40, 200, "gittins", True),        # the store's default policy
    ("synthetic", 40, 200, "lru", False),
    ("synthetic", 24, 120, "s3fifo", True),
    ("mooncake", 100, 1000, "gittins", True),
    ("mooncake", 200, 1500, "lru-leaf", False),
])
def test_replay_and_sim_serve_the_same_pages_from_each_tier(
        capsys: pytest.CaptureFixture[str], workdir: Path, workload: str, dram: int, nvme: int, policy: str,
        promote: bool) -> None:
    argv = _workload(workload)
    replay = _replay(capsys, workdir, argv, dram, nvme, policy, promote)
    assert replay["dram"] > 0 and replay["nvme"] > 0    # both tiers serve, so the split is tested
    assert _sim(capsys, argv, dram, nvme, policy, promote) == replay


def test_the_comparison_sees_a_different_store(capsys: pytest.CaptureFixture[str], workdir: Path) -> None:
    """A simulator one DRAM slot larger, one NVMe slot smaller, with another policy or without
    promotion, does not match the replay: the exact comparison above has teeth."""
    replay = _replay(capsys, workdir, SYNTHETIC, 40, 200, "gittins", True)
    assert _sim(capsys, SYNTHETIC, 40, 200, "gittins", True) == replay
    for dram, nvme, policy, promote in ((41, 200, "gittins", True), (40, 199, "gittins", True),
                                        (40, 200, "lru-leaf", True), (40, 200, "gittins", False)):
        assert _sim(capsys, SYNTHETIC, dram, nvme, policy, promote) != replay, (dram, nvme, policy, promote)
