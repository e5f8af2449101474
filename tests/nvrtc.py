"""Builds CUDA C++ to PTX with NVRTC, CUDA's runtime compiler (a library: no GPU needed), for
the kernels' build checks. Found on the library path or in an installed ``nvidia-cuda-nvrtc``
wheel (``tools/install.sh`` installs one); the checks skip where there is none."""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import sys
from collections.abc import Sequence

import pytest


def library() -> ctypes.CDLL | None:
    candidates = [ctypes.util.find_library("nvrtc")]
    for root in sys.path:
        candidates += sorted(glob.glob(os.path.join(root, "nvidia", "*", "lib", "libnvrtc.so*")))
    for name in candidates:
        if name and "builtins" not in name:
            try:
                return ctypes.CDLL(name)
            except OSError:
                continue
    return None


def compile_ptx(source: str, options: Sequence[str], name_expressions: Sequence[str] = ()) -> str:
    """The PTX of ``source``; fails the test with NVRTC's log when it does not build, skips
    it where no NVRTC library is installed."""
    lib = library()
    if lib is None:
        pytest.skip("no NVRTC library here (pip install nvidia-cuda-nvrtc-cu12)")
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"kernel.cu", 0, None, None) == 0
    try:
        for name in name_expressions:
            assert lib.nvrtcAddNameExpression(prog, name.encode()) == 0
        opts = (ctypes.c_char_p * len(options))(*(o.encode() for o in options))
        status = lib.nvrtcCompileProgram(prog, len(options), opts)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        assert status == 0, log.value.decode()
        lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
        ptx = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetPTX(prog, ptx)
        return ptx.value.decode()
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
