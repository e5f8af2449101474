"""How long the vLLM connector's block copies take, per CPU kernel packing and page order:
16 blocks of SmolLM2-135M (30 layers, 3 KV heads, block size 128, head dim 64), all layers,
engine to pages (gather, a save) and back (scatter, a load), one run of blocks and 16
scattered ones; median of 7. Runs in tierkv's Python (no vLLM: the packings are tierkv's
own reading of them, checked against the kernels in tests/integrations/test_vllm_engine.py).

    python3 tools/vllm_probe/block_copies.py
"""
import statistics
import time

import torch

from tierkv.integrations.vllm.blocks import CpuPagedKV
from tierkv.layout import KVLayout

L, H, N, D, BLOCKS = 30, 3, 128, 64, 64
RUN = list(range(8, 24))
SCATTERED = [5, 40, 2, 33, 17, 9, 60, 1, 22, 48, 11, 3, 57, 29, 36, 14]


def main() -> None:
    caches = [torch.randn(BLOCKS, H, N, 2 * D).to(torch.bfloat16) for _ in range(L)]
    print(f"{'kernel':6} {'page_order':13} {'blocks':9} {'gather ms':>9} {'scatter ms':>10}")
    for kernel, orders in (("vec", ("vllm_cpu", "standard")), ("amx", ("vllm_cpu_amx", "standard"))):
        for order in orders:
            layout = KVLayout(L, H, D, "bf16", N, page_order=order)
            kv = CpuPagedKV(caches, layout, kernel)
            for name, ids in (("run", RUN), ("scattered", SCATTERED)):
                pages = kv.pages(torch.zeros(len(ids), layout.page_bytes, dtype=torch.uint8))
                times = []
                for _ in range(7):
                    t0 = time.perf_counter()
                    for layer in range(L):
                        kv.gather(layer, ids, pages)
                    t1 = time.perf_counter()
                    for layer in range(L):
                        kv.scatter(layer, pages, ids)
                    times.append((t1 - t0, time.perf_counter() - t1))
                gather = statistics.median(t for t, _ in times) * 1e3
                scatter = statistics.median(t for _, t in times) * 1e3
                print(f"{kernel:6} {order:13} {name:9} {gather:9.2f} {scatter:10.2f}")


if __name__ == "__main__":
    main()
