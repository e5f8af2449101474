"""Engine-facing copies: a serving engine's paged KV <-> store pages, and DRAM <-> HBM.

- :mod:`tierkv.engine.geometry`: the engine's declared layout (``FLASH``, ``BLOCKS_FIRST``,
  ``MLA``) and its mapping onto store pages;
- :mod:`tierkv.engine.kv`: :class:`EngineKV`, batched ``gather`` / ``scatter``;
- :mod:`tierkv.engine.layerwise`: ``load_layers``, one completion per layer;
- :mod:`tierkv.engine.streams`: :class:`CopyStream`, copies on a side stream with futures;
- :mod:`tierkv.engine.rows`: row copies between tier buffers (what the HBM tier runs);
- :mod:`tierkv.engine.cuda`: the one-launch chunk-copy kernel (CuPy RawModule).

Which path runs where (``CopyPath``): on CUDA with CuPy, ``KERNEL``: one launch per
batch over every layer, block and K/V plane, reading and writing pinned host pages in
place. On CUDA without CuPy, ``TORCH``: ``index_select``/``index_copy_`` per layer, host
pages staged through a device buffer with one DMA copy per run of consecutive rows.
On CPU, ``TORCH`` (``KERNEL`` there runs the kernel's descriptors through a host
emulation, for tests). docs/engine.md has the details and the measured figures.
"""

from tierkv.engine.kv import EngineKV, gather, scatter
from tierkv.engine.layerwise import LayerwiseLoad, load_layers
from tierkv.engine.geometry import EngineLayout, EngineLayoutKind, PageGeometry
from tierkv.engine.rows import CopyPath, default_path
from tierkv.engine.streams import Completion, CopyStream

__all__ = ["Completion", "CopyPath", "CopyStream", "EngineKV", "EngineLayout", "EngineLayoutKind",
           "LayerwiseLoad", "PageGeometry", "default_path", "gather", "load_layers", "scatter"]
