"""The ``kv_transfer_params`` of a request handed from a prefill instance to a decode
instance, as FreightConnector writes and reads them.

A P/D proxy sends the prompt to the prefill instance with ``{"do_remote_decode": true}``
and ``max_tokens`` 1; the prefill instance's connector answers (in the response's
``kv_transfer_params``) with where the prompt's KV blocks are; the proxy sends the
request on to the decode instance with those params, whose connector reads the blocks
it lacks. The keys are vLLM's (``do_remote_prefill``, ``remote_block_ids``...) where
vLLM has a name for the thing, so that proxies written for vLLM's own connectors work
unchanged; the rest are freight's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional

from ..errors import InvalidArgumentError
from .layout import Geometry

# The version of what follows; a decode instance refuses params of another.
VERSION = 2


@dataclass(frozen=True)
class Place:
    """Where one prefill worker (one tensor-parallel rank) keeps its KV blocks: its
    freight agent, each layer's blocks' base address and stride there, and how many
    blocks each layer has."""

    agent_address: str
    agent_name: str
    layer_bases: List[int]
    layer_strides: List[int]
    num_blocks: int

    def to_dict(self) -> Dict[str, Any]:
        return {"agent_address": self.agent_address, "agent_name": self.agent_name,
                "layer_bases": list(self.layer_bases), "layer_strides": list(self.layer_strides),
                "num_blocks": self.num_blocks}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Place":
        place = cls(agent_address=str(d["agent_address"]), agent_name=str(d["agent_name"]),
                    layer_bases=list(map(int, d["layer_bases"])),
                    layer_strides=list(map(int, d["layer_strides"])), num_blocks=int(d["num_blocks"]))
        if len(place.layer_bases) != len(place.layer_strides):
            raise ValueError("as many layer bases as strides")
        return place


@dataclass(frozen=True)
class Handoff:
    """What a prefill instance tells a decode instance about one request."""

    request_id: str  # the prefill instance's id of the request
    engine_id: str
    block_ids: List[int]
    ranks: List[Place]  # by tensor-parallel rank
    geometry: Geometry

    def to_params(self) -> Dict[str, Any]:
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_request_id": self.request_id,
            "remote_engine_id": self.engine_id,
            "remote_block_ids": list(self.block_ids),
            "freight": {
                "version": VERSION,
                "ranks": [r.to_dict() for r in self.ranks],
                "geometry": self.geometry.to_dict(),
            },
        }

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> "Handoff":
        """Reads what a prefill instance's FreightConnector wrote; a clear
        :class:`freight.InvalidArgumentError` for anything else (params of another
        connector, another version, a field missing or of the wrong type)."""
        ours = params.get("freight")
        if not isinstance(ours, Mapping):
            raise InvalidArgumentError(
                "the request's kv_transfer_params carry no 'freight' section: the prefill instance does not run "
                f"FreightConnector (keys: {sorted(params)})"
            )
        if ours.get("version") != VERSION:
            raise InvalidArgumentError(
                f"the prefill instance's FreightConnector writes params version {ours.get('version')!r}, this "
                f"one reads version {VERSION}: run the same freight release on both"
            )
        try:
            return cls(
                request_id=str(params["remote_request_id"]),
                engine_id=str(params["remote_engine_id"]),
                block_ids=list(map(int, params["remote_block_ids"])),
                ranks=[Place.from_dict(r) for r in ours["ranks"]],
                geometry=Geometry.from_dict(ours["geometry"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise InvalidArgumentError(f"the request's kv_transfer_params are malformed ({e!r})") from e


@dataclass
class Load:
    """A decode instance's request whose blocks ``local_blocks`` (the ones it lacks,
    in prompt order) are to be filled from the prefill instance: ``params`` are the
    request's ``kv_transfer_params`` as the prefill instance wrote them.

    With no blocks to fill (this instance had them all cached, or the request ended
    before it was scheduled) the prefill instance is only told to let its blocks go,
    and the load is not reported finished: vLLM waits for no such load (and takes a
    report of one it does not know for a broken connector)."""

    local_blocks: List[int]
    params: Dict[str, Any]

    @property
    def awaited(self) -> bool:
        return bool(self.local_blocks)


def wants_remote_prefill(params: Optional[Mapping[str, Any]]) -> bool:
    """Whether a request arrived at a decode instance to load its prompt's KV."""
    return params is not None and bool(params.get("do_remote_prefill"))


def wants_remote_decode(params: Optional[Mapping[str, Any]]) -> bool:
    """Whether a request arrived at a prefill instance to hand its KV on."""
    return params is not None and bool(params.get("do_remote_decode"))


# Notifications between the workers: the decode side tells the prefill side that it has
# a request's blocks (or gave up on them), so that they can be freed.
DONE = b"freight-vllm done "


def done_message(request_id: str) -> bytes:
    return DONE + request_id.encode()


def parse_done(msg: bytes) -> Optional[str]:
    if not msg.startswith(DONE):
        return None
    try:
        return msg[len(DONE):].decode()
    except UnicodeDecodeError:
        return None
