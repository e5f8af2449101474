"""NIC load with all loads through prefill nodes versus DualPath, against hand computations."""

from __future__ import annotations

import pytest

from tierkv.plan.hardware import ClusterSpec, NicSpec
from tierkv.plan.network import scenarios

GB = 1e9
NICS = (NicSpec("compute", 8, 50 * GB, reaches_storage=False, reaches_compute=True),
        NicSpec("storage", 2, 50 * GB, reaches_storage=True, reaches_compute=False))


def _util(scenario: object, side: str, nic: str) -> float:
    return next(n.utilization for n in scenario.loads if n.side == side and n.nic == nic)  # type: ignore


def test_prefill_only_versus_dualpath() -> None:
    # 1 prefill + 1 decode node; 40 GB/s of storage loads, 8 GB/s of writes from prefill, 16 GB/s P->D.
    prefill_only, dualpath = scenarios(ClusterSpec(1, 1, True), NICS, 40 * GB, 8 * GB, 16 * GB)
    assert _util(prefill_only, "prefill", "storage") == pytest.approx(40 / 100)
    assert _util(prefill_only, "decode", "storage") == 0.0
    assert _util(prefill_only, "prefill", "compute") == pytest.approx(16 / 400)
    assert dualpath.decode_share == 0.5
    assert _util(dualpath, "prefill", "storage") == pytest.approx(20 / 100)
    assert _util(dualpath, "decode", "storage") == pytest.approx(20 / 100)
    # decode compute NICs: receive 16 (P->D) and send the 20 GB/s hop: the busier direction.
    assert _util(dualpath, "decode", "compute") == pytest.approx(20 / 400)
    assert dualpath.max_utilization < prefill_only.max_utilization


def test_writes_split_by_where_the_tier_above_lives() -> None:
    _, dualpath = scenarios(ClusterSpec(3, 1, True), NICS, 0.0, 40 * GB, 0.0, write_prefill_share=0.75)
    tx = {(n.side, n.nic): n.tx_bytes_s for n in dualpath.loads}
    assert tx[("prefill", "storage")] == pytest.approx(10 * GB)  # 30 GB/s over 3 prefill nodes
    assert tx[("decode", "storage")] == pytest.approx(10 * GB)


def test_colocated_and_converged_nics() -> None:
    nic = (NicSpec("eth", 1, 10 * GB, reaches_storage=True, reaches_compute=True),)
    (only,) = scenarios(ClusterSpec(4, 0, False), nic, 20 * GB, 4 * GB, 0.0)
    assert only.name == "colocated" and only.max_utilization == pytest.approx(5 / 10)
