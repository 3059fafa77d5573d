"""A P/D proxy for disaggregated serving: an OpenAI-compatible front
(``/v1/completions``, ``/v1/chat/completions``, streamed or not) before prefill and
decode vLLM instances whose KV connector follows vLLM's P/D convention
(FreightConnector, NixlConnector).

    freight proxy --prefill http://10.0.0.1:8100,http://10.0.0.2:8100 --decode http://10.0.0.3:8200

Each request goes to the least-loaded alive prefill instance for its KV, then, with the
``kv_transfer_params`` that instance answers, to the least-loaded alive decode instance,
whose answer is the client's. Health checks take a dead instance out and put it back
when it answers again; ``/metrics`` is in Prometheus's format. Needs aiohttp and
prometheus_client (``pip install 'freight[serve]'``; vLLM's environment has both).

Modules: ``pool`` (whom to send to: no I/O), ``bodies`` (what each role is sent),
``metrics``, ``server`` (aiohttp), ``main`` (the command line).
"""

from .main import main

__all__ = ["main"]
