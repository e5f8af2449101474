"""tierkv: a tiered KV-cache store for LLM serving engines.

The public API: :class:`Store` with its config dataclasses and the KV layout.
"""

from tierkv.api import GetResult, LookupResult, PutResult, Store
from tierkv.config import DramConfig, NvmeConfig, StoreConfig, load_config
from tierkv.errors import TierKVError
from tierkv.layout import DType, KVLayout, LayoutKind

__version__ = "0.1.0"

__all__ = ["DType", "DramConfig", "GetResult", "KVLayout", "LayoutKind", "LookupResult", "NvmeConfig",
           "PutResult", "Store", "StoreConfig", "TierKVError", "load_config"]
