"""What ``tierkv rig`` will run, as data: options, the setup's answer, command lines.

Nothing here starts a process or touches the network; :mod:`tierkv.rig.run` executes
what these functions build, and the unit tests (``tests/cli/test_rig_cli.py``) check the
command lines without a VM. Paths: the rig's scripts live in the source checkout
(``tools/rig/``), its state in a work folder (``RIG_WORK``, default ``/tmp/tierkv-rig``).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from tierkv.errors import InputError, TierKVError

DEFAULT_WORK = "/tmp/tierkv-rig"
DEFAULT_CPUS = 2
DEFAULT_MEMORY = "2G"
DEFAULT_TIMEOUT_S = 600.0
REPO = Path(__file__).resolve().parents[2]
# Variables the guest script sets itself; any other TIERKV_RIG_* on the host is forwarded.
_GUEST_OWNED = frozenset({"TIERKV_RIG_PY", "TIERKV_RIG_GUEST", "TIERKV_RIG_OUT"})
_ENV_NAME = re.compile(r"TIERKV_RIG_[A-Z0-9_]+")


class RigError(TierKVError):
    """The rig cannot run here (a missing tool, file or setup step), or its VM failed."""


class GuestMode(Enum):
    """What ``tools/rig/guest.sh`` does once the stack is up."""

    CHECK = "check"  # report the stack (and `tierkv doctor --json`), run no tests
    TEST = "test"    # run the rig tests with pytest


@dataclass(frozen=True)
class RigOptions:
    """Where the rig lives and how big its VM is. ``memory`` is QEMU's size syntax
    (``2G``, ``1536M``); ``timeout_s`` bounds one boot, guest run included."""

    work_dir: Path = Path(DEFAULT_WORK)
    cpus: int = DEFAULT_CPUS
    memory: str = DEFAULT_MEMORY
    timeout_s: float = DEFAULT_TIMEOUT_S
    repo: Path = REPO

    def __post_init__(self) -> None:
        if not 1 <= self.cpus <= 64:
            raise InputError(f"--cpus must be 1..64, got {self.cpus}")
        if not re.fullmatch(r"[1-9][0-9]*[MG]", self.memory):
            raise InputError(f"--memory must look like 2G or 1536M, got {self.memory!r}")
        if self.timeout_s <= 0:
            raise InputError(f"--timeout-s must be positive, got {self.timeout_s}")

    @property
    def setup_script(self) -> Path:
        return self.repo / "tools" / "rig" / "setup.sh"

    @property
    def guest_script(self) -> Path:
        return self.repo / "tools" / "rig" / "guest.sh"

    @property
    def env_file(self) -> Path:
        """Written by setup.sh: the kernel, vng and the guest Python it prepared."""
        return self.work_dir / "rig.env"

    @property
    def out_dir(self) -> Path:
        """Shared writable with the guest (``vng --rwdir``); emptied before each boot."""
        return self.work_dir / "out"

    @property
    def host_log(self) -> Path:
        """The VM's console as the host saw it (written by the host, never the guest)."""
        return self.work_dir / "vng.log"

    @property
    def pid_file(self) -> Path:
        """The process group of the running vng, for ``tierkv rig down``."""
        return self.work_dir / "vng.pid"


@dataclass(frozen=True)
class RigEnv:
    """What setup.sh prepared (``rig.env``): kernel version and image, vng and its bin
    folder, the guest venv's python."""

    kver: str
    kernel: Path
    vng: Path
    vng_bin: Path
    guest_python: Path


@dataclass(frozen=True)
class Command:
    """One process to start: argv, environment additions, and what to call it in reports."""

    name: str
    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)

    def shell(self) -> str:
        """The command as one shell line, for logs and ``--json``."""
        prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items()))
        return (prefix + " " if prefix else "") + shlex.join(self.argv)


def parse_env_file(text: str, source: str = "rig.env") -> RigEnv:
    """Parse setup.sh's ``KEY=VALUE`` lines; :class:`RigError` names a missing key."""
    values = dict(line.split("=", 1) for line in text.splitlines() if "=" in line and not line.startswith("#"))
    need = ("RIG_KVER", "RIG_KERNEL", "RIG_VNG", "RIG_VNG_BIN", "RIG_GUEST_PY")
    missing = [k for k in need if not values.get(k)]
    if missing:
        raise RigError(f"{source} lacks {', '.join(missing)}: run tools/rig/setup.sh again")
    return RigEnv(values["RIG_KVER"], Path(values["RIG_KERNEL"]), Path(values["RIG_VNG"]),
                  Path(values["RIG_VNG_BIN"]), Path(values["RIG_GUEST_PY"]))


def setup_command(opts: RigOptions) -> Command:
    return Command("setup", ("bash", str(opts.setup_script)), {"RIG_WORK": str(opts.work_dir)})


def forwarded_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The host's ``TIERKV_RIG_*`` variables the guest should see (knobs such as
    ``TIERKV_RIG_BACKEND``), minus those the guest script owns."""
    return {k: v for k, v in environ.items() if _ENV_NAME.fullmatch(k) and k not in _GUEST_OWNED}


def guest_command(opts: RigOptions, env: RigEnv, mode: GuestMode, pytest_args: Sequence[str] = (),
                  extra_env: Mapping[str, str] | None = None) -> str:
    """The shell line vng runs inside the guest (it goes through the guest's shell)."""
    assigns = {"TIERKV_RIG_PY": str(env.guest_python), **(extra_env or {})}
    argv = ["env", *(f"{k}={v}" for k, v in sorted(assigns.items())), "bash", str(opts.guest_script),
            mode.value, str(opts.out_dir), *pytest_args]
    return shlex.join(argv)


def boot_command(opts: RigOptions, env: RigEnv, mode: GuestMode, pytest_args: Sequence[str] = (),
                 extra_env: Mapping[str, str] | None = None, path: str | None = None) -> Command:
    """``vng`` booting the rig kernel under TCG with the host root read-only and
    ``out_dir`` writable. Always ``--disable-kvm``: KVM aborts on these hosts (an MSR
    QEMU cannot set, or a hung guest). vng shells out to ``virtme-run``, so its venv's
    bin goes first on PATH."""
    argv = (str(env.vng), "--run", str(env.kernel), "--disable-kvm", "--cpus", str(opts.cpus),
            "--memory", opts.memory, "--rwdir", str(opts.out_dir),
            "--exec", guest_command(opts, env, mode, pytest_args, extra_env))
    current = os.environ.get("PATH", "") if path is None else path
    return Command("boot", argv, {"PATH": f"{env.vng_bin}{os.pathsep}{current}"})


def pytest_args(keyword: str | None, rest: Sequence[str]) -> list[str]:
    """Arguments for pytest inside the guest: ``-k EXPR`` first, then the rest as given."""
    return (["-k", keyword] if keyword else []) + list(rest)


def preconditions(opts: RigOptions, find: Callable[[str], str | None] = shutil.which) -> list[str]:
    """Why this host cannot boot the rig, one sentence each (empty: it can). Checked
    after setup, which installs what is missing. ``find`` is injected so tests need not
    edit PATH."""
    problems = []
    if not opts.setup_script.is_file() or not opts.guest_script.is_file():
        problems.append(f"tools/rig/ not found under {opts.repo}: `tierkv rig` runs from a source checkout")
    if find("qemu-system-x86_64") is None:
        problems.append("no /dev/kvm needed, but qemu-system-x86_64 missing: run tools/rig/setup.sh")
    if find("busybox") is None:
        problems.append("busybox missing (virtme-ng builds the guest's initramfs from it): "
                        "run tools/rig/setup.sh (it installs busybox-static)")
    return problems


def load_env(opts: RigOptions) -> RigEnv:
    """The setup's answer, checked: every file it names must exist."""
    try:
        env = parse_env_file(opts.env_file.read_text(), str(opts.env_file))
    except FileNotFoundError:
        raise RigError(f"{opts.env_file} missing: the rig is not set up; run tools/rig/setup.sh "
                       f"(or `tierkv rig up`)") from None
    for what, path in (("kernel", env.kernel), ("vng", env.vng), ("guest python", env.guest_python)):
        if not path.exists():
            raise RigError(f"{what} {path} named by {opts.env_file} is gone: run tools/rig/setup.sh")
    return env
