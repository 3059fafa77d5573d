"""What each instance is sent, following vLLM's P/D convention for KV connectors
(FreightConnector, NixlConnector, ...).

The prefill instance gets the client's request for one token, not streamed, with
``kv_transfer_params`` ``{"do_remote_decode": true}``: it computes the prompt, keeps its
KV blocks for a decode instance and answers with where they are. The decode instance
gets the client's request unchanged but for those params, and its answer (streamed or
not) is the client's.
"""

from __future__ import annotations

from typing import Any, Dict

# Options that make no sense for a one-token, unstreamed answer.
_NOT_FOR_PREFILL = ("stream_options", "min_tokens", "min_completion_tokens")


# Both change only top-level keys: a shallow copy leaves the client's request as it was
# without copying its prompt or messages.


def prefill_body(body: Dict[str, Any]) -> Dict[str, Any]:
    out = dict(body)
    out["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False}
    out["stream"] = False
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    for key in _NOT_FOR_PREFILL:
        out.pop(key, None)
    return out


def decode_body(body: Dict[str, Any], params: Dict[str, Any]) -> Dict[str, Any]:
    out = dict(body)
    out["kv_transfer_params"] = params
    return out
