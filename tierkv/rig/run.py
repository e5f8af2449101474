"""Runs the rig: setup, one boot of the guest, reading its results back, teardown.

Called by :mod:`tierkv.cli.rig`. Blocks the calling thread; one rig per work folder at
a time (the VM's output folder is shared). A boot past its timeout has its whole process
group (vng and QEMU) killed and is reported, never left running.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tierkv.rig.recipe import Command, GuestMode, RigEnv, RigError, RigOptions

_KILL_GRACE_S = 5.0


@dataclass(frozen=True)
class StepResult:
    """One host-side step: its name, wall seconds, exit status (None: killed on timeout)."""

    name: str
    wall_s: float
    exit_status: int | None
    timed_out: bool = False


@dataclass(frozen=True)
class RunCounts:
    """The rig tests' outcome as pytest's junit report counts it."""

    passed: int = 0
    failed: int = 0
    errors: int = 0
    skipped: int = 0

    @property
    def total(self) -> int:
        return self.passed + self.failed + self.errors + self.skipped


@dataclass(frozen=True)
class GuestReport:
    """What the guest left in the shared folder. ``phases`` are seconds each step took
    inside the guest (``boot``: kernel start to the guest script); ``exit_status`` is the
    guest script's (pytest's in test mode), None if it never wrote one."""

    exit_status: int | None
    failed_step: str | None
    phases: dict[str, float] = field(default_factory=dict)
    counts: RunCounts | None = None
    doctor: dict[str, object] | None = None


def run_setup(opts: RigOptions, cmd: Command, on_line: Callable[[str], None]) -> StepResult:
    """Run setup.sh (idempotent); its output goes to ``on_line`` and to ``setup.log``.
    :class:`RigError` with the log's tail when it fails."""
    opts.work_dir.mkdir(parents=True, exist_ok=True)
    log = opts.work_dir / "setup.log"
    start = time.monotonic()
    with open(log, "w", encoding="utf-8") as f:
        proc = subprocess.Popen(cmd.argv, env={**os.environ, **cmd.env}, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert proc.stdout is not None
        for line in proc.stdout:
            f.write(line)
            on_line(line.rstrip("\n"))
        rc = proc.wait()
    if rc != 0:
        tail = " | ".join(log.read_text(errors="replace").strip().splitlines()[-5:])
        raise RigError(f"tools/rig/setup.sh failed with status {rc} (log {log}): {tail}")
    return StepResult("setup", round(time.monotonic() - start, 2), rc)


def boot(opts: RigOptions, cmd: Command, on_line: Callable[[str], None]) -> StepResult:
    """Boot the guest once and wait for it to power off or for ``opts.timeout_s``.

    The console is piped (a file handed to vng directly can be overwritten by the
    guest) into ``opts.host_log`` and ``on_line``. The output folder is emptied first.
    """
    with _locked(opts):
        return _boot(opts, cmd, on_line)


@contextlib.contextmanager
def _locked(opts: RigOptions) -> Iterator[None]:
    """One boot per work folder: the output folder and pid file are shared."""
    opts.work_dir.mkdir(parents=True, exist_ok=True)
    with open(opts.work_dir / "rig.lock", "a+", encoding="ascii") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            raise RigError(f"another rig run (pid {f.read().strip() or '?'}) is using {opts.work_dir}: "
                           f"wait for it, or pass --work DIR (setup runs again there)") from None
        f.truncate(0)
        f.write(f"{os.getpid()}\n")
        f.flush()
        yield


def _boot(opts: RigOptions, cmd: Command, on_line: Callable[[str], None]) -> StepResult:
    shutil.rmtree(opts.out_dir, ignore_errors=True)
    opts.out_dir.mkdir(parents=True)
    start = time.monotonic()
    proc = subprocess.Popen(cmd.argv, env={**os.environ, **cmd.env}, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                            start_new_session=True)
    opts.pid_file.write_text(f"{proc.pid}\n")
    expired = threading.Event()

    def on_timeout() -> None:
        expired.set()
        _kill_group(proc.pid)

    timer = threading.Timer(opts.timeout_s, on_timeout)
    timer.start()
    try:
        assert proc.stdout is not None
        with open(opts.host_log, "w", encoding="utf-8") as log:
            for line in proc.stdout:
                log.write(line)
                on_line(line.rstrip("\n"))
        rc = proc.wait()
    finally:
        timer.cancel()
        if proc.poll() is None:  # interrupted: take the VM down with us
            _kill_group(proc.pid)
        with contextlib.suppress(FileNotFoundError):
            opts.pid_file.unlink()
    return StepResult("boot", round(time.monotonic() - start, 2), None if expired.is_set() else rc, expired.is_set())


def _kill_group(pgid: int) -> None:
    """SIGTERM the group, then SIGKILL whatever is left after a grace period."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
        deadline = time.monotonic() + _KILL_GRACE_S
        while time.monotonic() < deadline:
            os.killpg(pgid, 0)  # raises ProcessLookupError once the group is gone
            time.sleep(0.1)
        os.killpg(pgid, signal.SIGKILL)


def read_guest(opts: RigOptions, mode: GuestMode) -> GuestReport:
    """Parse ``status.json``, ``phases.tsv``, ``junit.xml`` and ``doctor.json`` from the
    shared folder; what is missing stays None or empty."""
    out = opts.out_dir
    try:
        status = json.loads((out / "status.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        status = {}
    phases: dict[str, float] = {}
    with contextlib.suppress(FileNotFoundError):
        last = 0.0
        for line in (out / "phases.tsv").read_text().splitlines():
            name, _, at = line.partition("\t")
            with contextlib.suppress(ValueError):
                phases[name] = round(float(at) - last, 2)
                last = float(at)
    doctor = None
    with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
        doctor = json.loads((out / "doctor.json").read_text())
    counts = parse_junit(out / "junit.xml") if mode is GuestMode.TEST else None
    rc = status.get("exit_status")
    return GuestReport(rc if isinstance(rc, int) else None, status.get("failed_step") or None, phases,
                       counts, doctor if isinstance(doctor, dict) else None)


def parse_junit(path: Path) -> RunCounts | None:
    """Counts from a pytest junit XML report (``testsuites`` or a bare ``testsuite``)."""
    try:
        root = ET.parse(path).getroot()
    except (FileNotFoundError, ET.ParseError):
        return None
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    tot = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    return RunCounts(tot["tests"] - tot["failures"] - tot["errors"] - tot["skipped"], tot["failures"],
                      tot["errors"], tot["skipped"])


def rig_processes(opts: RigOptions, env: RigEnv | None, proc_root: str = "/proc") -> list[int]:
    """PIDs of QEMU processes booting this rig's kernel (found by their command line)."""
    needle = str(env.kernel if env else opts.work_dir / "kernel")
    found = []
    for pid in (p for p in os.listdir(proc_root) if p.isdigit()):
        with contextlib.suppress(OSError):
            argv = Path(proc_root, pid, "cmdline").read_bytes().split(b"\0")
            if argv and b"qemu-system" in os.path.basename(argv[0]) and any(needle.encode() in a for a in argv):
                found.append(int(pid))
    return found


def check_purge(work_dir: Path) -> None:
    """:class:`RigError` unless ``work_dir`` may be deleted whole: a directory (not a
    link) where setup.sh wrote ``rig.env``, and neither ``/`` nor the home directory.
    ``--work`` is typed by hand; a slip must not cost a tree of someone's files."""
    if work_dir.is_symlink() or not work_dir.is_dir():
        raise RigError(f"--purge: {work_dir} is not a directory; nothing deleted")
    real = work_dir.resolve()
    if real == Path("/") or real == Path.home().resolve():
        raise RigError(f"--purge: refusing to delete {real}; nothing deleted")
    if not (work_dir / "rig.env").is_file():
        raise RigError(f"--purge: {work_dir} is not a rig work folder (no rig.env from tools/rig/setup.sh); "
                       f"nothing deleted, remove it by hand if it is one")


def teardown(opts: RigOptions, env: RigEnv | None, purge: bool) -> dict[str, object]:
    """Kill a leftover vng process group and any QEMU of this rig, remove the transient
    files (output folder, logs, pid file); ``purge`` also deletes the work folder. With
    ``purge``, an existing work folder that fails :func:`check_purge` is a
    :class:`RigError` before anything is killed or removed."""
    if purge and (opts.work_dir.exists() or opts.work_dir.is_symlink()):
        check_purge(opts.work_dir)
    killed: list[int] = []
    with contextlib.suppress(FileNotFoundError, ValueError):
        pgid = int(opts.pid_file.read_text().strip())
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, 0)
            _kill_group(pgid)
            killed.append(pgid)
    for pid in rig_processes(opts, env):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
    removed = []
    for path in (opts.out_dir, opts.host_log, opts.pid_file, opts.work_dir / "setup.log"):
        if path.exists():
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()
            removed.append(str(path))
    if purge and opts.work_dir.exists():
        shutil.rmtree(opts.work_dir)
        removed.append(str(opts.work_dir))
    return {"killed": killed, "removed": removed}
