"""Many nodes as one cluster, kept in etcd (docs/cluster.md).

- :mod:`~tierkv.cluster.etcd`: the etcd calls the cluster makes (keys, leases,
  transactions, watches), each with a deadline;
- :mod:`~tierkv.cluster.members`: a node's registration under a lease
  (:class:`~tierkv.cluster.members.Membership`) and the members as a node sees them
  (:class:`~tierkv.cluster.members.NodeView`);
- :mod:`~tierkv.cluster.routing`: routing hints (:class:`~tierkv.cluster.routing.Router`:
  the members holding the most leading pages of a prompt);
- :mod:`~tierkv.cluster.local`: a local etcd and cluster for trying it and for tests.

Needs the ``cluster`` extra (``etcd3gw``) and an etcd 3.4+ server.
"""
