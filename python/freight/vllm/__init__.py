"""freight as a vLLM KV connector, for disaggregated prefill/decode (docs/vllm.md).

``FreightConnector`` is what vLLM loads with ``"kv_connector": "FreightConnector",
"kv_connector_module_path": "freight.vllm"``; it is imported (and vLLM with it) when
first asked for, so that the parts that need no vLLM (:mod:`freight.vllm.layout`,
:mod:`freight.vllm.params`) import without it. The P/D proxy is :mod:`freight.proxy`.
"""

from typing import Any

__all__ = ["FreightConnector"]


def __getattr__(name: str) -> Any:
    if name == "FreightConnector":
        from .connector import FreightConnector

        return FreightConnector
    raise AttributeError(f"module 'freight.vllm' has no attribute {name!r}")
