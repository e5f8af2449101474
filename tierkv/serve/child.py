"""``tierkv serve --foreground`` as a child process: what tools that run daemons of their own
use (``tierkv demo --engine vllm``, ``tierkv bench vllm``, ``tierkv cluster up``)."""

from __future__ import annotations

import json
import select
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from tierkv.errors import ConfigError


class Daemon:
    """``tierkv serve --foreground`` over the config at ``config``, as a child process."""

    def __init__(self, config: Path, log: Path, *, new_session: bool = False, prefix: Sequence[str] = ()) -> None:
        """``new_session``: run it in a session of its own (a terminal's Ctrl-C then reaches
        only its parent, which stops it in order); default: in the parent's process group
        (a caller that kills its group ends it too). ``prefix``: a command it runs under
        (``ip netns exec NAME``: in a network namespace)."""
        self.config, self.log, self.new_session, self.prefix = config, log, new_session, list(prefix)
        self.proc: subprocess.Popen[str] | None = None
        self.socket = ""

    def start(self, timeout_s: float = 60.0) -> Daemon:
        logf = open(self.log, "a")
        self.proc = subprocess.Popen([*self.prefix, sys.executable, "-m", "tierkv", "serve", "--config", str(self.config),
                                      "--foreground", "--json"], stdout=subprocess.PIPE, stderr=logf, text=True,
                                     start_new_session=self.new_session)
        logf.close()
        assert self.proc.stdout is not None
        # One line once the socket is up (EOF if it failed); a daemon that says nothing
        # within timeout_s is stopped rather than waited for.
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.stop()
            try:   # its last words, which a temporary folder would take with it
                said = " | ".join(self.log.read_text(errors="replace").strip().splitlines()[-3:])
            except OSError:
                said = ""
            raise ConfigError(f"tierkv serve did not start{'' if ready else f' within {timeout_s:.0f} s'}; "
                              f"its log: {self.log}{f' (ends: {said[-500:]})' if said else ''}")
        self.socket = json.loads(line)["socket"]
        return self

    def stop(self, timeout_s: float = 60.0) -> None:
        """SIGTERM (the daemon writes its DRAM pages down to NVMe and closes), then wait."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()

    def __enter__(self) -> Daemon:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()
