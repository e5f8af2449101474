"""From a hardware profile and a model to the cluster's KV tiers: bytes, tokens, blocks, rates.

A node-local tier's capacity and bandwidth are multiplied by the nodes that hold it, as
if cache-aware routing pooled them (Mooncake's store does; per-node caches without such
routing hit less): HBM by the nodes that prefill (on a disaggregated cluster the decode
nodes' HBM runs requests), DRAM and NVMe by every node. A shared tier (NVMe-oF) is the
pool as given. The codec's ratio shrinks what the NVMe and NVMe-oF tiers store and move
(the tiers the store codes pages on; DRAM holds whole pages).
Called by :mod:`tierkv.plan.planner` and :mod:`tierkv.plan.recommend`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from tierkv.errors import ConfigError
from tierkv.layout import KVLayout
from tierkv.plan.costs import LoadModel
from tierkv.plan.hardware import HardwareProfile, TierKind
from tierkv.plan.models import ModelSpec

#: Block counts are capped here (2**56 blocks of 512 tokens: beyond any workload), so a few tiers'
#: cumulative boundaries stay within int64 whatever the profile's capacities and node counts.
MAX_BLOCKS = 2**56


@dataclass(frozen=True)
class Deployment:
    """How the model sits on a node: GPUs per instance and the HBM the KV cache gets."""

    instance_gpus: int
    instances_per_node: int
    weight_bytes: int
    kv_space_bytes_per_node: int      # HBM left for KV after weights, running requests included
    hbm_cache_bytes_per_node: int     # the share of it that keeps cached prefixes
    idle_gpus_per_node: int = 0       # count % instance_gpus: GPUs no whole instance uses


@dataclass(frozen=True)
class ResolvedTier:
    """One tier of the whole cluster, as the planner uses it."""

    kind: TierKind
    capacity_bytes: int
    bytes_per_token: float            # at rest, after the codec (HBM: raw)
    bandwidth_bytes_s: float          # sustained by the cluster (or pool), reads + writes
    request_bandwidth_bytes_s: float  # one request's load
    latency_s: float
    cost_per_gib: float
    nodes: int                        # nodes contributing (1 for a shared pool)

    @property
    def capacity_tokens(self) -> int:
        return int(self.capacity_bytes // self.bytes_per_token)

    def capacity_blocks(self, block_tokens: int) -> int:
        """Whole blocks the tier holds, at most :data:`MAX_BLOCKS`."""
        return min(MAX_BLOCKS, int(self.capacity_bytes // (self.bytes_per_token * block_tokens)))

    @property
    def load(self) -> LoadModel:
        return LoadModel(self.latency_s, self.bytes_per_token, self.request_bandwidth_bytes_s)

    @property
    def cost(self) -> float:
        return self.capacity_bytes / 2**30 * self.cost_per_gib

    def resized(self, capacity_bytes: int) -> ResolvedTier:
        return replace(self, capacity_bytes=capacity_bytes)


def deployment(model: ModelSpec, profile: HardwareProfile, instance_gpus: int) -> Deployment:
    """``count // instance_gpus`` whole instances per node; the ``count % instance_gpus`` GPUs left idle."""
    gpu = profile.gpu
    instances = gpu.count // instance_gpus
    usable = gpu.hbm_bytes * gpu.memory_utilization * instance_gpus
    kv_space = int((usable - model.weight_bytes) * instances)
    if kv_space <= 0:
        raise ConfigError(f"{model.name}: {model.weight_bytes / 2**30:.1f} GiB of weights leave no HBM for KV in "
                          f"{instance_gpus} GPU(s) x {gpu.hbm_bytes * gpu.memory_utilization / 2**30:.1f} GiB")
    return Deployment(instance_gpus, instances, model.weight_bytes, kv_space, int(kv_space * gpu.cache_fraction),
                      gpu.count % instance_gpus)


#: The tiers whose pages the store codes (tierkv.tiers.blocks): only their bytes shrink.
CODED_KINDS = frozenset({TierKind.NVME, TierKind.NVMEOF})


def resolve_tiers(profile: HardwareProfile, layout: KVLayout, dep: Deployment,
                  codec_ratio: float = 1.0) -> tuple[ResolvedTier, ...]:
    """The profile's tiers for the whole cluster, fastest first. ``codec_ratio`` shrinks
    what the NVMe and NVMe-oF tiers store and move: the tiers the store codes pages on
    (a block tier, lossless or lossy pages alike); HBM and DRAM hold whole pages."""
    if not 0 < codec_ratio <= 1:
        raise ConfigError(f"codec ratio must be in (0, 1] (compressed / raw bytes), got {codec_ratio}")
    cluster, gpu = profile.cluster, profile.gpu
    out = []
    for spec in profile.tiers:
        if spec.kind is TierKind.HBM:
            per_node = dep.hbm_cache_bytes_per_node if spec.capacity_bytes is None else spec.capacity_bytes
            nodes = cluster.prefill_nodes
            busy_gpus = dep.instances_per_node * dep.instance_gpus  # idle GPUs hold no KV
            out.append(ResolvedTier(TierKind.HBM, per_node * nodes, float(layout.token_bytes),
                                    gpu.hbm_bandwidth_bytes_s * busy_gpus * nodes,
                                    gpu.hbm_bandwidth_bytes_s * dep.instance_gpus, spec.latency_s,
                                    spec.cost_per_gib, nodes))
            continue
        assert spec.capacity_bytes is not None  # only HBM may be "auto"
        nodes = 1 if spec.shared else cluster.nodes
        ratio = codec_ratio if spec.kind in CODED_KINDS else 1.0
        out.append(ResolvedTier(spec.kind, spec.capacity_bytes * nodes, layout.token_bytes * ratio,
                                spec.bandwidth_bytes_s * nodes, spec.request_bandwidth_bytes_s, spec.latency_s,
                                spec.cost_per_gib, nodes))
    return tuple(out)


def boundaries(tiers: tuple[ResolvedTier, ...], block_tokens: int) -> np.ndarray:
    """Cumulative capacities in blocks: tier ``k`` holds LRU stack depths ``[B[k-1], B[k])``."""
    return np.cumsum([t.capacity_blocks(block_tokens) for t in tiers]).astype(np.int64)
