"""Builds the optional C extensions: ``tierkv._native`` (key chain and key set),
``tierkv._table`` (the block manager's page table), ``tierkv.policy._leaves`` (the
prefix-aware policies' leaf heaps), ``tierkv.policy._ghost`` (GittinsPolicy's ghost),
``tierkv.codec._codec`` (the lossless KV page codec)
and ``tierkv.tiers._uring`` (an io_uring ring for the NVMe tier's reads, on raw
syscalls: no liburing needed).

All are optional: where no compiler (or no ``xxhash.h``) is present, the package
installs without them and each falls back to Python (same results, slower): the key
chain, the page table (``tierkv.store.table.PyCore``), the leaf heaps, the ghost, the codec's numpy
implementation, and the NVMe tier's thread pool for reads.
"""

import os

from setuptools import Extension, setup

ext_modules = []
if os.path.exists(os.path.join("tierkv", "_native.c")):
    ext_modules.append(
        Extension("tierkv._native", ["tierkv/_native.c"], extra_compile_args=["-O3"], optional=True,
                  depends=["tierkv/xxh_simd.h"])
    )
_CODEC = os.path.join("tierkv", "codec")
if os.path.exists(os.path.join(_CODEC, "_codec.c")):
    ext_modules.append(
        Extension(
            "tierkv.codec._codec",
            [os.path.join(_CODEC, f) for f in ("_codec.c", "codec_common.c", "codec_enc.c", "codec_scan.c",
                                               "codec_dec.c", "codec_planes.c", "codec_rows.c", "codec_simd.c",
                                               "codec_simd_rans.c", "codec_simd_group.c", "codec_simd_group_vbmi2.c",
                                               "codec_simd_rows.c", "codec_simd_scan.c", "codec_gpu.c",
                                               "codec_gpu_emu.c")],
            depends=[os.path.join(_CODEC, h) for h in ("codec_core.h", "codec_dec.h", "codec_enc.h", "codec_simd.h",
                                                             "codec_gpu.h", "codec_gpu_kernel.cuh")]
            + [os.path.join("tierkv", "xxh_simd.h")],
            extra_compile_args=["-O3", "-std=c11"],
            optional=True,
        )
    )
if os.path.exists(os.path.join("tierkv", "tiers", "_uring.c")):
    ext_modules.append(
        Extension("tierkv.tiers._uring", ["tierkv/tiers/_uring.c"], extra_compile_args=["-O2"], optional=True)
    )
_COPY = os.path.join("tierkv", "tiers", "_copy.c")
if os.path.exists(_COPY):  # streamed page copies; the DRAM tier falls back to numpy's
    ext_modules.append(Extension("tierkv.tiers._copy", [_COPY], extra_compile_args=["-O3"], optional=True))
_LEAVES = os.path.join("tierkv", "policy", "_leaves.c")
# The key table the page table, _leaves and _ghost share (a store's slowest tier's keys held once).
_KEYTAB = os.path.join("tierkv", "policy", "keytab.h")
if os.path.exists(os.path.join("tierkv", "_table.c")):
    ext_modules.append(
        Extension("tierkv._table", ["tierkv/_table.c"], extra_compile_args=["-O3"], optional=True, depends=[_KEYTAB])
    )
if os.path.exists(_LEAVES):  # the compiled LeafHeaps; tierkv.policy.leaves falls back to Python
    ext_modules.append(Extension("tierkv.policy._leaves", [_LEAVES], extra_compile_args=["-O3"], optional=True,
                                 depends=[_KEYTAB]))
_GHOST = os.path.join("tierkv", "policy", "_ghost.c")
if os.path.exists(_GHOST):  # the compiled ghost of GittinsPolicy; tierkv.policy.gittins falls back to Python
    # No FMA contraction: its histogram updates and index table give numpy's bits.
    ext_modules.append(Extension("tierkv.policy._ghost", [_GHOST], extra_compile_args=["-O3", "-ffp-contract=off"],
                                 optional=True, depends=[_KEYTAB]))

setup(ext_modules=ext_modules)
