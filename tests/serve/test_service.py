"""The node service across processes: clients in other processes, clients killed with
SIGKILL mid-put, the daemon killed and restarted under a client, hostile and stalled
connections, the socket's permissions, SIGTERM."""

from __future__ import annotations

import fcntl
import json
import mmap
import os
import signal
import socket
import stat
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import LAYOUT, PB, make_config
from tests.polling import wait_for
from tests.serve.conftest import AnyStore
from tests.serve.pagegen import pages_of, prompt
from tierkv.errors import ConfigError, InputError, StoreBusyError, StoreUnavailableError
from tierkv.serve import protocol as P
from tierkv.serve.daemon import NodeService
from tierkv.store.api import Store

TPP = LAYOUT.tokens_per_page
ROOT = Path(__file__).resolve().parents[2]

# The header of every client process: the same prompts and page bytes as here.
CLIENT_LIB = textwrap.dedent(f"""
    import sys
    import numpy as np
    sys.path.insert(0, {str(ROOT)!r})
    from tests.serve.pagegen import PB, TPP, pages_of, prompt
    from tierkv.store.api import Store
""")


def run_client(sock: Path, body: str, *args: str) -> subprocess.Popen[str]:
    code = CLIENT_LIB + textwrap.dedent(body)
    return subprocess.Popen([sys.executable, "-c", code, str(sock), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def check_everything_served_is_exact(client: AnyStore, prompts: range, pages: int) -> int:
    """Every page of every prompt a get returns has its bytes; returns how many were served."""
    served = 0
    for i in prompts:
        tokens = prompt(i, pages)
        out = np.zeros((pages, PB), np.uint8)
        n = client.get(tokens, out).pages
        assert np.array_equal(out[:n], pages_of(tokens)[:n]), f"prompt {i}: wrong bytes"
        served += n
    return served


@pytest.fixture
def service(tmp_path: Path, sock_dir: Path) -> Iterator[NodeService]:
    svc = NodeService(make_config(tmp_path / "s", 16, 64, policy="lru"), sock_dir / "d.sock").start()
    yield svc
    svc.close()


def test_clients_in_other_processes_share_one_store(service: NodeService) -> None:
    writer = run_client(service.path, """
        s = Store.connect(sys.argv[1])
        for i in range(6):
            t = prompt(i, 3)
            assert s.put(t, pages_of(t)).stored == 3
        buf = s.page_buffer(3)             # and once from a shared page buffer, no copy here
        t = prompt(6, 3)
        buf[:] = pages_of(t)
        assert s.put(t, buf).stored == 3
        print("ok")
    """)
    assert writer.communicate(timeout=60)[0].strip() == "ok", writer.stderr
    readers = [run_client(service.path, """
        s = Store.connect(sys.argv[1])
        buf = s.page_buffer(3)
        for i in range(7):
            t = prompt(i, 3)
            out = buf if i %% 2 else np.zeros((3, PB), np.uint8)
            assert s.get(t, out).pages == 3 and np.array_equal(out, pages_of(t)), i
        print("ok")
    """.replace("%%", "%")) for _ in range(2)]
    for r in readers:
        out, err = r.communicate(timeout=60)
        assert out.strip() == "ok", err
    assert service.store.stats().pages_hit == 42
    assert wait_for(lambda: service.clients == 0, 10)


def test_a_client_killed_mid_put_publishes_no_partial_page_and_leaks_nothing(service: NodeService,
                                                                               soak: bool) -> None:
    """SIGKILL at random moments of a client putting prompts of 1-8 pages (through its
    scratch segment and from a page buffer): afterwards every page served is exact, the
    manager's table and the tiers' free lists agree (no slot reserved for a dead client),
    and no connection of the dead client remains."""
    kills = 100 if soak else 12
    rng = np.random.default_rng(0)
    reader = Store.connect(service.path)
    try:
        for k in range(kills):
            client = run_client(service.path, """
                import itertools
                s = Store.connect(sys.argv[1])
                buf = s.page_buffer(8)
                first = int(sys.argv[2])
                print("up", flush=True)
                for i in itertools.count(first):
                    t = prompt(i %% 40, 1 + i %% 8)
                    if i %% 2:
                        n = len(t) // TPP
                        buf[:n] = pages_of(t)
                        s.put(t, buf[:n])
                    else:
                        s.put(t, pages_of(t))
            """.replace("%%", "%"), str(k * 7))
            assert client.stdout is not None
            assert client.stdout.readline().strip() == "up", client.stderr.read() if client.stderr else ""
            time.sleep(float(rng.uniform(0.0, 0.3)))
            client.send_signal(signal.SIGKILL)
            client.wait(timeout=30)
            with service.store._lock:
                service.store._manager.check()
        assert wait_for(lambda: service.clients == 1, 10)
        served = sum(check_everything_served_is_exact(reader, range(i, i + 1), 1 + i % 8) for i in range(40))
        assert served > 0
        with service.store._lock:
            service.store._manager.check()
            for t in service.store._manager.tiers:   # every used slot is a page's copy
                used = t.num_slots - t.num_free
                lvl = service.store._manager.levels[t.name]
                held = int(((service.store._manager.table.where >> lvl) & 1).sum())
                assert used == held, (t.name, used, held)
    finally:
        reader.close()


def _serve(cfg_path: Path, sock: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-m", "tierkv", "serve", "--config", str(cfg_path), "--socket",
                             str(sock), "--json", "--foreground", "--log-level", "WARNING"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        raise AssertionError(f"tierkv serve did not start: {proc.stderr.read() if proc.stderr else ''}")
    assert json.loads(line)["socket"] == str(sock)
    return proc


def _toml(tmp_path: Path, dram: str | None, nvme: str) -> Path:
    cfg = tmp_path / "store.toml"
    dram_part = f'[tiers.dram]\ncapacity_bytes = "{dram}"\n' if dram else ""
    cfg.write_text(textwrap.dedent(f"""
        [store]
        path = "{tmp_path / 'store'}"
        model_id = "test-model"
        policy = "lru"
        durability = "put"
        [layout]
        num_layers = {LAYOUT.num_layers}
        num_kv_heads = {LAYOUT.num_kv_heads}
        head_dim = {LAYOUT.head_dim}
        dtype = "bf16"
        tokens_per_page = {TPP}
    """) + dram_part + f'[tiers.nvme]\ncapacity_bytes = "{nvme}"\n')
    return cfg


def test_a_daemon_killed_and_restarted_keeps_durable_pages_and_clients_reconnect(
        tmp_path: Path, sock_dir: Path, soak: bool) -> None:
    cfg, sock = _toml(tmp_path, None, "4MiB"), sock_dir / "d.sock"
    daemon = _serve(cfg, sock)
    client = Store.connect(sock, timeout_s=10)
    try:
        put = 0
        for k in range(20 if soak else 3):
            for i in range(put, put + 4):
                t = prompt(i, 2)
                assert client.put(t, pages_of(t)).stored == 2
            put += 4
            daemon.send_signal(signal.SIGKILL)
            daemon.wait(timeout=30)
            with pytest.raises(StoreUnavailableError, match="tierkv daemon"):
                client.lookup(prompt(0, 2))
            daemon = _serve(cfg, sock)       # the stale socket file is taken over
            assert check_everything_served_is_exact(client, range(put), 2) == 2 * put, f"after kill {k}"
        daemon.send_signal(signal.SIGKILL)   # and a restart no call saw: the next one is answered, not refused
        daemon.wait(timeout=30)
        daemon = _serve(cfg, sock)
        assert client.lookup(prompt(0, 2)).cached_pages == 2
    finally:
        client.close()
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(timeout=60) == 0


def test_sigterm_closes_the_store_cleanly_and_removes_the_socket(tmp_path: Path, sock_dir: Path) -> None:
    cfg, sock = _toml(tmp_path, "1MiB", "4MiB"), sock_dir / "d.sock"
    daemon = _serve(cfg, sock)
    assert stat.S_IMODE(sock.stat().st_mode) == 0o600
    with Store.connect(sock) as client:
        for i in range(3):
            t = prompt(i, 2)
            client.put(t, pages_of(t))
    daemon.send_signal(signal.SIGTERM)
    assert daemon.wait(timeout=60) == 0, daemon.stderr.read() if daemon.stderr else ""
    assert not sock.exists()
    with Store.open(cfg) as s:
        for i in range(3):
            t = prompt(i, 2)
            out = np.zeros((2, PB), np.uint8)
            assert s.get(t, out).pages == 2 and np.array_equal(out, pages_of(t))


def test_stalled_and_garbage_connections_do_not_hold_up_others(tmp_path: Path, sock_dir: Path) -> None:
    svc = NodeService(make_config(tmp_path / "s"), sock_dir / "d.sock", body_timeout_s=0.5).start()
    try:
        stalled = socket.socket(socket.AF_UNIX)
        stalled.connect(str(svc.path))
        stalled.sendall(P.HEADER.pack(100, P.Op.LOOKUP, 0) + b"x" * 10)   # then nothing
        huge = socket.socket(socket.AF_UNIX)
        huge.connect(str(svc.path))
        huge.sendall(P.HEADER.pack(P.MAX_BODY + 1, P.Op.PUT, 0))
        junk = socket.socket(socket.AF_UNIX)
        junk.connect(str(svc.path))
        junk.sendall(P.HEADER.pack(3, 999, 0) + b"abc")
        with Store.connect(svc.path, timeout_s=5) as client:
            t = prompt(1, 2)
            start = time.monotonic()
            client.put(t, pages_of(t))
            assert client.lookup(t).cached_pages == 2
            assert time.monotonic() - start < 5
            for s in (huge, junk, stalled):   # each is closed by the daemon
                s.settimeout(10)
                assert s.recv(1 << 16) == b""
            assert wait_for(lambda: svc.clients == 1, 10)
    finally:
        svc.close()


def test_an_unsealed_segment_and_a_segment_overrun_are_refused(service: NodeService) -> None:
    sock = socket.socket(socket.AF_UNIX)
    sock.connect(str(service.path))
    sock.settimeout(10)
    fd = os.memfd_create("plain", os.MFD_CLOEXEC)   # can shrink under the daemon: refused
    os.ftruncate(fd, 1 << 20)
    P.send_frame(sock, P.Op.SEGMENT, P.SEGMENT_REQ.pack(1, 1 << 20), fds=(fd,))
    _, status, body, _ = P.recv_frame(sock)
    assert status == P.Status.ERROR and json.loads(bytes(body))["type"] == InputError.__name__
    assert "F_SEAL_SHRINK" in json.loads(bytes(body))["message"]
    os.close(fd)
    fd = os.memfd_create("sparse", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)   # costs its maker nothing
    os.ftruncate(fd, 2 << 40)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
    P.send_frame(sock, P.Op.SEGMENT, P.SEGMENT_REQ.pack(2, 2 << 40), fds=(fd,))
    _, status, body, _ = P.recv_frame(sock)   # would take 2 TiB of the daemon's address space
    assert status == P.Status.ERROR and "at most 1 TiB of segments" in json.loads(bytes(body))["message"]
    os.close(fd)
    client = Store.connect(service.path)
    try:
        conn = client._acquire()
        t = prompt(2, 2)
        scratch, _ = conn.scratch_rows(1, PB)
        with pytest.raises(InputError, match="run past page segment"):   # 2 pages into a 1-page... segment
            conn.call(P.Op.PUT, P.token_body(b"", t.astype("<u4").tobytes(),
                                             P.PUT_REQ.pack(scratch.id, scratch.size - PB, 2, 0, 1, 0.0)))
        assert client.lookup(t).cached_pages == 0
    finally:
        client.close()
        sock.close()


def test_socket_rules(tmp_path: Path, sock_dir: Path) -> None:
    cfg = make_config(tmp_path / "s")
    (sock_dir / "file").write_text("x")
    with pytest.raises(ConfigError, match="is not a socket"):
        NodeService(cfg, sock_dir / "file")
    with pytest.raises(ConfigError, match="107 bytes"):
        NodeService(cfg, sock_dir / ("x" * 120))
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(sock_dir / "d.sock"))
    stale.close()                                   # a socket file no one listens on
    svc = NodeService(cfg, sock_dir / "d.sock", mode=0o660, max_clients=1).start()
    try:
        assert stat.S_IMODE((sock_dir / "d.sock").stat().st_mode) == 0o660
        with pytest.raises(StoreBusyError, match="already listens"):
            NodeService(make_config(tmp_path / "other"), sock_dir / "d.sock")
        assert wait_for(lambda: svc.clients == 0, 10)   # its probe was a connection too, of the only one allowed
        with Store.connect(svc.path) as first:
            assert first.lookup(prompt(1, 1)).cached_pages == 0
            with pytest.raises(StoreBusyError, match="serves 1 clients already"):
                Store.connect(svc.path)
    finally:
        svc.close()
    with pytest.raises(StoreUnavailableError, match="no tierkv daemon answers"):
        Store.connect(sock_dir / "d.sock")


def test_threads_of_one_client_run_at_once(service: NodeService) -> None:
    client = Store.connect(service.path)
    errors: list[BaseException] = []

    def work(base: int) -> None:
        try:
            for i in range(base, base + 10):
                t = prompt(i, 2)
                client.put(t, pages_of(t))
                out = np.zeros((2, PB), np.uint8)
                n = client.get(t, out).pages
                assert np.array_equal(out[:n], pages_of(t)[:n])
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
    threads = [threading.Thread(target=work, args=(100 * k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    client.close()
    assert not errors, errors
    assert wait_for(lambda: service.clients == 0, 10)


def test_a_slow_answer_is_waited_for_not_abandoned(service: NodeService, monkeypatch: pytest.MonkeyPatch) -> None:
    """A call returns only once the daemon is done with the caller's buffer: before, a
    put that outlived the client's timeout raised while the daemon still read the
    buffer, and the next prompt written into it was stored under the first one's keys."""
    put = Store.put

    def slow_put(self: Store, *a: object, **k: object) -> object:
        time.sleep(1.0)
        return put(self, *a, **k)  # type: ignore[arg-type]
    monkeypatch.setattr(Store, "put", slow_put)
    with Store.connect(service.path, timeout_s=0.2) as client:
        buf = client.page_buffer(2)
        a, b = prompt(1, 2), prompt(2, 2)
        buf[:] = pages_of(a)
        assert client.put(a, buf).stored == 2
        buf[:] = pages_of(b)
        assert client.put(b, buf).stored == 2
        for t in (a, b):
            out = np.zeros((2, PB), np.uint8)
            assert client.get(t, out).pages == 2 and np.array_equal(out, pages_of(t))


def test_pins_and_mappings_go_with_the_connection(service: NodeService) -> None:
    """A client that exits holding pins must not hold pages for good; a connection's
    scratch segment, grown, replaces its mapping in the daemon instead of adding one."""
    a = prompt(1, 4)
    client = Store.connect(service.path)
    client.put(a, pages_of(a))
    assert client.pin(a) == 4 and client.pin(a) == 4
    assert client.unpin(a) == 4                       # one of the two released by the client
    for n in range(1, 9):                             # batches of growing size: the scratch grows
        t = prompt(100 + n, n)
        client.put(t, pages_of(t))
    assert service.mapped_segments == 1               # one scratch mapping, however often it grew
    client.close()
    assert wait_for(lambda: service.clients == 0, 10)
    assert service.mapped_segments == 0
    assert service.store.unpin(a) == 0                # the pin left outstanding was released at close


def test_running_out_of_descriptors_does_not_stop_accepting(tmp_path: Path, sock_dir: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    service = NodeService(make_config(tmp_path / "s"), sock_dir / "d.sock")
    listener = service._listener
    failing = {"left": 3}

    class Flaky:
        def accept(self) -> tuple[socket.socket, object]:
            if failing["left"]:
                failing["left"] -= 1
                raise OSError(24, "Too many open files")
            return listener.accept()

        def __getattr__(self, name: str) -> object:
            return getattr(listener, name)
    monkeypatch.setattr(service, "_listener", Flaky())
    service.start()
    try:
        with Store.connect(service.path, timeout_s=10) as client:   # accepted once descriptors are back
            assert client.lookup(prompt(1, 1)).total_pages == 1
        assert failing["left"] == 0
    finally:
        monkeypatch.setattr(service, "_listener", listener)
        service.close()


def test_descriptors_sent_with_a_broken_frame_are_closed(service: NodeService) -> None:
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(20):
        fd = os.memfd_create("junk", os.MFD_CLOEXEC)
        s = socket.socket(socket.AF_UNIX)
        s.connect(str(service.path))
        s.sendmsg([P.HEADER.pack(16, P.Op.SEGMENT, 0)[:3]], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                                              np.array([fd], np.int32).tobytes())])
        s.close()                                     # a header cut short, with a descriptor riding on it
        os.close(fd)
    assert wait_for(lambda: service.clients == 0, 10)
    assert len(os.listdir("/proc/self/fd")) <= before + 2


class _StreamedLookup:
    """A client that speaks the protocol by hand: a streamed lookup (FLAG_STREAMED) whose
    ids and progress word the test writes when it likes."""

    def __init__(self, path: Path, tokens: np.ndarray) -> None:
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.connect(str(path))
        self.sock.settimeout(10)
        self.n = tokens.size
        size = 64 + 4 * self.n
        self.fd = os.memfd_create("ids", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(self.fd, size)
        fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
        self.map = mmap.mmap(self.fd, size)
        self.word = np.frombuffer(self.map, np.uint64, 1)
        self.ids = np.frombuffer(self.map, "<u4", self.n, 64)
        self.ids[:] = tokens
        P.send_frame(self.sock, P.Op.SEGMENT, P.SEGMENT_REQ.pack(1, size), fds=(self.fd,))
        assert P.recv_frame(self.sock)[1] == P.Status.OK

    def send(self, ready: int) -> None:
        self.word[0] = ready
        head = P.LOOKUP_REQ.pack(P.FLAG_COUNT | P.FLAG_STREAMED, 0.0) + P.STREAM_REQ.pack(0)
        P.send_frame(self.sock, P.Op.LOOKUP, P.token_ref(b"", 1, 64, self.n, head))

    def reply(self) -> tuple[int, bytes]:
        _, status, body, _ = P.recv_frame(self.sock)
        return status, bytes(body)

    def close(self) -> None:
        del self.word, self.ids
        self.map.close()
        os.close(self.fd)
        self.sock.close()


def test_a_streamed_lookup_waits_for_its_ids_and_ends_with_its_client(tmp_path: Path, sock_dir: Path) -> None:
    """The daemon hashes a stretch of a streamed lookup only once the client's progress
    word counts its ids; a client that abandons the lookup gets an InputError and keeps
    its connection; one that closes its socket, overstates its progress or stalls past
    the request deadline loses its connection, and the daemon's thread ends."""
    svc = NodeService(make_config(tmp_path / "s", 700, 0), sock_dir / "d.sock", body_timeout_s=1.0).start()
    try:
        tokens = np.random.default_rng(9).integers(0, 50000, 2000 * TPP, dtype=np.int64)
        with Store.connect(svc.path) as client:
            assert client.put(tokens[:600 * TPP], np.zeros((600, PB), np.uint8)).stored == 600
        raw = _StreamedLookup(svc.path, tokens)
        written = tokens[:64 * TPP].astype("<u4")
        raw.ids[64 * TPP:] = 0   # not written yet: a daemon that read them would find a miss at page 64
        raw.send(64 * TPP)
        raw.sock.settimeout(0.3)
        with pytest.raises(TimeoutError):   # the first stretch hit: it waits for the second's ids
            raw.reply()
        raw.sock.settimeout(10)
        assert np.array_equal(raw.ids[:64 * TPP], written)
        raw.ids[:] = tokens
        raw.word[0] = tokens.size
        status, body = raw.reply()
        assert status == P.Status.OK and P.LOOKUP_REP.unpack_from(body)[:3] == (600, 600 * TPP, 2000)
        taken = np.frombuffer(raw.map, np.uint64, 2)
        assert taken[1] == 1   # the daemon marked it taken up (the client polls for the reply only then)
        taken[1] = 0

        overlap = P.LOOKUP_REQ.pack(P.FLAG_COUNT | P.FLAG_STREAMED, 0.0) + P.STREAM_REQ.pack(56)
        P.send_frame(raw.sock, P.Op.LOOKUP, P.token_ref(b"", 1, 64, raw.n, overlap))
        status, body = raw.reply()   # its ids would overlap the daemon's word: refused, nothing written
        assert status == P.Status.ERROR and "overlap" in json.loads(body)["message"] and taken[1] == 0
        del taken   # (the map closes with the raw client)

        raw.send(64 * TPP)
        raw.word[0] = P.STREAM_ABANDONED
        status, body = raw.reply()
        assert status == P.Status.ERROR and json.loads(body)["type"] == InputError.__name__
        raw.send(tokens.size)   # the connection goes on
        assert P.LOOKUP_REP.unpack_from(raw.reply()[1])[0] == 600

        raw.send(tokens.size + 1)   # more ids than the request has
        assert raw.sock.recv(1) == b""
        raw.close()
        assert wait_for(lambda: svc.clients == 0, 10)

        gone = _StreamedLookup(svc.path, tokens)
        gone.send(64 * TPP)
        time.sleep(0.05)
        start = time.monotonic()
        gone.close()   # mid-lookup: its thread notices well before the deadline
        assert wait_for(lambda: svc.clients == 0, 10)
        assert time.monotonic() - start < 0.9

        stalled = _StreamedLookup(svc.path, tokens)
        start = time.monotonic()
        stalled.send(64 * TPP)
        assert stalled.sock.recv(1) == b""   # closed at the request deadline
        assert 0.9 < time.monotonic() - start < 8
        stalled.close()

        slow = _StreamedLookup(svc.path, tokens)   # a stretch just inside the deadline, then nothing
        start = time.monotonic()
        slow.send(64 * TPP)
        time.sleep(0.7)
        slow.word[0] = 576 * TPP
        slow.sock.settimeout(10)
        assert slow.sock.recv(1) == b""   # the deadline counts from the lookup's start, not each stretch's
        assert 0.9 < time.monotonic() - start < 1.6
        slow.close()
        with Store.connect(svc.path) as client:   # and the daemon serves on
            assert client.lookup(tokens).cached_pages == 600
    finally:
        svc.close()


def test_a_client_sleeps_for_a_streamed_lookup_the_daemon_has_not_taken_up(
        tmp_path: Path, sock_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its ids narrowed, a client polls for the reply only if the daemon has marked the
    lookup taken up (else the daemon may be queued on the client's own core, behind the
    polling); unmarked, it sleeps on the socket and gets the same answer."""
    from tierkv.serve import client as C

    svc = NodeService(make_config(tmp_path / "s", 700, 0), sock_dir / "d.sock").start()
    try:
        tokens = np.random.default_rng(3).integers(0, 50000, 2000 * TPP, dtype=np.int64)
        with Store.connect(svc.path) as client:
            assert client.put(tokens[:600 * TPP], np.zeros((600, PB), np.uint8)).stored == 600
            polls: list[float] = []
            monkeypatch.setattr(C._Conn, "_spin", lambda self, seconds: polls.append(seconds))
            read = C.landed_words.read
            monkeypatch.setattr(C.landed_words, "read", lambda rec, word: 0 if word == 1 else read(rec, word))
            assert client.lookup(tokens).cached_pages == 600 and polls == []
            monkeypatch.setattr(C.landed_words, "read", lambda rec, word: 1 if word == 1 else read(rec, word))
            assert client.lookup(tokens).cached_pages == 600 and polls == [C.SPIN_S]
    finally:
        svc.close()
