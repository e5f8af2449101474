"""tierkv in a real vLLM engine: a V1 KV connector over a ``tierkv serve`` daemon.

- :mod:`~tierkv.integrations.vllm.connector`: ``TierKVConnector``, the class vLLM loads
  (``kv_connector_module_path="tierkv.integrations.vllm.connector"``); imports vLLM;
- :mod:`~tierkv.integrations.vllm.plan`: its scheduler half, what to load and save;
- :mod:`~tierkv.integrations.vllm.transfer`: its worker half, the copies, layer by layer;
- :mod:`~tierkv.integrations.vllm.early`: the scheduler's notes of each load to the
  worker, which starts it before the step's plan arrives;
- :mod:`~tierkv.integrations.vllm.blocks`: vLLM's CPU KV blocks as store pages;
- :mod:`~tierkv.integrations.vllm.run`: one engine process running a chat (in vLLM's Python);
- :mod:`~tierkv.integrations.vllm.session`, :mod:`~tierkv.integrations.vllm.demo`: driving
  engines and a daemon from tierkv's Python (``tierkv demo --engine vllm``).

Only ``connector`` and ``run`` import vLLM; the rest are tested without it.
docs/integration.md says how to configure it and what it does not support yet.
"""
