"""Many nodes as one cluster, kept in etcd (docs/cluster.md).

- :mod:`~tierkv.cluster.etcd`: the etcd calls the cluster makes (keys, leases,
  transactions, watches), each with a deadline;
- :mod:`~tierkv.cluster.members`: a node's registration under a lease
  (:class:`~tierkv.cluster.members.Membership`) and the members as a node sees them
  (:class:`~tierkv.cluster.members.NodeView`);
- :mod:`~tierkv.cluster.directory`: the page directory (every member's anchors, followed
  by a watch), and :mod:`~tierkv.cluster.publisher`: a node's own, published under its lease;
- :mod:`~tierkv.cluster.routing`: routing hints (:func:`best_nodes`,
  :class:`~tierkv.cluster.routing.Router`: the members holding the most leading pages of a
  prompt);
- :mod:`~tierkv.cluster.node`: a node daemon's part in the cluster;
- :mod:`~tierkv.cluster.local`: a local etcd and cluster for trying it and for tests.

Needs the ``cluster`` extra (``etcd3gw``) and an etcd 3.4+ server.
"""

from __future__ import annotations

from typing import Any

__all__ = ["best_nodes"]


def __getattr__(name: str) -> Any:   # the routing module imports the network stack: only when asked
    if name == "best_nodes":
        from tierkv.cluster.routing import best_nodes

        return best_nodes
    raise AttributeError(f"module 'tierkv.cluster' has no attribute {name!r}")
