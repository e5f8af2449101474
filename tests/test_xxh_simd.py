"""tierkv/xxh_simd.h: every xxh3 kernel it can pick gives xxhash's hashes.

The Python tests reach only the kernel this CPU picks (AVX-512 where it has it), so a
small C program includes the header, forces each kernel the CPU can run (SSE2, AVX2,
AVX-512) and hashes buffers off a vector boundary around the 240-byte switch, the
64-byte stripes and the 1,024-byte blocks, with and without a seed.
"""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

xxhash = pytest.importorskip("xxhash")

ROOT = Path(__file__).resolve().parents[1]
LENGTHS = (0, 1, 17, 240, 241, 1023, 1024, 1025, 4096, 36904, 65537)
SEED = 0x9E3779B97F4A7C15

PROGRAM = r"""
#include "xxh_simd.h"
#include <stdio.h>
#include <stdlib.h>
int main(int argc, char **argv) {
    static const size_t lens[] = {%(lens)s};
    static unsigned char buf[70000];
    for (int i = 0; i < 70000; i++) buf[i] = (unsigned char)((unsigned)i * 2654435761u >> 13);
#ifdef TK_XXH_DISPATCH
    __builtin_cpu_init();
    int k = atoi(argv[1]);
    if ((k == 2 && !__builtin_cpu_supports("avx512f")) || (k == 1 && !__builtin_cpu_supports("avx2")))
        return 3;
    tk_xxh3_kernel = k;
#else
    if (atoi(argv[1]) != 0) return 3;
#endif
    for (int s = 0; s < 2; s++)
        for (size_t i = 0; i < sizeof(lens) / sizeof(lens[0]); i++)
            printf("%%llu\n", (unsigned long long)tk_xxh3_64(buf + 3, lens[i], s ? %(seed)sull : 0));
    return 0;
}
"""


def test_every_kernel_matches_xxhash(tmp_path: Path) -> None:
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler")
    src = tmp_path / "xxh.c"
    src.write_text(PROGRAM % {"lens": ", ".join(map(str, LENGTHS)), "seed": SEED})
    exe = tmp_path / "xxh"
    subprocess.run([cc, "-O2", "-Wall", "-Werror", "-I", str(ROOT / "tierkv"), "-o", str(exe), str(src)],
                   check=True, capture_output=True, text=True)
    buf = bytes((i * 2654435761 & 0xFFFFFFFF) >> 13 & 0xFF for i in range(70000))
    want = [xxhash.xxh3_64_intdigest(buf[3:3 + n], seed=s) for s in (0, SEED) for n in LENGTHS]
    ran = []
    for kernel in (0, 1, 2):   # SSE2 (or scalar off x86-64), AVX2, AVX-512
        res = subprocess.run([str(exe), str(kernel)], capture_output=True, text=True)
        if res.returncode == 3:
            continue   # this CPU lacks the kernel
        assert res.returncode == 0, res.stderr
        assert [int(x) for x in res.stdout.split()] == want, f"kernel {kernel}"
        ran.append(kernel)
    assert 0 in ran
