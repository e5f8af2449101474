"""The AVX-512 rANS encoder's single-precision quotients, checked in C.

``tools/check_rans_quotients.c`` includes the encoder's source and compares the state
its float-reciprocal step computes with the exact integer one at every quotient of
sampled frequencies (all frequencies when run by hand: about a minute). The blobs'
byte-for-byte agreement with the scalar encoder (test_roundtrip) covers the states
real pages reach; this covers the quotient range's edges, where an estimate is off.
"""
from __future__ import annotations

from pathlib import Path

from tests.codec.conftest import run_c_check


def test_float_quotients_are_exact_at_every_sampled_frequency(tmp_path: Path) -> None:
    lines = run_c_check(tmp_path, "check_rans_quotients", "101")
    assert [ln.split(":")[0] for ln in lines] == ["pbits 11", "pbits 10"]
    for ln in lines:   # sampled frequencies (every 101st, and 2^pbits), every quotient, four remainders
        checked = int(ln.split(": ")[1].split()[0])
        assert checked > 100_000_000 and ln.endswith(" 0 wrong"), ln
