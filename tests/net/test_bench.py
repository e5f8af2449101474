"""``tierkv bench net``: every case measured against a real server process, ratios of the same run."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from tierkv.bench import net
from tierkv.cli.main import main
from tierkv.net import NetConfig, connect

from tests.net.peers import free_port, pages, server_process


def test_bench_net_quick_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "net", "--quick", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    cases = {(r["kind"], r["case"]) for r in out["results"]}
    assert {("tcp", "fetch-1"), ("tcp", "fetch-batch"), ("tcp", "incast-credits"), ("tcp", "incast-no-credits")} <= cases
    assert all(r["misses"] == 0 for r in out["results"])
    assert out["tcp_incast_naks_with_credits"] == 0  # credits: the receiver is never overrun
    assert out["tcp_batch_vs_single_fetch_throughput"] > 0


def test_module_help_runs_no_benchmark() -> None:
    proc = subprocess.run([sys.executable, "-m", "tierkv.bench.net", "--help"], capture_output=True, text=True,
                          timeout=120, cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0 and proc.stdout.startswith("usage: python3 -m tierkv.bench.net")
    assert "--json" in proc.stdout and "fetch-1" not in proc.stdout


def test_module_main_json_and_default_lines(monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    assert net.main(["--quick", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tcp_incast_naks_with_credits"] == 0 and {r["case"] for r in out["results"]} >= {"fetch-1"}
    seen: list[dict[str, int]] = []
    row = net.NetBenchResult("tcp", "fetch-1", 1.0, 2.0, 3.0, 4.0, 0, 0)

    def bench_local(**kw: int) -> list[net.NetBenchResult]:
        seen.append(kw)
        return [row]

    monkeypatch.setattr(net, "bench_local", bench_local)
    assert net.main([]) == 0
    assert capsys.readouterr().out == f"{row}\n" and seen == [{"pages": 64, "fetches": 500}]  # as before: full sizes


def test_incast_sides_differ_in_credits_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Credits on against off changes the credit gate and nothing else (same window), and the JSON says which window."""
    seen: list[NetConfig] = []
    real = net.connect

    def spy(host: str, port: int, kind: str, cfg: NetConfig) -> object:
        seen.append(cfg)
        return real(host, port, kind, cfg)  # type: ignore[arg-type]

    monkeypatch.setattr(net, "connect", spy)
    out = net._report(net.bench_local(page_bytes=4096, pages=8, fetches=16, senders=2))
    on = {c for c in seen if c.credits and c.recv_credits == 4}
    off = {c for c in seen if not c.credits}
    assert len(on) == 1 and len(off) == 1
    assert replace(on.pop(), credits=False) == off.pop()
    assert out["incast"] == {"window": net.INCAST_WINDOW, "links": 1, "server_recv_credits": 4}
    assert {c.window for c in seen if c.recv_credits == 4} == {net.INCAST_WINDOW}


def test_fetched_pages_compared_with_their_source() -> None:
    """The byte check is real: the published pages pass, any other source fails every fetch."""
    port, width, n = free_port(), 4096, 8
    with server_process(port, n + 2 * 8, width, stored=n, seed=3):
        good = net.run_net_bench("127.0.0.1", port, page_bytes=width, pages=n, fetches=16, senders=2,
                                 source=pages(n, width, seed=3))
        wrong = net.run_net_bench("127.0.0.1", port, page_bytes=width, pages=n, fetches=16, senders=2,
                                  source=pages(n, width, seed=4))
        unchecked = net.run_net_bench("127.0.0.1", port, page_bytes=width, pages=n, fetches=16, senders=2)
    assert all(r.mismatches == 0 for r in good)
    fetched = {r.case: r.mismatches for r in wrong if r.case.startswith("fetch")}
    assert fetched == {"fetch-1": 16, "fetch-batch": 3 * n}  # every fetch of every page, 3 batched rounds
    assert all(r.mismatches == 0 for r in wrong if r.case.startswith("incast"))  # pushes are checked by read-back
    assert [r.mismatches for r in unchecked if r.case.startswith("fetch")] == [None, None]


def test_incast_read_back_catches_wrong_bytes() -> None:
    """The read-back after an incast compares each stored page with what its sender pushed."""
    port, width = free_port(), 4096
    with server_process(port, 4, width):
        with connect("127.0.0.1", port, "tcp", NetConfig()) as tr:
            res = [tr.write([s], [1], net._sender_page(s % 2, width)).result(30) for s in range(4)]
        assert all(r.all_stored for r in res)
        stored = {s: (r.metas[0], s % 2) for s, r in enumerate(res)}
        assert net._read_back("tcp", "127.0.0.1", port, width, stored) == 0
        swapped = {s: (m, 1 - i) for s, (m, i) in stored.items()}
        assert net._read_back("tcp", "127.0.0.1", port, width, swapped) == 4


def test_main_fails_on_a_mismatch(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    row = net.NetBenchResult("tcp", "incast-credits", 1.0, 2.0, 3.0, 4.0, 0, 0, mismatches=2)
    monkeypatch.setattr(net, "bench_local", lambda **kw: [row])
    assert net.main(["--json"]) == 1
    out = capsys.readouterr()
    assert json.loads(out.out)["mismatches"] == 2 and "2 pages differed" in out.err
