"""A slower disk for benchmarks: the kernel's block-I/O throttle on the device under a
directory, for this process, while a ``with device_throttle(...)`` block runs.

``tierkv bench codec-store --device-mbps R`` uses it to measure the codec where the
tier is slower than this machine's disk (a network volume, a shared or older NVMe
device): the process moves into a cgroup of its own whose read and write bandwidth on
that device is capped by the kernel (cgroup v1 ``blkio.throttle.*_bps_device``, or v2
``io.max``), then moves back and the cgroup is removed. Every byte still crosses the
real device with O_DIRECT; the kernel only paces it (on cgroup v1 direct I/O only:
buffered writeback, such as the index's commits, is not charged to the process). The
throttle lets a burst through at the start of each busy period (its time slice), so
runs should move many times ``R`` x 0.1 s.
Needs root and a mounted blkio (v1) or io (v2) controller; InputError says what is
missing otherwise.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tierkv.errors import InputError

V1 = Path("/sys/fs/cgroup/blkio")
V2 = Path("/sys/fs/cgroup")


def whole_disk(path: str | os.PathLike[str]) -> str:
    """``MAJ:MIN`` of the disk that holds ``path`` (a partition's parent disk: the
    throttle applies to whole devices)."""
    dev = os.stat(path).st_dev
    node = f"{os.major(dev)}:{os.minor(dev)}"
    sysdir = Path("/sys/dev/block") / node
    if not sysdir.exists():
        raise InputError(f"--device-mbps: {path} is not on a block device (device {node}: no {sysdir})")
    if (sysdir / "partition").exists():
        node = (sysdir.resolve().parent / "dev").read_text().strip()
    return node


def _own_cgroup(controller: str) -> Path:
    """This process's cgroup in the v1 hierarchy of ``controller`` (or v2's, for "")."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, names, path = line.split(":", 2)
        if (controller and controller in names.split(",")) or (not controller and names == ""):
            return Path(path.lstrip("/"))
    raise InputError(f"--device-mbps: this process is in no {controller or 'v2'} cgroup")


def _move_back(home: Path, root: Path) -> None:
    """Moves this process back to ``home``, or to ``root`` where ``home`` is gone (systemd
    removes a scope the moment it empties); raises only where neither takes it."""
    for target in (home, root):
        try:
            (target / "cgroup.procs").write_text(f"{os.getpid()}\n")
            return
        except OSError as e:
            err = e
    raise InputError(f"--device-mbps: could not move this process out of its throttled cgroup ({err}); "
                     "its disk I/O stays capped") from err


@contextmanager
def device_throttle(path: str | os.PathLike[str], bytes_per_s: int) -> Iterator[dict[str, object]]:
    """Caps this process's disk I/O on the disk under ``path`` at ``bytes_per_s`` (reads
    and writes; on cgroup v1 direct I/O only, as buffered writeback is not charged to
    the process) for the block; yields what it set (device, cgroup, version). Afterwards
    the process is back in its cgroup (or the hierarchy's root where that one is gone),
    the cgroup is removed, and an io controller it enabled at a v2 root is disabled."""
    if bytes_per_s < 1:
        raise InputError(f"--device-mbps: a rate must be positive, got {bytes_per_s} bytes/s")
    if os.geteuid() != 0:
        raise InputError("--device-mbps needs root (it makes a cgroup and moves this process into it)")
    node = whole_disk(path)
    v2 = (V2 / "cgroup.controllers").exists() and "io" in (V2 / "cgroup.controllers").read_text().split()
    if not v2 and not (V1 / "blkio.throttle.read_bps_device").exists():
        raise InputError("--device-mbps needs the blkio (cgroup v1) or io (cgroup v2) controller mounted at "
                         "/sys/fs/cgroup")
    root = V2 if v2 else V1
    home = root / _own_cgroup("" if v2 else "blkio")
    enabled_io = False
    if v2 and "io" not in (V2 / "cgroup.subtree_control").read_text().split():
        try:   # the root cgroup hands the io controller to its children
            (V2 / "cgroup.subtree_control").write_text("+io\n")
            enabled_io = True
        except OSError as e:
            raise InputError(f"--device-mbps: could not enable the io controller for child cgroups ({e}; a "
                             "cgroup that holds processes cannot hand controllers down)") from None
    group = root / f"tierkv-bench-{os.getpid()}"
    try:
        if group.exists():
            group.rmdir()   # left by an earlier process of this pid that was killed inside the block
        group.mkdir()
    except OSError as e:
        raise InputError(f"--device-mbps: could not make the cgroup {group} ({e})") from None
    stuck = False   # this process is in the group and could not leave it
    try:
        if v2:
            try:
                (group / "io.max").write_text(f"{node} rbps={bytes_per_s} wbps={bytes_per_s}\n")
            except OSError as e:
                raise InputError(f"--device-mbps: cgroup v2 refused io.max in {group} ({e})") from None
        else:
            try:
                (group / "blkio.throttle.read_bps_device").write_text(f"{node} {bytes_per_s}\n")
                (group / "blkio.throttle.write_bps_device").write_text(f"{node} {bytes_per_s}\n")
            except OSError as e:
                raise InputError(f"--device-mbps: the blkio controller refused a limit on {node} ({e})") from None
        try:
            (group / "cgroup.procs").write_text(f"{os.getpid()}\n")
        except OSError as e:
            raise InputError(f"--device-mbps: could not move this process into {group} ({e})") from None
        stuck = True
        try:
            yield {"device": node, "cgroup": str(group), "version": 2 if v2 else 1, "bytes_per_s": bytes_per_s}
        finally:
            _move_back(home, root)   # raises, naming the cgroup's cost, where nothing takes the process
            stuck = False
    finally:
        try:
            if not stuck:   # a cgroup that still holds this process cannot go
                group.rmdir()
        finally:
            if enabled_io:
                try:
                    (V2 / "cgroup.subtree_control").write_text("-io\n")
                except OSError:
                    pass   # another cgroup uses it now; enabled is what it was meant to be
