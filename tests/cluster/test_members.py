"""Membership under leases, against a real etcd: join, see, leave, expire, survive etcd's absence."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from tierkv.cli.main import main
from tierkv.cluster.etcd import Etcd, prefix_end
from tierkv.cluster.local import LocalEtcd
from tierkv.cluster.members import Membership, NodeRecord, NodeView
from tierkv.config import ClusterConfig, DramConfig, NvmeConfig, PeersConfig, StoreConfig, config_from_dict, load_config
from tierkv.errors import ClusterRefusedError, ClusterUnavailableError, ConfigError
from tierkv.serve.daemon import NodeService
from tierkv.store.api import Store
from tests.conftest import LAYOUT, PB
from tests.polling import wait_for


def member(etcd: LocalEtcd, name: str, ttl_s: int = 2, cluster: str = "c") -> Membership:
    return Membership(Etcd([etcd.endpoint], timeout_s=1), cluster,
                      lambda epoch: NodeRecord(name, epoch, "m", "fp", peer="127.0.0.1:7000", tiers=("dram",)),
                      ttl_s=ttl_s).start()


def test_prefix_end_covers_exactly_the_prefix() -> None:
    assert prefix_end(b"/a/") == b"/a0"
    assert prefix_end(b"a\xff") == b"b"
    assert prefix_end(b"\xff\xff") == b"\0"


def test_a_node_joins_is_seen_with_its_record_and_leaving_removes_it_at_once(etcd: LocalEtcd) -> None:
    view = NodeView(Etcd([etcd.endpoint]), "c").start()
    other_cluster = NodeView(Etcd([etcd.endpoint]), "d").start()
    a = member(etcd, "a", ttl_s=30)
    assert view.wait(lambda n: "a" in n, 5)
    rec = view.nodes()["a"]
    assert (rec.node, rec.epoch, rec.peer, rec.tiers, rec.model_id) == ("a", a.lease, "127.0.0.1:7000", ("dram",), "m")
    assert not view.stale and other_cluster.nodes() == {}
    a.close()                                               # revoked: gone now, not after 30 s
    assert view.wait(lambda n: "a" not in n, 5)
    view.close()
    other_cluster.close()


def test_a_second_live_node_of_the_same_name_is_refused(etcd: LocalEtcd) -> None:
    a = member(etcd, "a")
    with pytest.raises(ConfigError, match="node 'a' is already a live member of cluster 'c'.*another \\[cluster\\] node"):
        member(etcd, "a")
    b = member(etcd, "a", cluster="other")                   # the same name in another cluster is another node
    a.close()
    b.close()


def test_a_killed_node_vanishes_when_its_lease_runs_out(etcd: LocalEtcd, tmp_path: Path) -> None:
    """SIGKILL a process holding a membership (ttl 2 s): no revoke, the lease expires."""
    script = textwrap.dedent(f"""
        import sys, time
        from tierkv.cluster.etcd import Etcd
        from tierkv.cluster.members import Membership, NodeRecord
        Membership(Etcd([{etcd.endpoint!r}], timeout_s=1), "c", lambda e: NodeRecord("k", e, "m", "fp"), ttl_s=4).start()
        print("joined", flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).resolve().parents[2])
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "joined"
        view = NodeView(Etcd([etcd.endpoint]), "c").start()
        assert "k" in view.nodes()
        epoch = view.nodes()["k"].epoch
        time.sleep(5)                                        # renewals keep it past one TTL
        assert view.nodes()["k"].epoch == epoch
        os.kill(proc.pid, signal.SIGKILL)
        t0 = time.monotonic()
        assert view.wait(lambda n: "k" not in n, 15)
        assert time.monotonic() - t0 <= 4 + 4               # the TTL, etcd's expiry check, a busy machine
        view.close()
    finally:
        proc.kill()
        proc.wait()


def test_a_lost_lease_is_replaced_and_the_node_comes_back_under_a_new_epoch(etcd: LocalEtcd) -> None:
    a = member(etcd, "a", ttl_s=3)
    view = NodeView(Etcd([etcd.endpoint]), "c").start()
    first = a.lease
    Etcd([etcd.endpoint]).revoke(first)                      # as when the lease ran out unseen
    assert view.wait(lambda n: "a" in n and n["a"].epoch != first, 5)
    assert wait_for(lambda: a.lease == view.nodes()["a"].epoch and a.registrations == 2, 5)
    a.close()
    view.close()


def test_while_etcd_is_away_the_node_keeps_its_view_and_rejoins_when_it_returns(etcd: LocalEtcd) -> None:
    a = member(etcd, "a", ttl_s=4)
    view = NodeView(Etcd([etcd.endpoint], timeout_s=1), "c").start()
    assert view.wait(lambda n: "a" in n, 5)
    etcd.kill()
    assert wait_for(lambda: view.stale and a.etcd_away, 8)
    assert "a" in view.nodes()                               # the last members known, marked stale
    etcd.start()
    b = member(etcd, "b", ttl_s=4)                           # a change while the view relists
    assert wait_for(lambda: not view.stale and not a.etcd_away, 10)
    assert view.wait(lambda n: {"a", "b"} <= set(n), 5)
    b.close()
    assert view.wait(lambda n: "b" not in n, 5)              # the new watch sees changes
    a.close()
    view.close()


def test_a_frozen_etcd_makes_the_view_stale_and_it_recovers_when_etcd_does(etcd: LocalEtcd) -> None:
    """SIGSTOP: connections stay open and silent, as when partitioned away without a reset;
    a view that believed its silent watch would call dead nodes current."""
    a = member(etcd, "a", ttl_s=6)
    view = NodeView(Etcd([etcd.endpoint], timeout_s=0.5), "c", check_s=0.3).start()
    assert view.wait(lambda n: "a" in n, 5) and not view.stale
    etcd.pause()
    try:
        assert wait_for(lambda: view.stale, 6)
    finally:
        etcd.resume()
    assert wait_for(lambda: not view.stale, 8)
    b = member(etcd, "b", ttl_s=6)
    assert view.wait(lambda n: {"a", "b"} <= set(n), 8)
    b.close()
    a.close()
    view.close()


def test_a_view_checks_its_watch_against_the_listing_and_relists_when_they_differ(etcd: LocalEtcd) -> None:
    view = NodeView(Etcd([etcd.endpoint]), "c", check_s=0.2).start()
    a = member(etcd, "a", ttl_s=30)
    assert view.wait(lambda n: "a" in n, 5)
    relists = view.relists
    with view._cond:                                          # as if the watch had missed a's registration
        view._nodes.pop("a")
        view._mods.clear()
    assert wait_for(lambda: "a" in view.nodes() and view.relists > relists, 5)
    a.close()
    view.close()


def test_a_refusal_is_not_an_absence_and_names_etcds_reason(etcd: LocalEtcd) -> None:
    client = Etcd([etcd.endpoint])
    client.revoke(0x1234)                                     # a lease already gone: fine
    with pytest.raises(ClusterRefusedError, match="requested lease not found"):
        client.put(b"/k", b"v", lease=0x1234)
    assert client.keepalive(0x1234) == -1


def test_a_daemon_that_died_restarts_on_its_store_at_once_taking_its_record_over(
        etcd: LocalEtcd, tmp_path: Path, sock_dir: Path) -> None:
    cfg_text = (f'[store]\npath = "{tmp_path / "s"}"\nmodel_id = "m"\n[tiers.dram]\ncapacity_bytes = "1MiB"\n'
                '[layout]\nnum_layers = 2\nnum_kv_heads = 2\nhead_dim = 64\ndtype = "bf16"\ntokens_per_page = 16\n'
                f'[serve]\nsocket = "{sock_dir / "r.sock"}"\n'
                f'[cluster]\netcd = ["{etcd.endpoint}"]\nname = "c"\nnode = "r"\nlease_ttl_s = 30\n')
    conf = tmp_path / "r.toml"
    conf.write_text(cfg_text)
    view = NodeView(Etcd([etcd.endpoint]), "c").start()
    proc = subprocess.Popen([sys.executable, "-m", "tierkv", "serve", "--config", str(conf), "--foreground"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=Path(__file__).resolve().parents[2])
    try:
        assert view.wait(lambda n: "r" in n, 20)
        first = view.nodes()["r"].epoch
        os.kill(proc.pid, signal.SIGKILL)                     # its lease lives on for 30 s
        proc.wait()
    finally:
        proc.kill()
        proc.wait()
    svc = NodeService(load_config(str(conf))).start()         # restarts at once on the same store
    assert view.wait(lambda n: "r" in n and n["r"].epoch != first, 5)
    assert svc.status()["cluster"]["member"]
    with pytest.raises(ClusterRefusedError):                  # the dead daemon's lease was revoked
        Etcd([etcd.endpoint]).put(b"/probe", b"x", lease=first)
    svc.close()
    view.close()


def test_an_etcd_that_never_answers_fails_each_call_within_its_deadline() -> None:
    """A listener that accepts and never replies (a partitioned or wedged etcd)."""
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(8)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                held.append(lsock.accept()[0])
            except OSError:
                return
    threading.Thread(target=accept, daemon=True).start()
    client = Etcd([f"127.0.0.1:{lsock.getsockname()[1]}"], timeout_s=0.5)
    for call in (lambda: client.get_prefix(b"/x/"), lambda: client.grant(5), lambda: client.put(b"k", b"v")):
        t0 = time.monotonic()
        with pytest.raises(ClusterUnavailableError, match="etcd did not answer"):
            call()
        assert time.monotonic() - t0 < 3
    m = Membership(client, "c", lambda e: NodeRecord("a", e, "m", "fp"), ttl_s=2)
    t0 = time.monotonic()
    m.start()                                                # the daemon starts anyway, out of the cluster
    assert m.etcd_away and not m.lease and not m.member and time.monotonic() - t0 < 3
    m.close()
    t0 = time.monotonic()
    view = NodeView(client, "c", check_s=0.2).start()        # a view of it: empty, stale, and closes promptly
    assert view.stale and view.nodes() == {} and time.monotonic() - t0 < 3
    view.close()
    assert time.monotonic() - t0 < 6
    stop.set()
    lsock.close()
    for s in held:
        s.close()


def test_the_cluster_table_is_checked_naming_the_fault() -> None:
    base = {"store": {"path": "/tmp/x", "model_id": "m"}, "tiers": {"dram": {"capacity_bytes": "1MiB"}},
            "layout": {"num_layers": 2, "num_kv_heads": 2, "head_dim": 64, "dtype": "bf16", "tokens_per_page": 16}}
    cfg = config_from_dict({**base, "cluster": {"etcd": ["127.0.0.1:2379", "http://10.0.0.2:2379"], "name": "prod",
                                                "node": "gpu-07", "lease_ttl_s": 10}})
    assert cfg.cluster == ClusterConfig(("127.0.0.1:2379", "http://10.0.0.2:2379"), "prod", "gpu-07", 10)
    for bad, match in (({"etcd": "127.0.0.1:2379"}, "cluster.etcd must be a non-empty list"),
                       ({"etcd": ["nohost"]}, r"cluster.etcd\[0\] must be 'host:port'"),
                       ({"name": "a/b"}, "cluster.name must be 1-128 letters"),
                       ({"node": ""}, "cluster.node must be"),
                       ({"lease_ttl_s": 1}, r"cluster.lease_ttl_s must be an integer in \[2, 3600\]"),
                       ({"lease_ttl_s": 5, "timeout_s": 2.0}, r"timeout_s \(2 s\) must be at most a third of"),
                       ({"lease": 5}, "unknown key")):
        with pytest.raises(ConfigError, match=match):
            config_from_dict({**base, "cluster": bad})


def test_a_daemon_with_a_cluster_table_joins_reports_it_and_leaves_when_it_closes(
        etcd: LocalEtcd, tmp_path: Path, sock_dir: Path) -> None:
    def cfg(path: str) -> StoreConfig:
        return StoreConfig(path=str(tmp_path / path), model_id="m", layout=LAYOUT, dram=DramConfig(8 * PB),
                           cluster=ClusterConfig((etcd.endpoint,), "c", "n1", lease_ttl_s=6))
    view = NodeView(Etcd([etcd.endpoint]), "c").start()
    svc = NodeService(cfg("a"), sock_dir / "a.sock").start()
    assert view.wait(lambda n: "n1" in n, 5)
    rec = view.nodes()["n1"]
    assert (rec.model_id, rec.tiers, rec.peer, rec.transports) == ("m", ("dram",), None, ())
    assert rec.layout == hashlib.sha256(LAYOUT.fingerprint()).hexdigest()[:32]
    status = svc.status()["cluster"]
    assert status["member"] and status["node"] == "n1" and status["lease"] == rec.epoch and not status["etcd_away"]
    with pytest.raises(ConfigError, match="node 'n1' is already a live member"):
        NodeService(cfg("b"), sock_dir / "b.sock")           # a second daemon under the same name
    assert not (sock_dir / "b.sock").exists()                # refused cleanly: no socket left behind
    Store.open(cfg("b")).close()                             # and its store was closed
    svc.close()
    assert view.wait(lambda n: "n1" not in n, 5)
    view.close()


def test_tierkv_cluster_nodes_lists_the_members_and_says_when_etcd_is_away(
        etcd: LocalEtcd, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = member(etcd, "a", ttl_s=30)
    assert main(["cluster", "nodes", "--etcd", etcd.endpoint, "--name", "c", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [(n["node"], n["epoch"], n["peer"]) for n in out["nodes"]] == [("a", a.lease, "127.0.0.1:7000")]
    assert main(["cluster", "nodes", "--etcd", etcd.endpoint, "--name", "c"]) == 0
    assert "cluster c: 1 node(s)" in capsys.readouterr().out
    conf = tmp_path / "n.toml"
    conf.write_text(f'[store]\npath = "{tmp_path / "s"}"\nmodel_id = "m"\n[tiers.dram]\ncapacity_bytes = "1MiB"\n'
                    '[layout]\nnum_layers = 2\nnum_kv_heads = 2\nhead_dim = 64\ndtype = "bf16"\ntokens_per_page = 16\n'
                    f'[cluster]\netcd = ["{etcd.endpoint}"]\nname = "c"\n')
    assert main(["cluster", "nodes", "--config", str(conf), "--json"]) == 0
    assert [n["node"] for n in json.loads(capsys.readouterr().out)["nodes"]] == ["a"]
    a.close()
    etcd.stop()
    assert main(["cluster", "nodes", "--etcd", etcd.endpoint, "--name", "c", "--json", "--timeout", "0.5"]) == 1
    assert "etcd did not answer" in json.loads(capsys.readouterr().out)["error"]
    assert main(["cluster", "nodes", "--json"]) == 2                 # nowhere to look: a usage error
    assert "needs --config FILE or --etcd" in capsys.readouterr().err


def test_a_wildcard_peer_address_is_refused_with_a_cluster(etcd: LocalEtcd, tmp_path: Path, sock_dir: Path) -> None:
    secret = tmp_path / "s.secret"
    secret.write_bytes(b"a-secret-of-this-test-run-32-bytes")
    secret.chmod(0o600)
    cfg = StoreConfig(path=str(tmp_path / "w"), model_id="m", layout=LAYOUT, dram=DramConfig(8 * PB),
                      peers=PeersConfig(serve="0.0.0.0:0", transport="tcp", secret_file=str(secret)),
                      cluster=ClusterConfig((etcd.endpoint,), "c", "w", lease_ttl_s=6))
    with pytest.raises(ConfigError, match="must be one they reach"):
        NodeService(cfg, sock_dir / "w.sock")
    assert not (sock_dir / "w.sock").exists()


def test_a_stores_identity_is_stable_and_its_own(tmp_path: Path) -> None:
    dram_only = StoreConfig(path=str(tmp_path / "d"), model_id="m", layout=LAYOUT, dram=DramConfig(8 * PB))
    with Store.open(dram_only) as s:
        first = s.identity()
    with Store.open(dram_only) as s:
        assert s.identity() == first and len(first) == 32
    persistent = StoreConfig(path=str(tmp_path / "p"), model_id="m", layout=LAYOUT, dram=DramConfig(8 * PB),
                             nvme=NvmeConfig(8 * PB))
    with Store.open(persistent) as s:
        other = s.identity()
    with Store.open(persistent) as s:
        assert s.identity() == other != first
