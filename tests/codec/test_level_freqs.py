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

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_table_frequencies_are_exact_quotients(tmp_path: Path) -> None:
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler")
    exe = tmp_path / "check_level_freqs"
    subprocess.run([cc, "-O2", "-I", str(ROOT / "tierkv" / "codec"), "-o", str(exe),
                    str(ROOT / "tools" / "check_level_freqs.c")], check=True, capture_output=True, text=True)
    res = subprocess.run([str(exe), "4001"], capture_output=True, text=True, timeout=300)
    if res.returncode == 2:
        pytest.skip(res.stdout.strip())
    assert res.returncode == 0, res.stdout + res.stderr
    lines = res.stdout.splitlines()
    assert [ln.split(":")[0] for ln in lines] == ["quotients pbits 8", "quotients pbits 11", "tables"]
    for ln in lines:
        checked = int(ln.split(": ")[1].split()[0])
        assert checked >= 1_000_000 and ln.endswith(" 0 wrong"), ln
