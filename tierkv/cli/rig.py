"""``tierkv rig up|test|down``: the QEMU NVMe-oF rig from the command line.

``add_parser`` plugs the command into ``tierkv``'s parser; handlers return the exit
status. ``up`` sets up and boots once to prove the stack; ``test`` runs the rig tests
and exits with pytest's status; ``down`` removes what a run left. With ``--json`` each
prints one JSON object (also when a precondition fails), else a short summary; the
guest's console streams to stderr unless ``--json`` or ``--quiet``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import asdict
from pathlib import Path

from tierkv.cli.exits import EXIT_FAILED, EXIT_OK, EXIT_TIMEOUT, EXIT_USAGE
from tierkv.errors import InputError
from tierkv.progress import task_progress
from tierkv.rig.recipe import (DEFAULT_CPUS, DEFAULT_MEMORY, DEFAULT_TIMEOUT_S, DEFAULT_WORK, GuestMode, RigError,
                             RigOptions, boot_command, forwarded_env, load_env, preconditions, pytest_args,
                             setup_command)
from tierkv.rig.run import StepResult, boot, read_guest, run_setup, teardown



def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:  # type: ignore[type-arg]
    """Add ``rig`` (with ``up``, ``test``, ``down``) to ``tierkv``'s subparsers."""
    rp = subparsers.add_parser(
        "rig", help="the QEMU NVMe-oF test rig: set up, boot, run the rig tests, tear down",
        description="A Debian kernel under QEMU (TCG, no KVM) with nvmet, soft-RoCE and the NVMe/RDMA "
                    "host, sharing this checkout read-only; see docs/rig.md.")
    sub = rp.add_subparsers(dest="rig_command", required=True)
    up = sub.add_parser("up", help="set up and boot once to prove the stack (modules, rxe, configfs, doctor)")
    test = sub.add_parser("test", help="set up, boot and run the rig tests; exits with pytest's status")
    test.add_argument("-k", dest="keyword", metavar="EXPR", help="pytest -k expression")
    test.add_argument("pytest_args", nargs="*", metavar="PYTEST_ARG",
                      help="more pytest arguments (after --), e.g. -- -x tests/rig/test_target.py")
    down = sub.add_parser("down", help="kill a leftover rig VM and remove transient state")
    down.add_argument("--purge", action="store_true", help="also delete the work folder (kernel, venvs); only "
                      "one that holds setup.sh's rig.env")
    for p in (up, test, down):
        p.add_argument("--work", metavar="DIR", default=None,
                       help=f"work folder (default $RIG_WORK or {DEFAULT_WORK})")
        p.add_argument("--json", action="store_true", help="print one JSON object instead of a summary")
    for p in (up, test):
        p.add_argument("--cpus", type=int, default=DEFAULT_CPUS, help=f"guest CPUs (default {DEFAULT_CPUS})")
        p.add_argument("--memory", default=DEFAULT_MEMORY, help=f"guest memory (default {DEFAULT_MEMORY})")
        p.add_argument("--timeout-s", type=float, default=DEFAULT_TIMEOUT_S,
                       help=f"limit for one boot, guest run included (default {DEFAULT_TIMEOUT_S:.0f})")
        p.add_argument("--no-setup", action="store_true", help="skip tools/rig/setup.sh (already done)")
        p.add_argument("-q", "--quiet", action="store_true", help="do not stream the guest's console")
    up.set_defaults(handler=cmd_up)
    test.set_defaults(handler=cmd_test)
    down.set_defaults(handler=cmd_down)
    return rp


def options(args: argparse.Namespace) -> RigOptions:
    """RigOptions from parsed arguments; ``RIG_WORK`` applies when ``--work`` is absent."""
    work = args.work or os.environ.get("RIG_WORK") or DEFAULT_WORK
    if not hasattr(args, "cpus"):
        return RigOptions(work_dir=Path(work))
    return RigOptions(work_dir=Path(work), cpus=args.cpus, memory=args.memory, timeout_s=args.timeout_s)


def _emit(args: argparse.Namespace, out: dict[str, object], summary: Callable[[], None]) -> None:
    if args.json:
        print(json.dumps(out, indent=2, default=str))
    else:
        summary()


def _failure(args: argparse.Namespace, command: str, message: str, steps: Sequence[StepResult] = (),
             status: int = EXIT_FAILED) -> int:
    out = {"command": command, "ok": False, "exit_status": status, "error": message,
           "steps": [asdict(s) for s in steps]}
    _emit(args, out, lambda: print(f"tierkv rig {command}: {message}", file=sys.stderr))
    return status


def _console(args: argparse.Namespace) -> Callable[[str], None]:
    if args.json or args.quiet:
        return lambda line: None
    return lambda line: print(line, file=sys.stderr, flush=True)


def _spinner(args: argparse.Namespace, label: str) -> AbstractContextManager[Callable[[], None]]:
    """A progress bar advancing per console line, shown only when the console is not."""
    return task_progress(label, None, enabled=bool(args.json or args.quiet))


def _prepare(args: argparse.Namespace, opts: RigOptions, steps: list[StepResult]) -> None:
    if not args.no_setup:
        with _spinner(args, "rig setup") as tick:
            echo = _console(args)
            steps.append(run_setup(opts, setup_command(opts), lambda line: (echo(line), tick())[-1]))
    problems = preconditions(opts)
    if problems:
        raise RigError("; ".join(problems))


def _boot(args: argparse.Namespace, opts: RigOptions, mode: GuestMode, pargs: Sequence[str],
          steps: list[StepResult]) -> StepResult:
    env = load_env(opts)
    cmd = boot_command(opts, env, mode, pargs, forwarded_env(os.environ))
    with _spinner(args, f"booting the rig guest ({mode.value})") as tick:
        echo = _console(args)
        result = boot(opts, cmd, lambda line: (echo(line), tick())[-1])
    steps.append(result)
    return result


def cmd_up(args: argparse.Namespace) -> int:
    return _run(args, GuestMode.CHECK, [])


def cmd_test(args: argparse.Namespace) -> int:
    return _run(args, GuestMode.TEST, pytest_args(args.keyword, args.pytest_args))


def _run(args: argparse.Namespace, mode: GuestMode, pargs: Sequence[str]) -> int:
    command = "up" if mode is GuestMode.CHECK else "test"
    start = time.monotonic()
    steps: list[StepResult] = []
    try:
        opts = options(args)
        _prepare(args, opts, steps)
        booted = _boot(args, opts, mode, pargs, steps)
    except InputError as exc:
        return _failure(args, command, str(exc), steps, EXIT_USAGE)
    except RigError as exc:
        return _failure(args, command, str(exc), steps)
    if booted.timed_out:
        return _failure(args, command, f"the guest ran past --timeout-s {opts.timeout_s:.0f}; killed "
                        f"(console in {opts.host_log})", steps, EXIT_TIMEOUT)
    guest = read_guest(opts, mode)
    if guest.exit_status is None:
        return _failure(args, command, f"the guest wrote no status (vng exited {booted.exit_status}); "
                        f"console in {opts.host_log}", steps)
    status = guest.exit_status
    out: dict[str, object] = {
        "command": command, "ok": status == 0, "exit_status": status, "error": None,
        "wall_s": round(time.monotonic() - start, 2), "steps": [asdict(s) for s in steps],
        "guest_phases_s": guest.phases, "failed_step": guest.failed_step,
        "counts": None if guest.counts is None else {**asdict(guest.counts), "total": guest.counts.total},
        "log": str(opts.out_dir / "guest.log"), "console": str(opts.host_log),
        "junit": str(opts.out_dir / "junit.xml") if mode is GuestMode.TEST else None,
        "doctor": guest.doctor.get("summary") if guest.doctor else None,
    }
    _emit(args, out, lambda: _summary(out))
    return status


def _summary(out: dict[str, object]) -> None:
    steps = ", ".join(f"{s['name']} {s['wall_s']:.1f} s" for s in out["steps"])  # type: ignore[attr-defined]
    phases = ", ".join(f"{k} {v:.1f} s" for k, v in out["guest_phases_s"].items())  # type: ignore[attr-defined]
    print(f"tierkv rig {out['command']}: {'OK' if out['ok'] else 'FAILED'} in {out['wall_s']} s ({steps})")
    print(f"  guest: {phases}")
    if out["failed_step"]:
        print(f"  bring-up step failed: {out['failed_step']}")
    print(f"  log: {out['log']}")
    counts = out["counts"]
    if isinstance(counts, dict):
        if counts["errors"]:
            print(f"  ({counts['errors']} of the failures below are errors in setup or teardown)")
        # Last, alone on its line: CI reads it as the run's closing count.
        print("rig: {} passed, {} failed, {} skipped".format(counts["passed"], counts["failed"] + counts["errors"],
                                                          counts["skipped"]))


def cmd_down(args: argparse.Namespace) -> int:
    opts = options(args)
    try:
        env = load_env(opts)
    except RigError:
        env = None  # not set up, or half-purged: still find QEMUs by the work folder
    try:
        result = teardown(opts, env, args.purge)
    except RigError as exc:  # --purge of something that is not a rig work folder
        return _failure(args, "down", str(exc), status=EXIT_USAGE)
    out = {"command": "down", "ok": True, "exit_status": EXIT_OK, **result}
    _emit(args, out, lambda: print(f"tierkv rig down: killed {len(result['killed'])} process(es), "  # type: ignore[arg-type]
                                   f"removed {len(result['removed'])} path(s)"))  # type: ignore[arg-type]
    return EXIT_OK
