"""tierkv doctor against fake sysfs trees: a healthy mlx5 RoCE host, a soft-RoCE host with
MTU 1500, and a host with nothing at all; and the CLI's --json shape and exit status."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import pytest

from tests.nvmeof.test_sysfs import add_controller
from tierkv.cli.main import main
from tierkv.cli.doctor import Probe, Status, memory_checks, run_checks, summary

DCB_PFC = "pfc-cap 8 macsec-bypass off delay 4096\nprio-pfc 0:off 1:off 2:off 3:on 4:off 5:off 6:off 7:off\n"


def _w(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def _ibv_devinfo(mtu: str) -> str:
    return (f"hca_id:\tdev\n\ttransport:\t\t\tInfiniBand (0)\n\tphys_port_cnt:\t\t\t1\n"
            f"\t\tport:\t1\n\t\t\tstate:\t\t\tPORT_ACTIVE (4)\n\t\t\tmax_mtu:\t\t4096 (5)\n"
            f"\t\t\tactive_mtu:\t\t{mtu}\n\t\t\tlink_layer:\t\tEthernet\n")


def _rdma_device(sysfs: Path, dev: str, ifname: str, *, soft: bool) -> None:
    base = sysfs / "devices" / ("virtual/infiniband" if soft else "pci0000:40/0000:41:00.0/infiniband") / dev
    port = base / "ports/1"
    for name, value in (("state", "4: ACTIVE"), ("phys_state", "5: LinkUp"), ("link_layer", "Ethernet"),
                        ("rate", "10 Gb/sec (1X QDR)" if soft else "100 Gb/sec (2X HDR)"), ("lid", "0x0")):
        _w(port / name, value)
    for i, kind in enumerate(("IB/RoCE v1", "RoCE v2", "IB/RoCE v1", "RoCE v2")):
        _w(port / "gid_attrs/ndevs" / str(i), ifname)
        _w(port / "gid_attrs/types" / str(i), kind)
    _w(base / "node_type", "1: CA")
    if soft:
        _w(base / "parent", ifname)
    (sysfs / "class/infiniband").mkdir(parents=True, exist_ok=True)
    os.symlink(os.path.relpath(base, sysfs / "class/infiniband"), sysfs / "class/infiniband" / dev)


def _modules(sysfs: Path, *names: str) -> None:
    for n in names:
        (sysfs / "module" / n / "parameters").mkdir(parents=True)


def _tools(outputs: dict[str, str], present: Sequence[str]) -> tuple[object, object]:
    def which(name: str) -> str | None:
        return f"/usr/bin/{name}" if name in present else None

    def run(argv: Sequence[str]) -> tuple[int, str]:
        key = os.path.basename(argv[0])
        return (0, outputs[key]) if key in outputs else (127, f"{key}: not found")
    return which, run


@pytest.fixture
def roots(tmp_path: Path) -> tuple[Path, Path, Path]:
    return tmp_path / "sys", tmp_path / "dev", tmp_path / "etc"


def _by_name(checks: Sequence[object]) -> dict[str, tuple[Status, str]]:
    return {c.check: (c.status, c.detail) for c in checks}  # type: ignore[attr-defined]


def test_healthy_roce_host(roots: tuple[Path, Path, Path]) -> None:
    sysfs, dev, etc = roots
    _rdma_device(sysfs, "mlx5_0", "enp65s0f0np0", soft=False)
    _w(sysfs / "class/net/enp65s0f0np0/mtu", "9000")
    for role in ("roce_np", "roce_rp"):
        for prio in range(8):
            _w(sysfs / "class/net/enp65s0f0np0/ecn" / role / "enable" / str(prio), "1" if prio == 3 else "0")
    _modules(sysfs, "nvme_core", "nvme_fabrics", "nvme_rdma", "nvme_tcp", "nvmet", "nvmet_rdma",
             "nvmet_tcp", "ib_uverbs")
    (sysfs / "kernel/config/nvmet").mkdir(parents=True)
    _w(dev / "nvme-fabrics", "")
    _w(dev / "infiniband/uverbs0", "")
    _w(etc / "nvme/hostnqn", "nqn.2014-08.org.nvmexpress:uuid:f7536c1e-bc57-4dbb-8ea6-f1ad3af84371")
    _w(etc / "nvme/hostid", "61d17809-4995-4615-b776-c194e0be3b30")
    _w(sysfs / "kernel/mm/transparent_hugepage/shmem_enabled", "always within_size [advise] never deny force")
    _w(sysfs / "kernel/mm/transparent_hugepage/enabled", "always [madvise] never")
    add_controller(sysfs, ctrl=0, subsys=0, dev_root=dev)
    which, run = _tools({"dcb": DCB_PFC, "ibv_devinfo": _ibv_devinfo("4096 (5)"), "python3": "",
                         "nvme": "nvme version 2.3 (git 2.3)"},
                        ["dcb", "ibv_devinfo", "nvme", "/usr/bin/python3"])
    checks = run_checks(Probe(str(sysfs), str(dev), str(etc), which=which, run=run,  # type: ignore[arg-type]
                              imports=lambda m: True))
    got = _by_name(checks)
    bad = {k: v for k, v in got.items() if v[0] is not Status.PASS}
    assert bad == {}
    assert "3" in got["net.enp65s0f0np0.pfc"][1] and got["rdma.mlx5_0.port1.active_mtu"][1] == "4096"
    assert got["nvme.nvme0"][1].startswith("live: rdma 10.77.0.1:4420")


def test_soft_roce_with_mtu_1500(roots: tuple[Path, Path, Path]) -> None:
    sysfs, dev, etc = roots
    _rdma_device(sysfs, "rxe0", "dummy0", soft=True)
    _w(sysfs / "class/net/dummy0/mtu", "1500")
    _modules(sysfs, "nvme_fabrics", "nvme_rdma", "rdma_rxe")
    _w(dev / "nvme-fabrics", "")
    add_controller(sysfs, ctrl=0, subsys=0, state="connecting")
    which, run = _tools({"ibv_devinfo": _ibv_devinfo("1024 (3)")}, ["ibv_devinfo"])
    checks = run_checks(Probe(str(sysfs), str(dev), str(etc), which=which, run=run,  # type: ignore[arg-type]
                              imports=lambda m: False))
    got = _by_name(checks)
    assert got["net.dummy0.mtu"][0] is Status.WARN and "9000" in got["net.dummy0.mtu"][1]
    assert got["rdma.rxe0.kind"][0] is Status.WARN
    assert got["rdma.rxe0.port1.active_mtu"][0] is Status.WARN
    assert got["net.dummy0.ecn"][0] is Status.SKIP and "not readable" in got["net.dummy0.ecn"][1]
    assert got["net.dummy0.pfc"][0] is Status.SKIP
    assert got["module.nvme_tcp"][0] is Status.WARN and got["module.nvmet"][0] is Status.SKIP
    assert got["nvme.nvme0"][0] is Status.WARN and got["nvme.hostnqn"][0] is Status.WARN
    assert got["tool.nvme-cli"][0] is Status.FAIL            # neither nvme-cli nor libnvme
    assert got["rdma.uverbs"][0] is Status.WARN
    assert got["memory.shmem_huge_pages"][0] is Status.SKIP   # no such file in this tree
    assert got["memory.io_huge_pages"][0] is Status.SKIP


def test_the_shared_memory_page_size_is_reported_not_judged(roots: tuple[Path, Path, Path]) -> None:
    sysfs, dev, etc = roots
    _w(sysfs / "kernel/mm/transparent_hugepage/shmem_enabled", "always within_size advise [never] deny force")
    got = _by_name(memory_checks(Probe(str(sysfs), str(dev), str(etc))))
    assert got["memory.shmem_huge_pages"] == (Status.PASS, got["memory.shmem_huge_pages"][1])
    assert got["memory.shmem_huge_pages"][1].startswith("never: the DRAM pool and page buffers use 4 KiB pages")
    # allowed, but not for 2 MiB pages (newer kernels' own switch): the line names that one
    _w(sysfs / "kernel/mm/transparent_hugepage/shmem_enabled", "always within_size [advise] never deny force")
    _w(sysfs / "kernel/mm/transparent_hugepage/hugepages-2048kB/shmem_enabled", "always inherit advise [never]")
    got = _by_name(memory_checks(Probe(str(sysfs), str(dev), str(etc))))
    assert "hugepages-2048kB" in got["memory.shmem_huge_pages"][1] and "4 KiB pages" in got["memory.shmem_huge_pages"][1]


@pytest.mark.parametrize(("text", "own", "status", "says"), [
    ("always [madvise] never", None, Status.PASS, "madvise (/sys/kernel/mm/transparent_hugepage/enabled): the"),
    ("[always] madvise never", None, Status.PASS, "always (/sys/kernel/mm/transparent_hugepage/enabled)"),
    ("always madvise [never]", None, Status.WARN, "never (/sys/kernel/mm/transparent_hugepage/enabled)"),
    # newer kernels: the 2 MiB size's own switch decides unless it says inherit
    ("always [madvise] never", "always [inherit] madvise never", Status.PASS, "madvise (/sys/kernel/mm/"
                                                                              "transparent_hugepage/enabled)"),
    ("always [madvise] never", "always inherit madvise [never]", Status.WARN, "never (/sys/kernel/mm/"
                                                                              "transparent_hugepage/hugepages-2048kB"),
    ("always madvise [never]", "always inherit [madvise] never", Status.PASS, "madvise (/sys/kernel/mm/"
                                                                              "transparent_hugepage/hugepages-2048kB"),
    (None, None, Status.SKIP, "not readable"),
])
def test_huge_pages_for_the_io_buffers(roots: tuple[Path, Path, Path], text: str | None, own: str | None,
                                       status: Status, says: str) -> None:
    sysfs, dev, etc = roots
    if text is not None:
        _w(sysfs / "kernel/mm/transparent_hugepage/enabled", text)
    if own is not None:
        _w(sysfs / "kernel/mm/transparent_hugepage/hugepages-2048kB/enabled", own)
    got = _by_name(memory_checks(Probe(str(sysfs), str(dev), str(etc))))
    assert got["memory.io_huge_pages"][0] is status and says in got["memory.io_huge_pages"][1]


def test_nothing_at_all(roots: tuple[Path, Path, Path]) -> None:
    sysfs, dev, etc = roots
    which, run = _tools({}, [])
    checks = run_checks(Probe(str(sysfs), str(dev), str(etc), which=which, run=run,  # type: ignore[arg-type]
                              imports=lambda m: False))
    got = _by_name(checks)
    assert got["rdma.devices"][0] is Status.FAIL and "rxe" in got["rdma.devices"][1]
    assert got["module.nvme_fabrics"][0] is Status.FAIL and got["dev.nvme-fabrics"][0] is Status.FAIL
    assert got["nvme.controllers"][0] is Status.SKIP
    counts = summary(checks)
    assert sum(counts.values()) == len(checks) and counts["fail"] >= 3


def test_cli_json_shape(roots: tuple[Path, Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    sysfs, dev, etc = roots
    sysfs.mkdir()
    code = main(["doctor", "--json", "--sysfs-root", str(sysfs), "--dev-root", str(dev),
                 "--etc-root", str(etc)])
    doc = json.loads(capsys.readouterr().out)
    assert code == 1                                        # no RDMA device: a fail
    assert set(doc) == {"checks", "summary"}
    assert all(set(c) == {"check", "status", "detail"} for c in doc["checks"])
    assert {c["status"] for c in doc["checks"]} <= {"pass", "warn", "fail", "skip"}
    assert set(doc["summary"]) == {"pass", "warn", "fail", "skip"}
    assert sum(doc["summary"].values()) == len(doc["checks"])


def test_cli_text(roots: tuple[Path, Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    sysfs, dev, etc = roots
    code = main(["doctor", "--sysfs-root", str(sysfs), "--dev-root", str(dev), "--etc-root", str(etc)])
    out = capsys.readouterr().out
    assert code == 1 and "[FAIL] rdma.devices:" in out and out.rstrip().splitlines()[-1].startswith("summary:")
