"""NIC load per node class for the storage tier's traffic, with and without DualPath.

Inputs are cluster totals in bytes/s: ``storage_read`` and ``storage_write`` (the shared
NVMe-oF tier's reads and writes, after the codec) and, on a disaggregated cluster,
``pd_transfer`` (every prompt's KV sent from its prefill node to its decode node).

* ``colocated`` (no P/D split): storage traffic spread evenly over all nodes.
* ``prefill-only``: every load lands on a prefill node's storage NICs; prefill compute
  NICs send the P->D transfer, decode compute NICs receive it.
* ``dualpath`` (Wu et al., "DualPath: Breaking the Storage Bandwidth Bottleneck in Agentic
  LLM Inference", 2026): a share ``f`` of the loads goes to the decode nodes' storage NICs
  and hops to the prefill nodes over the compute network; ``f`` balances storage-NIC
  utilization: ``f = D x S_d / (P x S_p + D x S_d)`` with ``S`` a node's storage-NIC
  bandwidth, so ``D / (P + D)`` for the profile's identical nodes.

Writes (demotions into the storage tier) leave from the nodes that hold the tier above
it, in both scenarios: ``write_prefill_share`` of them from prefill nodes (1 when that
tier is HBM, ``P / (P + D)`` when it is DRAM or NVMe, which every node contributes).

Within a node, a kind of traffic is split over the NIC classes that carry it in proportion
to their bandwidth; utilization is the busier direction over one direction's bandwidth.
Called by :mod:`tierkv.plan.planner`.
"""

from __future__ import annotations

from dataclasses import dataclass

from tierkv.plan.hardware import ClusterSpec, NicSpec


@dataclass(frozen=True)
class NicLoad:
    """One NIC class on one kind of node, per node."""

    side: str
    nic: str
    count: int
    rx_bytes_s: float
    tx_bytes_s: float
    capacity_bytes_s: float

    @property
    def utilization(self) -> float:
        return max(self.rx_bytes_s, self.tx_bytes_s) / self.capacity_bytes_s if self.capacity_bytes_s else 0.0


@dataclass(frozen=True)
class Scenario:
    name: str
    decode_share: float       # share of storage loads entering through decode nodes
    loads: tuple[NicLoad, ...]

    @property
    def max_utilization(self) -> float:
        return max((n.utilization for n in self.loads), default=0.0)


@dataclass(frozen=True)
class _NodeTraffic:
    """Bytes/s through one node: storage and compute, each direction."""

    storage_rx: float = 0.0
    storage_tx: float = 0.0
    compute_rx: float = 0.0
    compute_tx: float = 0.0


def scenarios(cluster: ClusterSpec, nics: tuple[NicSpec, ...], storage_read: float, storage_write: float,
              pd_transfer: float, write_prefill_share: float = 1.0) -> tuple[Scenario, ...]:
    """The NIC scenarios that apply to ``cluster`` (see module docstring)."""
    if not cluster.disaggregated:
        n = cluster.nodes
        node = _NodeTraffic(storage_rx=storage_read / n, storage_tx=storage_write / n)
        return (Scenario("colocated", 0.0, _loads("node", node, nics)),)
    p, d = cluster.prefill_nodes, cluster.decode_nodes
    out = []
    w_p = storage_write * write_prefill_share
    for name, f in (("prefill-only", 0.0), ("dualpath", d / (p + d))):
        hop = f * storage_read
        prefill = _NodeTraffic(storage_rx=(storage_read - hop) / p, storage_tx=w_p / p,
                               compute_rx=hop / p, compute_tx=pd_transfer / p)
        decode = _NodeTraffic(storage_rx=hop / d, storage_tx=(storage_write - w_p) / d,
                              compute_rx=pd_transfer / d, compute_tx=hop / d)
        out.append(Scenario(name, f, _loads("prefill", prefill, nics) + _loads("decode", decode, nics)))
    return tuple(out)


def _loads(side: str, t: _NodeTraffic, nics: tuple[NicSpec, ...]) -> tuple[NicLoad, ...]:
    storage_bw = sum(n.count * n.bandwidth_bytes_s for n in nics if n.reaches_storage)
    compute_bw = sum(n.count * n.bandwidth_bytes_s for n in nics if n.reaches_compute)
    out = []
    for nic in nics:
        bw = nic.count * nic.bandwidth_bytes_s
        s = bw / storage_bw if nic.reaches_storage and storage_bw else 0.0
        c = bw / compute_bw if nic.reaches_compute and compute_bw else 0.0
        out.append(NicLoad(side, nic.name, nic.count, s * t.storage_rx + c * t.compute_rx,
                           s * t.storage_tx + c * t.compute_tx, bw))
    return tuple(out)
