"""Who this host is to a target, and why a connect failed.

The host NQN and ID default to ``/etc/nvme/hostnqn`` and ``/etc/nvme/hostid``; an explicit
NQN gets an ID of its own. A failed connect is classified from the tool's stderr and the
kernel's log (``/dev/kmsg``), since the kernel itself returns little more than EIO.
Used by :mod:`nvmeof.host` (which re-exports these names) and by tierkv's NVMe-oF tier
(``host_identity``).
"""

from __future__ import annotations

import enum
import os
import uuid

HOSTNQN_FILE = "/etc/nvme/hostnqn"
HOSTID_FILE = "/etc/nvme/hostid"


class ConnectFailure(enum.Enum):
    """Why a connect or discovery failed, as far as the tool's and kernel's text tell."""

    HOST_REFUSED = "host not allowed by the subsystem (not on its allow-list)"
    AUTH_FAILED = "DH-HMAC-CHAP authentication failed or was required"
    NO_SUBSYSTEM = "no such subsystem on that port"
    HOSTID_CONFLICT = "this hostnqn/hostid pair clashes with one already in the kernel"
    UNREACHABLE = "target unreachable (address, port, route or RDMA CM failure)"
    NO_FABRICS = "nvme-fabrics or the transport module is not loaded"
    UNSUPPORTED = "option not supported by the chosen backend"
    NO_BACKEND = "neither libnvme's Python bindings nor nvme-cli is available"
    TIMEOUT = "controller not live with a namespace block device in time"
    OTHER = "see the tool's and the kernel's messages"


def default_hostnqn(path: str = HOSTNQN_FILE) -> str | None:
    """The host NQN from ``/etc/nvme/hostnqn`` (first non-empty line), or None."""
    return _first_line(path)


def default_hostid(path: str = HOSTID_FILE) -> str | None:
    """The host ID from ``/etc/nvme/hostid``, or None."""
    return _first_line(path)


def _first_line(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            return next((ln.strip() for ln in f if ln.strip()), None)
    except OSError:
        return None


def host_identity(hostnqn: str | None, hostid: str | None) -> tuple[str | None, str | None]:
    """The (hostnqn, hostid) pair a connect uses.

    Both default to the ``/etc/nvme`` files. An explicit hostnqn without a hostid gets a
    hostid of its own (the UUID inside a ``...:uuid:<uuid>`` NQN, else a UUIDv5 of the
    NQN): Linux 6.1 refuses one hostid under two hostnqns (EINVAL, "found same hostid"),
    so reusing the file's hostid for another NQN would fail for the wrong reason.
    """
    if hostnqn is None:
        return default_hostnqn(), hostid if hostid is not None else default_hostid()
    if hostid is None:
        tail = hostnqn.rsplit(":uuid:", 1)
        try:
            hostid = str(uuid.UUID(tail[1])) if len(tail) == 2 else None
        except ValueError:
            hostid = None
        hostid = hostid or str(uuid.uuid5(uuid.NAMESPACE_URL, hostnqn))
    return hostnqn, hostid


def classify(text: str) -> ConnectFailure:
    """The failure class of a tool's stderr plus kernel log lines (case-insensitive)."""
    t = text.lower()
    rules = [
        (ConnectFailure.HOST_REFUSED, ("is not allowed", "not allowed", "invalid host")),
        (ConnectFailure.AUTH_FAILED, ("authentication", "dhchap", "auth failed")),
        (ConnectFailure.HOSTID_CONFLICT, ("found same hostid", "found same hostnqn",
                                          "hostnqn already in use")),
        (ConnectFailure.NO_SUBSYSTEM, ('subsysnqn "', "invalid subsystem")),
        (ConnectFailure.NO_FABRICS, ("/dev/nvme-fabrics: no such file", "no such device",
                                     "failed to scan topology",
                                     "invalid transport", "unknown transport")),
        (ConnectFailure.UNREACHABLE, ("connection refused", "no route", "unreachable",
                                      "timed out", "rdma_resolve", "failed to connect socket",
                                      "(-110)", "(-111)", "(-113)", "address not available")),
    ]
    for reason, needles in rules:
        if any(n in t for n in needles):
            return reason
    return ConnectFailure.OTHER


def kernel_log_tail(since_monotonic_s: float, needle: str = "nvme", limit: int = 8) -> list[str]:
    """Kernel log lines containing ``needle`` since a ``time.monotonic()`` instant.

    Best effort: reads ``/dev/kmsg`` (needs root); returns [] where it cannot.
    """
    lines: list[str] = []
    try:
        fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return []
    try:
        while True:
            try:
                rec = os.read(fd, 8192).decode(errors="replace")
            except BlockingIOError:
                break
            except OSError:                          # EPIPE: records overwritten, go on
                continue
            head, _, msg = rec.partition(";")
            fields = head.split(",")
            if len(fields) >= 3 and fields[2].isdigit() \
                    and int(fields[2]) / 1e6 >= since_monotonic_s - 1.0 and needle in msg:
                lines.append(msg.splitlines()[0] if msg else msg)
    finally:
        os.close(fd)
    return lines[-limit:]
