"""A minimal out-of-tree vLLM V1 KV connector that loads nothing and logs every call.

Load it with
    KVTransferConfig(kv_connector="ProbeConnector", kv_role="kv_both",
                     kv_connector_module_path="probe_connector",
                     kv_connector_extra_config={"probe_log": "/path/calls.log"})
The module must be importable in the engine-core and worker processes (spawned): put its folder
on PYTHONPATH (run_probe.py does this through the environment).

Each call appends one JSON line {t, pid, role, call, ...} to the log (O_APPEND, so the scheduler
process and the worker process can share one file). Layer-wise calls (wait_for_layer_load,
save_kv_layer) are logged in full for the first and last attention layer of each step and
counted for the rest; set PROBE_LOG_ALL_LAYERS=1 to log each of them.

PROBE_CLAIM=1 (experiment only): get_num_new_matched_tokens claims the block-aligned prefix a
request shares with an earlier request (by block hash) while loading nothing, to show how vLLM
reports external tokens (the generated text is then wrong).
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

_LOG_ALL_LAYERS = os.environ.get("PROBE_LOG_ALL_LAYERS") == "1"
_CLAIM = os.environ.get("PROBE_CLAIM") == "1"


def _t(x: Any) -> Any:
    """Compact description of a tensor (or pass through small values)."""
    if isinstance(x, torch.Tensor):
        return {"shape": list(x.shape), "dtype": str(x.dtype).replace("torch.", ""),
                "stride": list(x.stride()), "contig": x.is_contiguous(), "device": str(x.device)}
    return x


def _small(x: torch.Tensor | None, n: int = 8) -> Any:
    if x is None:
        return None
    flat = x.flatten().tolist()
    return flat if len(flat) <= n else flat[:n] + [f"...({len(flat)})"]


def _hash_hex(h: Any) -> str:
    return bytes(h).hex()[:12] if isinstance(h, (bytes, bytearray)) else repr(h)[:24]


@dataclass
class ProbeConnectorMetadata(KVConnectorMetadata):
    """What the scheduler half hands to the worker half each step (pickled across processes)."""
    step: int
    new_reqs: dict[str, list[int]] = field(default_factory=dict)     # req_id -> block ids
    loads: dict[str, int] = field(default_factory=dict)              # req_id -> claimed tokens


class ProbeConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig"):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self._log_path = extra.get("probe_log", "/tmp/probe_calls.log")
        self._block_size = vllm_config.cache_config.block_size
        self._step = 0
        self._layer_calls: dict[str, int] = {}
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._seen_hashes: set[Any] = set()          # scheduler side, PROBE_CLAIM only
        self._pending_loads: dict[str, int] = {}
        groups = [{"layers": len(g.layer_names), "first": g.layer_names[0],
                   "spec": type(g.kv_cache_spec).__name__,
                   "block_size": getattr(g.kv_cache_spec, "block_size", None),
                   "num_kv_heads": getattr(g.kv_cache_spec, "num_kv_heads", None),
                   "head_size": getattr(g.kv_cache_spec, "head_size", None),
                   "dtype": str(getattr(g.kv_cache_spec, "dtype", None)),
                   "page_size_bytes": getattr(g.kv_cache_spec, "page_size_bytes", None)}
                  for g in kv_cache_config.kv_cache_groups]
        self._log("__init__", block_size=self._block_size, num_blocks=kv_cache_config.num_blocks,
                  groups=groups, n_kv_cache_tensors=len(kv_cache_config.kv_cache_tensors),
                  prefix_caching=vllm_config.cache_config.enable_prefix_caching,
                  kv_role=self._kv_transfer_config.kv_role,
                  engine_id=self._kv_transfer_config.engine_id, claim_mode=_CLAIM)

    # ------------------------------------------------------------------ logging
    def _log(self, call: str, **kw: Any) -> None:
        rec = {"t": round(time.time(), 3), "pid": os.getpid(), "role": self.role.name,
               "call": call, **kw}
        line = json.dumps(rec, default=str) + "\n"
        fd = os.open(self._log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)

    def _layer_call(self, call: str, layer_name: str, **kw: Any) -> None:
        n = self._layer_calls.get(call, 0)
        self._layer_calls[call] = n + 1
        last = self._kv_caches and layer_name == next(reversed(self._kv_caches))
        if _LOG_ALL_LAYERS or n == 0 or last:
            self._log(call, layer_name=layer_name, nth_in_step=n, **kw)

    @staticmethod
    def _req(request: "Request") -> dict[str, Any]:
        return {"req_id": request.request_id, "num_prompt_tokens": request.num_prompt_tokens,
                "num_tokens": request.num_tokens,
                "num_computed_tokens": request.num_computed_tokens,
                "status": str(request.status), "cache_salt": request.cache_salt,
                "n_block_hashes": len(request.block_hashes),
                "block_hashes": [_hash_hex(h) for h in request.block_hashes],
                "kv_transfer_params": request.kv_transfer_params}

    # ======================================================= scheduler side
    def get_num_new_matched_tokens(self, request: "Request",
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        n = 0
        if _CLAIM:
            hit = 0
            for h in request.block_hashes:
                if h not in self._seen_hashes:
                    break
                hit += 1
            # at least one prompt token must stay to be computed
            n = min(hit * self._block_size,
                    (request.num_tokens - 1) // self._block_size * self._block_size)
            n = max(0, n - num_computed_tokens)
        self._log("get_num_new_matched_tokens", arg_num_computed_tokens=num_computed_tokens,
                  returns=[n, False], **self._req(request))
        return n, False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        block_ids = blocks.get_block_ids()
        self._log("update_state_after_alloc", req_id=request.request_id,
                  num_external_tokens=num_external_tokens,
                  block_ids=[list(g) for g in block_ids], blocks_type=type(blocks).__name__)
        if num_external_tokens > 0:
            self._pending_loads[request.request_id] = num_external_tokens

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        self._step += 1
        so = scheduler_output
        cached = so.scheduled_cached_reqs
        meta = ProbeConnectorMetadata(step=self._step, loads=dict(self._pending_loads))
        self._pending_loads.clear()
        for r in so.scheduled_new_reqs:
            meta.new_reqs[r.req_id] = list(r.block_ids[0])
        self._log("build_connector_meta", step=self._step,
                  new_reqs=[{"req_id": r.req_id, "n_prompt": len(r.prompt_token_ids or []),
                             "block_ids": [list(g) for g in r.block_ids],
                             "num_computed_tokens": r.num_computed_tokens}
                            for r in so.scheduled_new_reqs],
                  cached_reqs={"req_ids": list(cached.req_ids),
                               "resumed": sorted(cached.resumed_req_ids),
                               "new_block_ids": [None if b is None else [list(g) for g in b]
                                                 for b in cached.new_block_ids],
                               "num_computed_tokens": list(cached.num_computed_tokens)},
                  num_scheduled_tokens=dict(so.num_scheduled_tokens),
                  total_num_scheduled_tokens=so.total_num_scheduled_tokens,
                  finished_req_ids=sorted(so.finished_req_ids),
                  preempted_req_ids=sorted(so.preempted_req_ids or []),
                  has_sync_kv_loads=so.has_sync_kv_loads,
                  new_block_ids_to_zero=so.new_block_ids_to_zero,
                  meta_loads=meta.loads)
        return meta

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        co = connector_output
        if not co.is_empty():
            self._log("update_connector_output", finished_sending=co.finished_sending,
                      finished_recving=co.finished_recving,
                      invalid_block_ids=co.invalid_block_ids, failed_recving=co.failed_recving,
                      kv_connector_stats=co.kv_connector_stats)

    def request_finished(self, request: "Request",
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._log("request_finished", block_ids=block_ids, **self._req(request))
        if _CLAIM:
            self._seen_hashes.update(request.block_hashes)
        # False: vLLM frees the blocks now. The dict shows up as RequestOutput.kv_transfer_params.
        return False, {"probe_blocks": len(block_ids)}

    def on_new_request(self, request: "Request") -> None:
        self._log("on_new_request", **self._req(request))

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        self._log("bind_kv_cache_manager", type=type(kv_cache_manager).__name__)
        super().bind_kv_cache_manager(kv_cache_manager)

    # ========================================================== worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._kv_caches = kv_caches
        names = list(kv_caches)
        t0 = kv_caches[names[0]]
        ptrs = [kv_caches[n].data_ptr() for n in names]
        storages = {kv_caches[n].untyped_storage().data_ptr() for n in names}
        self._log("register_kv_caches", n_layers=len(names), names=names[:2] + ["..."] + names[-1:],
                  layer0=_t(t0), all_same_shape=len({tuple(v.shape) for v in kv_caches.values()}) == 1,
                  layer_bytes=t0.numel() * t0.element_size(),
                  ptr_delta_layer1_minus_layer0=(ptrs[1] - ptrs[0]) if len(ptrs) > 1 else None,
                  n_distinct_storages=len(storages))

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        am = forward_context.attn_metadata
        first = None
        if isinstance(am, dict) and am:
            k = next(iter(am))
            first = {"layer": k, "type": type(am[k]).__name__}
        self._log("start_load_kv", meta=meta.__dict__, kwargs=list(kwargs),
                  attn_metadata_type=type(am).__name__,
                  attn_metadata_n=len(am) if isinstance(am, dict) else None, first=first,
                  n_no_compile_layers=len(forward_context.no_compile_layers))

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._layer_call("wait_for_layer_load", layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: "AttentionMetadata", **kwargs: Any) -> None:
        n = self._layer_calls.get("save_kv_layer", 0)
        last = self._kv_caches and layer_name == next(reversed(self._kv_caches))
        if not (_LOG_ALL_LAYERS or n == 0 or last):
            self._layer_calls["save_kv_layer"] = n + 1
            return
        am = attn_metadata
        info: dict[str, Any] = {"kv_layer": _t(kv_layer), "attn_metadata_type": type(am).__name__,
                                "same_tensor_as_registered":
                                    self._kv_caches.get(layer_name) is not None
                                    and kv_layer.data_ptr() == self._kv_caches[layer_name].data_ptr(),
                                "kwargs": list(kwargs)}
        for f in ("num_actual_tokens", "max_query_len", "max_seq_len", "num_decode_tokens", "causal"):
            if hasattr(am, f):
                info[f] = getattr(am, f)
        for f in ("slot_mapping", "seq_lens", "query_start_loc", "block_table"):
            v = getattr(am, f, None)
            if isinstance(v, torch.Tensor):
                info[f] = {"shape": list(v.shape), "head": _small(v)}
        # Layout check on live data: for the slots written this step, K is stored transposed
        # ([D, N] per (block, head)), V token-major ([N, D]) -> both columns/rows non-zero.
        sm = getattr(am, "slot_mapping", None)
        if isinstance(sm, torch.Tensor) and sm.numel():
            B, H, N, C = kv_layer.shape
            D = C // 2
            plane = kv_layer.view(B, H, 2 * N * D)
            k_t = plane[..., : N * D].view(B, H, D, N)
            v_n = plane[..., N * D:].view(B, H, N, D)
            s = sm[: int(getattr(am, "num_actual_tokens", sm.numel()))].long()
            b, o = s // N, s % N
            k_ok = bool((k_t[b, :, :, o] != 0).any(dim=(1, 2)).all())   # [T, H, D] per token
            v_ok = bool((v_n[b, :, o] != 0).any(dim=(1, 2)).all())
            info["written_slots_nonzero_K_T_and_V"] = [k_ok, v_ok]
        self._layer_call("save_kv_layer", layer_name, **info)

    def wait_for_save(self) -> None:
        meta = self._connector_metadata
        self._log("wait_for_save", step=getattr(meta, "step", None),
                  layer_call_counts=dict(self._layer_calls))
        self._layer_calls.clear()   # wait_for_save is the last per-step call (start_load_kv
        #                             may run after the forward when there is no sync load)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if finished_req_ids:
            self._log("get_finished", finished_req_ids=sorted(finished_req_ids))
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set()

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        self._log("handle_preemptions", step=getattr(kv_connector_metadata, "step", None))

    def shutdown(self) -> None:
        self._log("shutdown")
