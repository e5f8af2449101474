"""``python3 -m nvmeof``: generate, validate, apply, clear and save nvmet target configs.

Every command takes ``--json`` for machine-readable output on stdout. Exit status: 0
on success, 1 when an apply/clear finished with collected failures, 2 on an error
(bad input, aborted apply), reported as one ``nvmeof: error: ...`` line on stderr.
``NVMEOF_CONFIGFS_ROOT`` overrides the default ``--root``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from collections.abc import Sequence
from typing import NoReturn

from nvmeof import configfs
from nvmeof.errors import ApplyError, NvmeofError
from nvmeof.model import NqnRule, NvmetConfig
from nvmeof.spec import generate, load_spec


class _Parser(argparse.ArgumentParser):
    """Usage errors as one ``nvmeof: error: ...`` line (exit 2), like every other error."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, "nvmeof: error: %s (see --help)\n" % message)


def _parser() -> argparse.ArgumentParser:
    root = os.environ.get("NVMEOF_CONFIGFS_ROOT", configfs.DEFAULT_ROOT)
    p = _Parser(prog="python3 -m nvmeof", description="NVMe-oF target configuration (nvmet)")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    def cmd(name: str, help: str) -> argparse.ArgumentParser:
        c = sub.add_parser(name, help=help)
        c.add_argument("--json", action="store_true", help="machine-readable output")
        return c

    g = cmd("generate", "expand a TOML target spec into nvmetcli JSON")
    g.add_argument("spec")
    g.add_argument("-o", "--output", help="write here (mode 0600) instead of stdout")
    v = cmd("validate", "check an nvmetcli JSON file")
    v.add_argument("file")
    v.add_argument("--strict-nqn", action="store_true", help="require NVMe-spec NQNs everywhere")
    a = cmd("apply", "apply an nvmetcli JSON file to configfs")
    a.add_argument("file")
    a.add_argument("--root", default=root, help="nvmet configfs root (default %(default)s)")
    a.add_argument("--collect", action="store_true", help="carry on past failures instead of rolling back")
    a.add_argument("--no-nvmetcli", action="store_true", help="write configfs directly even if nvmetcli exists")
    c = cmd("clear", "tear down a file's objects, or everything")
    c.add_argument("file", nargs="?")
    c.add_argument("--root", default=root)
    s = cmd("save", "print what is configured now (nvmetcli save format)")
    s.add_argument("--root", default=root)
    s.add_argument("-o", "--output")
    return p


def _out(args: argparse.Namespace, payload: dict[str, object], text: str) -> None:
    print(json.dumps(payload, indent=2, sort_keys=True) if args.json else text)


def _report(args: argparse.Namespace, report: configfs.ApplyReport, verb: str) -> int:
    lines = ["%s %s via %s: %d created, %d removed, %d attributes written, %d failures"
             % (verb, report.root, report.method.value, len(report.created), len(report.removed),
                len(report.written), len(report.failures))]
    lines += ["  failed: %s" % f for f in report.failures] + ["  note: %s" % n for n in report.notes]
    _out(args, report.to_dict(), "\n".join(lines))
    return 0 if report.ok else 1


def _run(args: argparse.Namespace) -> int:
    if args.command == "generate":
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cfg = generate(load_spec(args.spec))
        for w in caught:
            print("nvmeof: warning: %s" % w.message, file=sys.stderr)
        return _emit(args, cfg)
    if args.command == "validate":
        cfg = NvmetConfig.load(args.file)
        cfg.validate(NqnRule.SPEC if args.strict_nqn else NqnRule.PERMISSIVE)
        _out(args, {"ok": True, "file": args.file, "hosts": len(cfg.hosts), "subsystems": len(cfg.subsystems),
                    "ports": len(cfg.ports)},
             "%s: valid (%d hosts, %d subsystems, %d ports)"
             % (args.file, len(cfg.hosts), len(cfg.subsystems), len(cfg.ports)))
        return 0
    if args.command == "apply":
        cfg = NvmetConfig.load(args.file)
        report = configfs.apply(cfg, args.root, on_error="collect" if args.collect else "abort",
                                use_nvmetcli=not args.no_nvmetcli)
        return _report(args, report, "applied to")
    if args.command == "clear":
        return _report(args, configfs.clear(args.root, NvmetConfig.load(args.file) if args.file else None),
                       "cleared")
    return _emit(args, configfs.read_tree(args.root))


def _emit(args: argparse.Namespace, cfg: NvmetConfig) -> int:
    """Write ``cfg`` to ``--output`` (0600, atomically) or print it as nvmetcli JSON."""
    if args.output:
        cfg.dump(args.output)
        _out(args, {"ok": True, "output": args.output}, "wrote %s" % args.output)
    else:
        sys.stdout.write(cfg.to_json())
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns the exit status (see the module docstring)."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as e:  # --help, or a usage error already printed
        return e.code if isinstance(e.code, int) else 2
    try:
        return _run(args)
    except NvmeofError as e:
        message = str(e).splitlines()[0] if str(e) else type(e).__name__
        if args.json:
            payload: dict[str, object] = {"ok": False, "error": message}
            if isinstance(e, ApplyError):
                payload["failures"] = [{"path": f.path, "value": f.value, "error": f.error} for f in e.failures]
            print(json.dumps(payload, indent=2, sort_keys=True))
        print("nvmeof: error: %s" % message, file=sys.stderr)
        return 2
