"""The copy kernel's source compiles for Hopper with NVRTC, and uses 16-byte vector loads.

Needs only the NVRTC library (no GPU; ``tests/nvrtc.py``); skipped where there is none.
The ``gpu`` tests build and run the same source through CuPy.
"""

from __future__ import annotations

from tests.nvrtc import compile_ptx
from tierkv.engine.cuda import KERNEL_SOURCE, NAME_EXPRESSIONS


def test_kernel_compiles_for_sm90() -> None:
    text = compile_ptx(KERNEL_SOURCE, ["--gpu-architecture=compute_90"], NAME_EXPRESSIONS)
    assert "ld.global.v4.u32" in text and "st.global.v4.u32" in text
