"""vLLM's CPU paged KV cache as store pages, without vLLM: ``CpuPagedKV``'s block copies
for the ``vec`` and ``amx`` kernels' packings, in either page order, and its refusals. The
packings themselves are checked against the real kernels in test_vllm_engine.py; the
connector's halves in test_vllm_connector.py."""

from __future__ import annotations

import pytest
import torch

from tierkv.errors import InputError, LayoutError
from tierkv.integrations.vllm.blocks import CpuPagedKV, runs
from tierkv.layout import KVLayout

L, H, N, D = 3, 2, 16, 8           # layers, KV heads, block size, head dim
LAYOUT = KVLayout(L, H, D, "bf16", N)
BLOCKS = 12


def engine_caches(seed: int = 0, blocks: int = BLOCKS) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(blocks, H, N, 2 * D, generator=g).to(torch.bfloat16) for _ in range(L)]


def test_runs_groups_consecutive_ids() -> None:
    assert runs([3, 4, 5, 9, 2, 3]) == [(0, 3, 3), (3, 9, 1), (4, 2, 2)]
    assert runs([]) == []


def test_gather_puts_k_and_v_in_the_store_order() -> None:
    """Each (block, head) plane is K^T [D, N] then V [N, D] (the CPU kernel's packing,
    checked against the kernel in test_vllm_engine.py); a page is [L, 2, N, H, D]."""
    caches = engine_caches()
    kv = CpuPagedKV(caches, LAYOUT, "vec")
    pages = kv.pages(torch.zeros(2, LAYOUT.page_bytes, dtype=torch.uint8))
    for layer in range(L):
        kv.gather(layer, [7, 2], pages)
    for row, block in enumerate([7, 2]):
        for layer in range(L):
            plane = caches[layer][block].reshape(H, 2 * N * D)
            k_t = plane[:, : N * D].reshape(H, D, N)
            v = plane[:, N * D:].reshape(H, N, D)
            for n in (0, 5, N - 1):
                for h in range(H):
                    assert torch.equal(pages[row, layer, 0, n, h], k_t[h, :, n])
                    assert torch.equal(pages[row, layer, 1, n, h], v[h, n])


def test_in_the_vllm_cpu_order_a_pages_layer_is_the_blocks_bytes() -> None:
    native = KVLayout(L, H, D, "bf16", N, page_order="vllm_cpu")
    caches = engine_caches()
    kv = CpuPagedKV(caches, native, "vec")
    pages = kv.pages(torch.zeros(3, native.page_bytes, dtype=torch.uint8))
    assert tuple(pages.shape) == (3, L, H, N, 2 * D)
    for layer in range(L):
        kv.gather(layer, [7, 2, 3], pages)
    for row, block in enumerate([7, 2, 3]):
        for layer in range(L):
            assert torch.equal(pages[row, layer], caches[layer][block])
    # The same blocks in the standard order hold the same values, permuted (so one
    # engine's pages are either order's, never both: the orders are separate layouts).
    std = CpuPagedKV(caches, LAYOUT, "vec")
    spages = std.pages(torch.zeros(3, LAYOUT.page_bytes, dtype=torch.uint8))
    for layer in range(L):
        std.gather(layer, [7, 2, 3], spages)
    assert not torch.equal(spages.flatten(), pages.flatten())
    assert torch.equal(spages.flatten().sort().values, pages.flatten().sort().values)


@pytest.mark.parametrize("order", ["standard", "vllm_cpu"])
@pytest.mark.parametrize("ids", [[1, 2, 3, 4], [9, 3, 0, 11], [5]])
def test_scatter_inverts_gather(ids: list[int], order: str) -> None:
    src, dst = engine_caches(1), engine_caches(2)
    before = [d.clone() for d in dst]
    layout = KVLayout(L, H, D, "bf16", N, page_order=order)
    a, b = CpuPagedKV(src, layout, "vec"), CpuPagedKV(dst, layout, "vec")
    pages = a.pages(torch.zeros(len(ids), LAYOUT.page_bytes, dtype=torch.uint8))
    for layer in range(L):
        a.gather(layer, ids, pages)
        b.scatter(layer, pages, ids)
    others = [i for i in range(BLOCKS) if i not in ids]
    for layer in range(L):
        assert torch.equal(dst[layer][ids], src[layer][ids])
        assert torch.equal(dst[layer][others], before[layer][others])   # nothing else written


NA, DA = 32, 32    # the AMX kernel's smallest block; a head dim of two V tiles


def amx_element(n: int, d: int) -> tuple[int, int]:
    """Where vLLM's AMX kernel puts K and V of token ``n``, dim ``d`` in a (block, head)
    plane of N tokens and D dims (probed against the kernel: test_vllm_engine.py)."""
    k = (n // 16) * (DA * 16) + (d // 2) * 32 + (n % 16) * 2 + d % 2
    v = NA * DA + (d // 16) * (NA * 16) + (n // 2) * 32 + (d % 16) * 2 + n % 2
    return k, v


@pytest.mark.parametrize("order", ["standard", "vllm_cpu_amx"])
@pytest.mark.parametrize("ids", [[1, 2, 3], [4, 0, 2], [5]])
def test_amx_blocks_unpack_element_by_element_and_pack_back(order: str, ids: list[int]) -> None:
    """The AMX kernel's packing (K [N/16, D/2, 16, 2], V [D/16, N/2, 16, 2] a plane), read
    into standard pages or kept whole, gives each token's K and V as the element formula
    places them, and written back gives the blocks' bytes."""
    from tierkv.layout import to_standard_order

    g = torch.Generator().manual_seed(3)
    caches = [torch.randn(6, H, NA, 2 * DA, generator=g).to(torch.bfloat16) for _ in range(L)]
    layout = KVLayout(L, H, DA, "bf16", NA, page_order=order)
    kv = CpuPagedKV(caches, layout, "amx")
    assert kv.native == (order == "vllm_cpu_amx")
    pages = kv.pages(torch.zeros(len(ids), layout.page_bytes, dtype=torch.uint8))
    for layer in range(L):
        kv.gather(layer, ids, pages)
    std = torch.from_numpy(to_standard_order(pages.view(torch.int16).numpy(), layout)).view(torch.bfloat16)
    for row, block in enumerate(ids):
        for layer in range(L):
            plane = caches[layer][block].reshape(H, 2 * NA * DA)
            for n in (0, 1, 15, 16, 17, NA - 1):
                for d in (0, 1, 2, 15, 16, 17, DA - 1):
                    k, v = amx_element(n, d)
                    assert torch.equal(std[row, layer, 0, n, :, d], plane[:, k])
                    assert torch.equal(std[row, layer, 1, n, :, d], plane[:, v])
    back = [torch.zeros_like(c) for c in caches]
    into = CpuPagedKV(back, layout, "amx")
    for layer in range(L):
        into.scatter(layer, pages, ids)
        assert torch.equal(back[layer][ids], caches[layer][ids])
        assert not back[layer][[i for i in range(6) if i not in ids]].any()   # nothing else written


def test_a_page_order_of_another_kernel_or_an_unknown_kernel_is_refused() -> None:
    amx_caches = [torch.zeros(4, H, NA, 2 * DA, dtype=torch.bfloat16)] * L
    vec_pages = KVLayout(L, H, DA, "bf16", NA, page_order="vllm_cpu")
    with pytest.raises(LayoutError, match="page_order 'vllm_cpu'.*kernel is 'amx'.*page_order = \"vllm_cpu_amx\""):
        CpuPagedKV(amx_caches, vec_pages, "amx")
    with pytest.raises(LayoutError, match="page_order 'vllm_cpu_amx'.*kernel is 'vec'.*page_order = \"vllm_cpu\""):
        CpuPagedKV(amx_caches, KVLayout(L, H, DA, "bf16", NA, page_order="vllm_cpu_amx"), "vec")
    with pytest.raises(LayoutError, match="kernel here is 'neon'.*knows vec, vec16, amx"):
        CpuPagedKV(amx_caches, vec_pages, "neon")
    CpuPagedKV(amx_caches, KVLayout(L, H, DA, "bf16", NA), "amx")   # standard: any kernel


def test_layout_mismatch_is_refused_naming_the_fix() -> None:
    with pytest.raises(LayoutError, match=r"tokens_per_page: engine 32 vs store 16.*tokens_per_page=32"):
        CpuPagedKV([torch.zeros(4, H, 32, 2 * D, dtype=torch.bfloat16)] * L, LAYOUT, "vec")
    with pytest.raises(LayoutError, match="num_layers: engine 2 vs store 3"):
        CpuPagedKV(engine_caches()[:2], LAYOUT, "vec")
    with pytest.raises(LayoutError, match="dtype: engine float16 vs store bfloat16"):
        CpuPagedKV([c.to(torch.float16) for c in engine_caches()], LAYOUT, "vec")
    with pytest.raises(LayoutError, match=r"\[num_blocks, kv_heads, block_size, 2\*head_dim\]"):
        CpuPagedKV([torch.zeros(2, BLOCKS, N, H, D, dtype=torch.bfloat16)] * L, LAYOUT, "vec")
    kv = CpuPagedKV(engine_caches(), LAYOUT, "vec")
    with pytest.raises(InputError, match=r"block ids must lie in \[0, 12\)"):
        kv.gather(0, [12], kv.pages(torch.zeros(1, LAYOUT.page_bytes, dtype=torch.uint8)))
