"""tierkv: a tiered KV-cache store for LLM serving engines.

The public API: :class:`Store` with its config dataclasses and the KV layout. Names
are imported on first use, so tools that need no store (``tierkv plan``) do not pay
for importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

_EXPORTS = {
    "GetResult": "tierkv.store.api", "LookupResult": "tierkv.store.api", "PutResult": "tierkv.store.api", "Store": "tierkv.store.api",
    "DramConfig": "tierkv.config", "HbmConfig": "tierkv.config", "NvmeConfig": "tierkv.config", "StoreConfig": "tierkv.config",
    "load_config": "tierkv.config", "TierKVError": "tierkv.errors", "DType": "tierkv.layout",
    "KVLayout": "tierkv.layout", "LayoutKind": "tierkv.layout",
}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from tierkv.store.api import GetResult, LookupResult, PutResult, Store
    from tierkv.config import DramConfig, HbmConfig, NvmeConfig, StoreConfig, load_config
    from tierkv.errors import TierKVError
    from tierkv.layout import DType, KVLayout, LayoutKind


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tierkv' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
