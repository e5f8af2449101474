"""Lossy KV pages (RDKV, issue 26): per-token and per-channel bit widths under a budget.

:mod:`tierkv.lossy.quant` quantizes groups of elements; :mod:`tierkv.lossy.format` packs a
page at the widths an allocation chose into a versioned, checksummed blob and back;
:mod:`tierkv.lossy.alloc` chooses the widths (rate-distortion, or uniform as a baseline);
:mod:`tierkv.lossy.scoring` measures what the allocation needs from a transformers model
(token and channel importance, per-layer sensitivity). See docs/lossy.md.
"""
