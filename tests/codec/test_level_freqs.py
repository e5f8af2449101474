"""The AVX-512 table frequencies, checked in C.

``tools/check_level_freqs.c`` includes the decoder's SIMD source and compares the
frequencies its single-precision quotients give (``level_freqs_avx512``, what every
table of every page is built from where AVX-512 runs) with exact integer division: at
sampled totals of every level's weight, at every total where the quotient is an integer
or next to one, and on a million random tables (every total when run by hand: several
minutes). The scalar path is the same formula in double precision; the corruption and
round-trip tests compare the two paths' pages.
"""
from __future__ import annotations

from pathlib import Path

from tests.codec.conftest import run_c_check


def test_table_frequencies_are_exact_quotients(tmp_path: Path) -> None:
    lines = run_c_check(tmp_path, "check_level_freqs", "4001")
    assert [ln.split(":")[0] for ln in lines] == ["quotients pbits 8", "quotients pbits 11", "tables"]
    for ln in lines:
        checked = int(ln.split(": ")[1].split()[0])
        assert checked >= 1_000_000 and ln.endswith(" 0 wrong"), ln
