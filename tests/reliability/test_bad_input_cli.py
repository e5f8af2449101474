"""Bad input at the command line, given as a user gives it: ``python3 -m tierkv ...`` in a
subprocess, bounded by a timeout and a memory limit. Every case must end in one line on
stderr and exit status 2: never a traceback, a hang, an out-of-memory kill, or a
``--json`` report that is not JSON (issue 28, items 6, 7, 8 and 9)."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

TIMEOUT_S = 120          # far above any of these runs: only a hang reaches it
DATA_LIMIT = 2 << 30     # an allocation that runs away fails fast instead of taking the machine
HUGE = "9" * 400


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_DATA, (DATA_LIMIT, DATA_LIMIT))


def tierkv(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run ``python3 -m tierkv ARGS``; a hang fails the test at TIMEOUT_S (the child is killed)."""
    env = {**os.environ, "TMPDIR": str(cwd)}
    return subprocess.run([sys.executable, "-m", "tierkv", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=TIMEOUT_S, preexec_fn=_limit_memory)


def assert_one_line_usage_error(proc: subprocess.CompletedProcess[str], *fragments: str) -> None:
    lines = proc.stderr.splitlines()
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert len(lines) == 1 and lines[0].startswith("tierkv: error: "), proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    assert proc.stdout == ""  # nothing half-printed, in particular no --json with Infinity in it


MIX_CASES = [
    # item 6: looped forever (RSS 450 MB after 20 s); OOM-killed within a minute
    (["--mix", "session_rate_per_s=inf"], ["session_rate_per_s=inf is not a finite number", "[1e-06, 1000000]"]),
    (["--mix", "system_prompt_blocks=1-1000000000"],
     ["system_prompt_blocks", "<= 4096", "(1, 1000000000)"]),
    # item 7: tracebacks from numpy
    (["--mix", "conversation_share=nan"], ["conversation_share=nan is not a finite number", "[0, 1]"]),
    (["--mix", "document_zipf_s=nan"], ["document_zipf_s=nan is not a finite number", "[0, 10]"]),
    (["--mix", "documents=1000000000000"], ["documents must be an integer in [1, 100000], got 1000000000000"]),
    # item 9: printed Infinity in --json
    (["--mix", "think_time_s_mean=1e400", "--json"], ["think_time_s_mean=1e400 is not a finite number"]),
    (["--synthetic-requests", "1000000000000"], ["0 to 1000000 requests, asked for 1000000000000"]),
]


@pytest.mark.parametrize("command", ["replay", "sim"])
@pytest.mark.parametrize("args,fragments", [pytest.param(a, f, id=" ".join(a)) for a, f in MIX_CASES])
def test_a_bad_mix_is_one_line_and_exit_2(command: str, args: list[str], fragments: list[str],
                                          tmp_path: Path) -> None:
    if "--synthetic-requests" not in args:
        args = [*args, "--synthetic-requests", "40"]
    assert_one_line_usage_error(tierkv([command, *args], tmp_path), *fragments)


@pytest.mark.parametrize("args,fragments", [
    pytest.param(["--dram", "99999999999999999999999"],
                 ["--dram: '99999999999999999999999' is 99999999999999999999999 bytes",
                  "1152921504606846976 bytes (1 EiB"], id="dram-23-digits"),
    pytest.param(["--nvme", HUGE], ["--nvme: ", "too long a number (400 digits)"], id="nvme-400-digits"),
    pytest.param(["--page-bytes", HUGE + "KiB"], ["--page-bytes: ", "too long a number (400 digits)"],
                 id="page-bytes-400-digits"),
    pytest.param(["--dram", "9223372036854775807"], ["--dram: ", "more than the largest size tierkv takes"],
                 id="dram-2**63-1"),
])
def test_absurd_sizes_are_one_line_and_exit_2(args: list[str], fragments: list[str], tmp_path: Path) -> None:
    assert_one_line_usage_error(tierkv(["replay", "--synthetic-requests", "40", *args], tmp_path), *fragments)


CONFIG = """[store]
path = "{path}"
model_id = "m"
{store}
[tiers.dram]
capacity_bytes = {dram}
"""


@pytest.mark.parametrize("store,dram,fragments", [
    pytest.param("", "9223372036854775807", ["[tiers.dram]: dram.capacity_bytes: 9223372036854775807 bytes, more than"],
                 id="capacity-2**63-1"),
    pytest.param("", f'"{HUGE}"', ["dram.capacity_bytes: ", "too long a number (400 digits)"], id="size-400-digits"),
    pytest.param('persist_on_close = "false"', '"1MiB"', ["store.persist_on_close must be true or false, got 'false'"],
                 id="persist-string"),
    pytest.param('promote_on_hit = "false"', '"1MiB"', ["store.promote_on_hit must be true or false, got 'false'"],
                 id="promote-string"),
    pytest.param("PATH42", '"1MiB"', ["store.path must be a string, got 42"], id="path-42"),
])
def test_bad_configs_are_one_line_and_exit_2(store: str, dram: str, fragments: list[str], tmp_path: Path) -> None:
    text = CONFIG.format(path=tmp_path / "store", store=store, dram=dram)
    if store == "PATH42":
        text = text.replace(f'path = "{tmp_path / "store"}"', "path = 42").replace("PATH42", "")
    config = tmp_path / "bad.toml"
    config.write_text(text)
    proc = tierkv(["replay", "--synthetic-requests", "40", "--config", str(config)], tmp_path)
    assert_one_line_usage_error(proc, str(config), *fragments)


def _strict_json(text: str) -> object:
    def refuse(constant: str) -> object:
        raise AssertionError(f"--json printed {constant}, which is not JSON")
    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize("command", ["replay", "sim"])
def test_the_longest_think_time_still_gives_json(command: str, tmp_path: Path) -> None:
    """The bound (1e6 s) is a value that works: arrivals stay finite and --json stays JSON."""
    extra = ["--capacity", "5%", "--policy", "lru"] if command == "sim" else []
    proc = tierkv([command, "--synthetic-requests", "40", "--mix", "think_time_s_mean=1000000", "--json", *extra],
                  tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = _strict_json(proc.stdout)
    first = out[0] if isinstance(out, list) else out
    assert isinstance(first, dict) and first["workload"]["mix"] == {"think_time_s_mean": 1000000.0}
