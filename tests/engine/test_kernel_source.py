"""The copy kernel's source compiles for Hopper with NVRTC, and uses 16-byte vector loads.

Needs only the NVRTC library (no GPU): found on the library path or in an installed
``nvidia-cuda-nvrtc`` wheel. Skipped where there is none (CI); the ``gpu`` tests build
and run the same source through CuPy.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import sys

import pytest

from tierkv.engine.cuda import KERNEL_SOURCE, NAME_EXPRESSIONS


def _nvrtc() -> ctypes.CDLL | None:
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


def test_kernel_compiles_for_sm90() -> None:
    lib = _nvrtc()
    if lib is None:
        pytest.skip("no NVRTC library here")
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), KERNEL_SOURCE.encode(), b"copy.cu", 0, None, None) == 0
    for name in NAME_EXPRESSIONS:
        assert lib.nvrtcAddNameExpression(prog, name.encode()) == 0
    opts = (ctypes.c_char_p * 1)(b"--gpu-architecture=compute_90")
    status = lib.nvrtcCompileProgram(prog, 1, opts)
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    assert status == 0, log.value.decode()
    lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
    ptx = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetPTX(prog, ptx)
    text = ptx.value.decode()
    assert "ld.global.v4.u32" in text and "st.global.v4.u32" in text
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
