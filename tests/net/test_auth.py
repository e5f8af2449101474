"""Peer authentication and keyed, tenant-scoped reads (issue 28 item 4), against a real
peer server on 127.0.0.1: only a client that answers the challenge with the right secret
is served; a keyed server answers a read only where it names the key each slot holds,
and a tenant's principal sees only that tenant's pages."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.net.peers import pages
from tierkv.errors import ConfigError, TierUnavailableError
from tierkv.net import Credential, NetConfig, PeerServer, ServerAuth, TcpTransport, is_loopback
from tierkv.net import auth
from tierkv.net.framing import recv_message, send_message
from tierkv.net.wire import Auth, Call, Challenge, Hello, Kind, ReadPages, decode_metas, encode_keys
from tierkv.tiers.dram import DramTier

W = 4096
CLUSTER = b"c" * 32
TENANT_A = b"a" * 32
TAG_A, TAG_B = auth.tenant_tag(b"a"), auth.tenant_tag(b"b")
CFG = NetConfig(timeout_s=1.0, connect_timeout_s=1.0, links=1)


def creds(principal: str, secret: bytes) -> NetConfig:
    return NetConfig(timeout_s=1.0, connect_timeout_s=1.0, links=1, credential=Credential(principal, secret))


@pytest.fixture
def server() -> Iterator[PeerServer]:
    """Keyed; slot 0 holds tenant a's page "ka", slot 1 tenant b's "kb", slot 2 a page of no known tenant."""
    principals = {"": (CLUSTER, None), "tenant:a": (TENANT_A, TAG_A)}
    with DramTier(8, W) as tier, PeerServer(tier, config=CFG, auth=ServerAuth(principals), keyed=True) as srv:
        data = pages(3, W, 1)
        for s in range(3):
            tier.buffer[s] = data[s]
        srv.store.seal([b"ka", b"kb", b"ku"], [0, 1, 2], 1, W, [TAG_A, TAG_B, auth.UNKNOWN_TENANT])
        yield srv


def test_the_right_secret_is_served_and_the_pages_match(server: PeerServer) -> None:
    with TcpTransport(*server.address, creds("", CLUSTER)) as tr:
        dst = np.zeros((3, W), np.uint8)
        r = tr.read([0, 1, 2], dst, keys=[b"ka", b"kb", b"ku"]).result(5)
        assert r.all_ok
        np.testing.assert_array_equal(dst, pages(3, W, 1))
    assert server.stats().auth_failures == 0


@pytest.mark.parametrize("config,match", [
    (CFG, "requires authentication"),                              # no credential at all
    (creds("", b"x" * 32), "failed to prove|refused"),             # the wrong cluster secret
    (creds("tenant:a", CLUSTER), "failed to prove|refused"),       # a real secret under the wrong name
    (creds("tenant:zzz", TENANT_A), "failed to prove"),            # a principal the server does not know
])
def test_a_client_without_the_secret_is_refused(server: PeerServer, config: NetConfig, match: str) -> None:
    with pytest.raises(TierUnavailableError, match=match):
        TcpTransport(*server.address, config)
    deadline = time.monotonic() + 2
    while server.stats().auth_failures == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.stats().auth_failures >= 1
    assert server.stats().requests == 0


def test_a_client_with_a_secret_refuses_a_server_that_cannot_prove_it() -> None:
    with DramTier(4, W) as tier, PeerServer(tier, config=CFG) as open_server:
        with pytest.raises(TierUnavailableError, match="without credentials"):
            TcpTransport(*open_server.address, creds("", CLUSTER))


def raw(srv: PeerServer) -> socket.socket:
    return socket.create_connection(srv.address, timeout=3)


def closed(sock: socket.socket) -> bool:
    """Whether the server closed the connection (without sending anything more)."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_requests_before_the_handshake_are_never_answered(server: PeerServer) -> None:
    # The attack: a raw client asking for slots by number, with no credential.
    with raw(server) as sock:
        send_message(sock, Kind.READ, 0, 0, 1, ReadPages((0, 1, 2)).encode())
        assert closed(sock)
    with raw(server) as sock:                     # HELLO without a nonce, then a read
        send_message(sock, Kind.HELLO, 0, 0, 0, Hello(7).encode())
        header, body, _ = recv_message(sock)
        assert header.kind == Kind.CHALLENGE       # it learns a credential is needed ...
        send_message(sock, Kind.READ, 0, 0, 1, ReadPages((0,)).encode())
        assert closed(sock)                        # ... and gets nothing more
    with raw(server) as sock:                     # a nonce, then a read instead of the answer
        send_message(sock, Kind.HELLO, 0, 0, 0, Hello(7, "", os.urandom(32)).encode())
        assert recv_message(sock)[0].kind == Kind.CHALLENGE
        send_message(sock, Kind.READ, 0, 0, 1, ReadPages((0,)).encode())
        assert closed(sock)
    with raw(server) as sock:                     # a forged answer
        send_message(sock, Kind.HELLO, 0, 0, 0, Hello(7, "", os.urandom(32)).encode())
        recv_message(sock)
        send_message(sock, Kind.AUTH, 0, 0, 1, Auth(b"\0" * 32).encode())
        assert closed(sock)
    assert server.stats().requests == 0


def test_a_recorded_answer_is_no_good_for_another_connection(server: PeerServer) -> None:
    mine = os.urandom(32)
    with raw(server) as sock:
        send_message(sock, Kind.HELLO, 0, 0, 0, Hello(7, "", mine).encode())
        _, ch, _ = recv_message(sock)
        assert isinstance(ch, Challenge)
        answer = auth.client_proof(CLUSTER, "", ch.nonce, mine)
        send_message(sock, Kind.AUTH, 0, 0, 1, Auth(answer).encode())
        assert recv_message(sock)[0].kind == Kind.WELCOME
    with raw(server) as sock:                     # the same hello and answer, replayed
        send_message(sock, Kind.HELLO, 0, 0, 0, Hello(7, "", mine).encode())
        recv_message(sock)                         # a fresh server nonce
        send_message(sock, Kind.AUTH, 0, 0, 1, Auth(answer).encode())
        assert closed(sock)


def test_a_silent_connection_is_cut_at_the_handshake_deadline(server: PeerServer) -> None:
    with raw(server) as sock:
        start = time.monotonic()
        assert closed(sock)
        assert time.monotonic() - start < 3.0


def test_a_keyed_server_answers_slot_numbers_alone_with_nothing(server: PeerServer) -> None:
    with TcpTransport(*server.address, creds("", CLUSTER)) as tr:
        dst = np.zeros((3, W), np.uint8)
        r = tr.read([0, 1, 2], dst).result(5)                       # no keys
        assert r.ok == (False, False, False) and all(m.generation == 0 for m in r.metas)
        assert not dst.any()
        r = tr.read([0, 1], dst[:2], keys=[b"kb", b"ka"]).result(5)  # keys of other slots
        assert r.ok == (False, False) and not dst.any()
        r = tr.read([1], dst[:1], keys=[b"kb"]).result(5)
        assert r.all_ok and np.array_equal(dst[0], pages(3, W, 1)[1])


def test_a_tenant_principal_sees_its_tenant_pages_only(server: PeerServer) -> None:
    with TcpTransport(*server.address, creds("tenant:a", TENANT_A)) as tr:
        res = tr.call("lookup", encode_keys([b"ka", b"kb", b"ku"])).result(5)
        assert res.ok
        assert [m.generation for m in decode_metas(res.body)] == [1, 0, 0]
        dst = np.zeros((3, W), np.uint8)
        r = tr.read([0, 1, 2], dst, keys=[b"ka", b"kb", b"ku"]).result(5)
        assert r.ok == (True, False, False)
        assert np.array_equal(dst[0], pages(3, W, 1)[0]) and not dst[1:].any()
        refused = tr.call("rdma-connect", b"{}").result(5)          # one-sided access reaches every slot
        assert not refused.ok and b"cluster" in refused.body
    with TcpTransport(*server.address, creds("", CLUSTER)) as tr:  # the cluster sees all of them
        res = tr.call("lookup", encode_keys([b"ka", b"kb", b"ku"])).result(5)
        assert [m.generation for m in decode_metas(res.body)] == [1, 1, 1]


def test_the_rdma_connect_call_is_named_before_its_method_runs(server: PeerServer) -> None:
    # Registered by an RDMA server; here a stand-in that must never run for a tenant principal.
    ran: list[object] = []

    def stand_in(body: bytes, scope: auth.Scope) -> bytes:
        ran.append(scope)
        return b"{}"
    server.store.methods["rdma-connect"] = stand_in
    with TcpTransport(*server.address, creds("tenant:a", TENANT_A)) as tr:
        assert not tr.call("rdma-connect", b"{}").result(5).ok
    assert ran == []
    with TcpTransport(*server.address, creds("", CLUSTER)) as tr:
        assert tr.call("rdma-connect", b"{}").result(5).ok
    assert ran == [None]


def test_a_server_without_credentials_binds_only_loopback() -> None:
    with DramTier(2, W) as tier:
        with pytest.raises(ConfigError, match="without credentials"):
            PeerServer(tier, "0.0.0.0", 0)
        with pytest.raises(ConfigError, match="without credentials"):
            PeerServer(tier, "10.1.2.3", 0)
    assert all(map(is_loopback, ["127.0.0.1", "::1", "[::1]", "localhost", "127.1.2.3"]))
    assert not any(map(is_loopback, ["0.0.0.0", "10.0.0.1", "example.com", "::"]))


@pytest.mark.parametrize("content,mode,match", [
    (b"s" * 32, 0o644, "others may read it"),
    (b"short\n", 0o600, "at least 16"),
    (None, 0o600, "cannot read"),
])
def test_secret_files_are_checked(tmp_path: Path, content: bytes | None, mode: int, match: str) -> None:
    path = tmp_path / "secret"
    if content is not None:
        path.write_bytes(content)
        path.chmod(mode)
    with pytest.raises(ConfigError, match=match):
        auth.load_secret(path, "test")


def test_a_secret_file_is_read_whole_and_stripped(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_bytes(b"  " + b"k" * 20 + b"\n")
    path.chmod(0o600)
    assert auth.load_secret(path, "test") == b"k" * 20
    assert "k" * 20 not in repr(Credential("", b"k" * 20))


def test_lookup_over_an_unscoped_method_call_still_needs_the_handshake(server: PeerServer) -> None:
    with raw(server) as sock:
        send_message(sock, Kind.CALL, 0, 0, 1, Call("lookup", encode_keys([b"ka"])).encode())
        assert closed(sock)
