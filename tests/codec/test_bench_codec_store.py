"""``tierkv bench codec-store``: both codecs through a real store in one run, every page checked."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from tests.codec.conftest import requires_kv
from tierkv.bench.codec_store import run_codec_store_bench
from tierkv.cli.main import main


@requires_kv
def test_codec_store_bench_figures(tmp_path: Path) -> None:
    out = run_codec_store_bench(runs=1, where=str(tmp_path), copies=1, capacity_pages=8)
    for codec in ("none", "lossless"):
        fig = out[codec]
        assert isinstance(fig, dict) and fig["put_gbps"] > 0 and fig["get_gbps"] > 0
    none, lossless = out["none"], out["lossless"]
    assert isinstance(none, dict) and isinstance(lossless, dict)
    assert none["pages_before_first_eviction"] == 8 and none["raw_page_equivalents_used"] == 1.0
    # Real BF16 pages code to about 0.65: the same tier holds clearly more of them.
    assert lossless["pages_before_first_eviction"] >= 10
    assert isinstance(out["space_ratio"], float) and out["space_ratio"] < 0.8


@requires_kv
def test_cli_codec_store_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "codec-store", "--quick", "--json", "--dir", str(tmp_path)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"none", "lossless", "capacity_gain", "space_ratio", "put_ratio", "get_ratio"} <= set(out)
    assert out["auto"]["mode"] == "auto" and out["auto"]["reason"].startswith("auto, ")
    assert out["throttled"] == []


def test_device_mbps_is_checked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for bad in ("0", "-5", "fast", "300,", "inf", "nan", "0.5", "1e9"):
        assert main(["bench", "codec-store", "--json", "--dir", str(tmp_path), "--device-mbps", bad]) == 2
        assert "--device-mbps" in capsys.readouterr().err
    assert main(["bench", "codec", "--device-mbps", "300"]) == 2
    assert "--device-mbps is for the codec-store suite" in capsys.readouterr().err


def _throttle_available(path: Path) -> str | None:
    """Why the kernel's block throttle cannot run here (device_throttle's own refusal:
    not root, no block device, no controller), or None."""
    from tierkv.bench.throttle import device_throttle
    from tierkv.errors import InputError

    try:
        with device_throttle(path, 10**9):
            pass
    except (InputError, OSError) as e:
        return str(e)
    return None


def _throttled_bytes(stats: str, node: str) -> int:
    """Bytes read plus written on ``node`` in a v1 ``blkio.throttle.io_service_bytes``
    text (the cgroup's own accounting)."""
    total = 0
    for line in stats.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0] == node and parts[1] in ("Read", "Write"):
            total += int(parts[2])
    return total


def test_device_throttle_paces_o_direct_io_and_cleans_up(tmp_path: Path) -> None:
    """The throttle the codec-store bench uses is the kernel's: O_DIRECT reads of 16 MiB
    capped at 8 MB/s take most of two seconds (its first time slice lets under a MB
    through), the cgroup accounts for them, and afterwards this process is back where it
    was and the cgroup is gone."""
    why = _throttle_available(tmp_path)
    if why:
        pytest.skip(why)
    import mmap
    import time

    from tierkv.bench.throttle import device_throttle

    size = 16 << 20
    path = tmp_path / "blob"
    buf = mmap.mmap(-1, size)   # page-aligned, as O_DIRECT wants
    buf.write(os.urandom(size))
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    try:
        os.pwrite(fd, buf, 0)
        os.fsync(fd)
        before = Path("/proc/self/cgroup").read_text()
        with device_throttle(tmp_path, 8_000_000) as cap:
            group = Path(str(cap["cgroup"]))
            assert str(os.getpid()) in (group / "cgroup.procs").read_text().split()
            t = time.monotonic()
            assert os.preadv(fd, [buf], 0) == size
            elapsed = time.monotonic() - t
            if cap["version"] == 1:
                assert _throttled_bytes((group / "blkio.throttle.io_service_bytes").read_text(),
                                       str(cap["device"])) >= size
        assert elapsed > 1.2, f"16 MiB at 8 MB/s took {elapsed:.2f} s: the throttle did not pace the reads"
        assert Path("/proc/self/cgroup").read_text() == before and not group.exists()
    finally:
        os.close(fd)
        buf.close()


def test_device_throttle_leaves_for_the_root_when_its_cgroup_is_gone(tmp_path: Path) -> None:
    """systemd removes a scope the moment it empties: moving back must not strand this
    process in the throttled cgroup (its I/O capped for the rest of the run)."""
    why = _throttle_available(tmp_path)
    if why:
        pytest.skip(why)
    from tierkv.bench.throttle import V1, V2, device_throttle

    v2 = (V2 / "cgroup.controllers").exists() and "io" in (V2 / "cgroup.controllers").read_text().split()
    root = V2 if v2 else V1
    before = Path("/proc/self/cgroup").read_text()
    home = root / f"tierkv-test-home-{os.getpid()}"
    home.mkdir()
    try:
        (home / "cgroup.procs").write_text(f"{os.getpid()}\n")
        with device_throttle(tmp_path, 10**9) as cap:
            home.rmdir()   # as systemd does with an empty scope
        group = Path(str(cap["cgroup"]))
        assert not group.exists()
        mine = [line for line in Path("/proc/self/cgroup").read_text().splitlines()
                if (line.startswith("0::") if v2 else ":blkio:" in line)]
        assert mine and mine[0].endswith(":/"), mine   # at the hierarchy's root
    finally:
        for line in before.splitlines():   # back where the test started
            _, names, path = line.split(":", 2)
            if (v2 and names == "") or (not v2 and "blkio" in names.split(",")):
                (root / path.lstrip("/") / "cgroup.procs").write_text(f"{os.getpid()}\n")
        if home.exists():
            home.rmdir()


@requires_kv
def test_codec_store_bench_on_a_throttled_disk(tmp_path: Path) -> None:
    why = _throttle_available(tmp_path)
    if why:
        pytest.skip(why)
    out = run_codec_store_bench(runs=1, where=str(tmp_path), copies=1, capacity_pages=8, device_mbps=[400])
    runs = out["throttled"]
    assert isinstance(runs, list) and len(runs) == 1
    t: Any = runs[0]
    assert t["device_mbps"] == 400 and t["pages"] * out["page_bytes"] >= 400e6   # a second of raw reads
    for codec in ("none", "lossless"):
        assert t[codec]["put_gbps"] > 0 and t[codec]["get_gbps"] > 0
    assert t["none"]["get_gbps"] < 0.6   # paced near 0.4 GB/s (the first slice's burst aside)
    assert t["auto"]["mode"] == "auto" and t["auto"]["coding"] in (True, False)
    json.dumps(out)
