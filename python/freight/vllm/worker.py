"""FreightConnector in a vLLM worker process: the KV cache registered with a freight
agent, blocks read from the prefill instance, and the prefill instance told when it
may free them.

A decode worker moves a request's blocks in one freight READ: every layer's blocks it
lacks, from the prefill worker of its own tensor-parallel rank, with a notification
that reaches the prefill worker once the bytes are here (so that it frees them). The
READ runs while the scheduler serves other requests; ``finished`` reports it done (or
its blocks as load errors, which vLLM recomputes or fails as its
``kv_load_failure_policy`` says).
"""

from __future__ import annotations

import logging
import mmap
import os
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Set, Tuple


import freight
from freight import AgentConfig

from .config import Settings
from .layout import (Geometry, LayerBlocks, block_indices, dim_order, every_block, layer_blocks, mismatches,
                     page_spans, regions)
from .numbers import Numbers
from .params import Handoff, Load, Place, done_message, parse_done

# A child of vLLM's logger: its messages come out with vLLM's, in its format.
log = logging.getLogger("vllm.freight")

# The smallest host KV cache shared in place (32 MiB). Sharing lays shared memory under
# whole pages, so a page's other bytes go with it: an allocation of this size has pages
# of its own (glibc maps every allocation from 32 MiB on by itself, as tcmalloc and
# jemalloc do large ones), where a smaller one may sit beside others in the allocator's
# heap, whose writes meanwhile would be lost and whose bookkeeping peers could write.
SHARE_IN_PLACE_MIN_BYTES = 32 << 20

# Notifications that name a request this worker does not (yet) hold blocks for are kept
# this long: the decode side may be told before this side learns of the request.
EARLY_ACK_SECONDS = 600.0


@dataclass(frozen=True)
class Instance:
    """What a worker knows of its vLLM instance (``freight.vllm.connector`` reads it
    from vLLM's config), for its agent's name and the geometry both sides compare."""

    engine_id: str
    model: str
    block_size: int
    kv_heads: int
    head_size: int
    tensor_parallel: int = 1
    rank: int = 0
    # Blocks vLLM allocated (its KV cache config), where known: checked against the
    # tensors' first dimension.
    num_blocks: Optional[int] = None


class WorkerSide:
    """A worker's KV data path, without vLLM: the KV cache tensors registered with a
    freight agent, the reads of a decode worker and the leases of a prefill worker.
    :class:`freight.vllm.FreightConnector` calls it from vLLM's hooks."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.agent: Optional[freight.Agent] = None
        self.layers: List[LayerBlocks] = []
        self.kind = "DRAM"
        self.device = 0
        self.geometry: Optional[Geometry] = None
        self.rank = 0
        # Decode side: posted READs, by request id: (request, local blocks, posted at).
        self.reading: Dict[str, Tuple[Any, List[int], float]] = {}
        self.read_done: Set[str] = set()
        self.load_errors: Set[int] = set()
        self.peers: Dict[str, str] = {}  # prefill agent address -> its peer name here
        self.remote: Dict[Any, Any] = {}  # prepared blocks of prefill workers
        self.num_blocks = 0
        self.all_blocks: Any = None
        # Prefill side: requests whose blocks wait for a decode instance, and until when.
        self.holding: Dict[str, float] = {}
        self.acked: Dict[str, float] = {}
        # Whether this step's metadata was taken (vLLM calls start_load, then finished).
        self.step_taken = False
        self.stats = Numbers()
        # Shared segments laid under a host KV cache (kept while the agent lives).
        self.shared: List[Any] = []

    # ------------------------------------------------------------------ start

    def register_kv_caches(self, kv_caches: Dict[str, Any], instance: Instance) -> None:
        """Registers every layer's KV cache tensor (vLLM's ``register_kv_caches``), once."""
        self.rank = instance.rank
        tensors = list(kv_caches.items())
        if not tensors:
            raise freight.InvalidArgumentError("FreightConnector: vLLM registered no KV cache")
        first = tensors[0][1]
        self.kind = "VRAM" if first.device.type == "cuda" else "DRAM"
        self.device = (first.device.index or 0) if self.kind == "VRAM" else 0
        self.layers = [layer_blocks(name, t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.element_size(),
                                    instance.num_blocks) for name, t in tensors]
        self.geometry = self._geometry(first, instance)
        name = f"vllm-{instance.engine_id}-tp{self.rank}-{os.getpid()}"
        if not self.settings.token:
            log.warning("freight connector: no token (FREIGHT_VLLM_TOKEN or kv_connector_extra_config.token): any "
                        "process that reaches %s can read and write this instance's KV cache",
                        self.settings.listen)
        self.agent = freight.Agent(name, self.agent_config())
        spans = regions(self.layers)
        if self.kind == "DRAM" and self.settings.share_host_memory:
            small = [span for span in spans if span[1] < SHARE_IN_PLACE_MIN_BYTES]
            large = [span for span in spans if span[1] >= SHARE_IN_PLACE_MIN_BYTES]
            if small:
                log.warning("freight connector: %d KV cache region(s) of under %d MiB (the first at %#x, %d bytes) "
                            "stay private memory, so same-host instances read them over tcp, not shm: an "
                            "allocation that small may share its pages with others, which cannot be shared safely",
                            len(small), SHARE_IN_PLACE_MIN_BYTES >> 20, small[0][0], small[0][1])
            for start, length in page_spans(large, mmap.PAGESIZE):
                self._share(start, length)
        for start, length in spans:
            self.agent.register((start, length, self.device), kind=self.kind)
        # Every block of every layer, checked once: a load then picks its blocks by
        # index, with no descriptor made or checked again.
        if len({l.num_blocks for l in self.layers}) != 1:
            raise freight.InvalidArgumentError("FreightConnector: the KV cache's layers have different block counts")
        self.num_blocks = self.layers[0].num_blocks
        self.all_blocks = self.agent.prepare_local(
            every_block(self.layers, self.device, self.kind))
        log.info("freight connector: worker %d registered %d KV layers (%d blocks of %d bytes each) on %s, "
                 "listening on %s", self.rank, len(self.layers), self.layers[0].num_blocks,
                 self.layers[0].block_bytes, self.kind, ", ".join(self.agent.addresses))

    def agent_config(self) -> AgentConfig:
        """The settings as the worker's agent takes them."""
        token = self.settings.token.encode() if self.settings.token else None
        # Inline: every shm copy on the posting thread, whatever its size.
        return AgentConfig(listen=self.settings.listen, token=token, connect_timeout=self.settings.connect_timeout,
                           shm_inline_bytes=1 << 62 if self.settings.copies_inline else None)

    def _share(self, start: int, length: int) -> None:
        """Lays shared memory under a host KV cache, in place (vLLM allocates it as
        private memory, which same-host peers reach only over tcp): done once, before
        the first forward pass writes it."""
        assert self.agent is not None
        try:
            self.shared.append(self.agent.share_in_place((start, length, 0)))
        except freight.FreightError as e:
            log.warning("freight connector: the KV cache at %#x (%d bytes) stays private memory, so same-host "
                        "instances read it over tcp, not shm: %s", start, length, e)

    def _geometry(self, first: Any, instance: Instance) -> Geometry:
        return Geometry(
            model=instance.model,
            dtype=str(first.dtype).replace("torch.", ""),
            block_size=instance.block_size,
            num_layers=len(self.layers),
            kv_heads=instance.kv_heads,
            head_size=instance.head_size,
            block_bytes=self.layers[0].block_bytes,
            block_shape=tuple(int(n) for n in first.shape[1:]),
            dim_order=dim_order(tuple(first.stride())),
            tensor_parallel=instance.tensor_parallel,
        )

    def handshake(self) -> Tuple[Place, Geometry]:
        """Where this worker's blocks are, and their geometry: what it tells the
        scheduler once (vLLM's handshake metadata), which hands it to decode instances
        in each request's params."""
        assert self.agent is not None and self.geometry is not None
        place = Place(agent_address=self.agent.addresses[0], agent_name=self.agent.name,
                      layer_bases=[l.base for l in self.layers], layer_strides=[l.stride for l in self.layers],
                      num_blocks=self.num_blocks)
        return place, self.geometry

    # ------------------------------------------------------------- each step

    def start_load(self, loads: Mapping[str, Load], sends: Mapping[str, float]) -> None:
        """Takes one step's instructions from the scheduler: requests to load (decode)
        and requests whose blocks to hold for a decode instance, for how many seconds
        at most (prefill). Once a step: ``finished`` takes them where vLLM did not
        call this first."""
        if self.step_taken:
            return
        self.step_taken = True
        now = time.monotonic()
        for request_id, lease in sends.items():
            log.debug("freight connector: holding request %s's blocks for a decode instance, %.0f s at most",
                      request_id, lease)
            self.holding[request_id] = now + lease
        for request_id, load in loads.items():
            try:
                handoff = Handoff.from_params(load.params)
                if load.awaited:
                    self._read(request_id, load.local_blocks, handoff)
                else:
                    self._release(handoff)
            except Exception as e:  # every failure of a load is the request's, never the worker's
                if isinstance(e, freight.PeerDisconnectedError):
                    self._forget(e.peer)
                if not load.awaited:
                    log.warning("freight connector: cannot tell the prefill instance to free request %s's blocks "
                                "(it frees them after its lease): %s", request_id, e)
                    continue
                log.error("freight connector: request %s cannot load its KV from the prefill instance: %s",
                          request_id, e)
                self.load_errors.update(load.local_blocks)
                self.read_done.add(request_id)
                self.stats.record_failure()

    def _read(self, request_id: str, local: List[int], handoff: Handoff) -> None:
        assert self.agent is not None and self.geometry is not None
        wrong = mismatches(handoff.geometry, self.geometry)
        if wrong:
            raise freight.InvalidArgumentError(
                "the prefill instance's KV cache does not match this one's (" + "; ".join(wrong) + ")"
            )
        if self.rank >= len(handoff.ranks):
            raise freight.InvalidArgumentError(
                f"the prefill instance has {len(handoff.ranks)} worker(s), none of this one's rank {self.rank}")
        place = handoff.ranks[self.rank]
        peer = self._peer(place)
        if len(handoff.block_ids) < len(local):
            raise freight.InvalidArgumentError(
                f"the prefill instance holds {len(handoff.block_ids)} blocks, this instance needs {len(local)}")
        remote_ids = handoff.block_ids[len(handoff.block_ids) - len(local):]
        # One READ of every layer's blocks, picked by index out of lists prepared once
        # (every block of both sides): no descriptor list is built per load.
        layers = len(self.layers)
        request = self.agent.make_request(
            "READ", self.all_blocks, block_indices(layers, self.num_blocks, local),
            self.remote_blocks(place, peer), block_indices(layers, place.num_blocks, remote_ids),
            notif=done_message(handoff.request_id))
        request.post()
        self.reading[request_id] = (request, local, time.monotonic())

    def remote_blocks(self, place: Place, peer: str) -> Any:
        """Every block of every layer of a prefill worker, prepared once (checked against
        the memory it advertised)."""
        assert self.agent is not None
        key = (peer, tuple(place.layer_bases), tuple(place.layer_strides), place.num_blocks)
        known = self.remote.get(key)
        if known is None:
            layers = [LayerBlocks(l.name, base, stride, l.block_bytes, place.num_blocks)
                      for l, base, stride in zip(self.layers, place.layer_bases, place.layer_strides)]
            known = self.agent.prepare_remote(peer, every_block(layers, self.device, self.kind))
            self.remote[key] = known
        return known

    def _release(self, handoff: Handoff) -> None:
        """Tells the prefill worker of this rank that its blocks are not wanted."""
        assert self.agent is not None
        if self.rank < len(handoff.ranks):
            self.agent.notify(self._peer(handoff.ranks[self.rank]), done_message(handoff.request_id))

    def _peer(self, place: Place) -> str:
        assert self.agent is not None
        known = self.peers.get(place.agent_address)
        if known is not None:
            return known
        token = self.settings.token.encode() if self.settings.token else None
        started = time.monotonic()
        name = self.agent.connect(place.agent_address, token)
        if name != place.agent_name:
            raise freight.InvalidArgumentError(
                f"{place.agent_address} is agent {name!r}, not the prefill worker {place.agent_name!r}")
        took = time.monotonic() - started
        self.stats.record_handshake(took)
        path = self.agent.path_to(name)
        log.info("freight connector: connected to prefill worker %s at %s in %.1f ms; transport %s (%s)",
                 name, place.agent_address, took * 1e3, path.transport, path.reason)
        self.peers[place.agent_address] = name
        return name

    def _forget(self, name: str) -> None:
        """Drops a prefill worker whose connection broke: a worker restarted at the same
        address is connected to afresh by the next load that names it."""
        assert self.agent is not None
        for address in [a for a, n in self.peers.items() if n == name]:
            del self.peers[address]
        for key in [k for k in self.remote if k[0] == name]:
            del self.remote[key]
        try:
            self.agent.remove_peer(name)
        except freight.UnknownPeerError:
            pass
        log.info("freight connector: forgot prefill worker %s (its connection broke)", name)

    def finished(self, loads: Optional[Mapping[str, Load]] = None,
                 sends: Optional[Mapping[str, float]] = None) -> Tuple[Set[str], Set[str]]:
        """The end of a step (with its instructions, where vLLM has them): the
        requests whose blocks were sent (may be freed here) and those received since
        the last step."""
        if loads is not None or sends is not None:
            self.start_load(loads or {}, sends or {})
        self.step_taken = False
        return self._sent(), self._received()

    def _received(self) -> Set[str]:
        done, self.read_done = self.read_done, set()
        now = time.monotonic()
        for request_id, (request, local, posted) in list(self.reading.items()):
            status = request.status()
            if status == "PENDING":
                continue
            del self.reading[request_id]
            if status == "ERROR":
                log.error("freight connector: reading request %s's KV failed: %s", request_id, request.error)
                if isinstance(request.error, freight.PeerDisconnectedError):
                    self._forget(request.peer)
                self.load_errors.update(local)
                self.stats.record_failure()
            else:
                # The engine's own clock: posted to done, not to this step's look.
                took = request.duration
                self.stats.record_transfer(took if took is not None else now - posted, request.nbytes)
            done.add(request_id)
        return done

    def _sent(self) -> Set[str]:
        assert self.agent is not None
        now = time.monotonic()
        for _peer, msg in self.agent.get_notifs():
            request_id = parse_done(msg)
            if request_id is not None:
                self.acked[request_id] = now
        done = set()
        for request_id, until in list(self.holding.items()):
            if request_id in self.acked:
                del self.acked[request_id]
            elif now > until:
                log.warning("freight connector: no decode instance read request %s's KV within %.0f s; freeing "
                            "its blocks", request_id, self.settings.lease_seconds)
            else:
                continue
            del self.holding[request_id]
            done.add(request_id)
        for request_id, at in list(self.acked.items()):
            if now - at > EARLY_ACK_SECONDS:
                del self.acked[request_id]
        return done

    def take_stats(self) -> Optional[Numbers]:
        """What was recorded since the last call (None: nothing)."""
        if self.stats.is_empty():
            return None
        taken, self.stats = self.stats, Numbers()
        return taken

    def take_load_errors(self) -> Set[int]:
        errors, self.load_errors = self.load_errors, set()
        return errors

    def close(self) -> None:
        if self.agent is not None:
            self.agent.close()
            self.agent = None
        self.shared.clear()
