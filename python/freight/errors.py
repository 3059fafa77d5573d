"""Exceptions raised by freight.

Every error of the engine maps to exactly one class here (the mapping is done in the
native module, see ``crates/freight-py/src/errors.rs``). All derive from
:class:`FreightError`; several also derive from the matching built-in exception so that
generic handlers work (``except KeyError`` catches an unknown peer, ``except
TimeoutError`` a freight timeout, ``except ConnectionError`` a dead peer, ...).

Some exceptions carry structured attributes next to the message:

=========================  ==================================================
NotRegisteredError         kind, addr, length, device
OutOfBoundsError           addr, length, region_addr, region_length
OverlapError               addr, length, existing (key of the region hit)
RegionBusyError            key, users (in-flight transfers using it)
UnknownRegionError         key
UnknownPeerError           peer
RemoteRejectedError        peer, reason
PeerDisconnectedError      peer, reason
=========================  ==================================================

``Agent.register_many`` additionally sets ``index`` (the failing object) on its error.
"""

from __future__ import annotations

import builtins

__all__ = [
    "FreightError",
    "InvalidArgumentError",
    "NotRegisteredError",
    "OutOfBoundsError",
    "OverlapError",
    "RegionBusyError",
    "UnknownRegionError",
    "UnknownPeerError",
    "TransportUnavailableError",
    "MetadataError",
    "ProtocolError",
    "AuthError",
    "RemoteRejectedError",
    "PeerDisconnectedError",
    "TimeoutError",
    "InvalidStateError",
    "IoError",
    "NoSpaceError",
    "EtcdError",
    "CudaError",
]


class FreightError(Exception):
    """Base class of every error raised by freight."""

    def __str__(self) -> str:
        # KeyError (a base of some subclasses) would quote the message; we never want that.
        if len(self.args) == 1:
            return str(self.args[0])
        return super().__str__()


class InvalidArgumentError(FreightError, ValueError):
    """A malformed argument: wrong lengths or totals, bad indices, zero sizes, unknown
    kind/op/transport names, read-only buffers..."""


class NotRegisteredError(FreightError):
    """A descriptor names memory that is not inside any registered region (locally, or
    in the peer's advertised regions)."""


class OutOfBoundsError(FreightError):
    """A descriptor starts inside a registered region but runs past its end."""


class OverlapError(FreightError):
    """A new registration overlaps an existing one."""


class RegionBusyError(FreightError):
    """Deregistration of memory that an in-flight transfer uses; wait for it first."""


class UnknownRegionError(FreightError, KeyError):
    """A region key that is not (or no longer) registered."""


class UnknownPeerError(FreightError, KeyError):
    """A peer name that was never added (or was removed)."""


class TransportUnavailableError(FreightError):
    """No enabled transport can serve the path, or the required one cannot (e.g.
    ``require="shm"`` with remote memory outside shared segments)."""


class MetadataError(FreightError, ValueError):
    """Metadata bytes that do not decode, come from another format version, or are
    inconsistent."""


class ProtocolError(FreightError):
    """A peer sent something that violates the wire protocol."""


class AuthError(FreightError, PermissionError):
    """A connection presented a wrong secret or metadata token."""


class RemoteRejectedError(FreightError):
    """The remote agent refused an access (unregistered, out of bounds, revoked)."""

    #: The peer that refused, and why (set by the engine).
    peer: str
    reason: str


class PeerDisconnectedError(FreightError, ConnectionError):
    """The peer went away or stopped answering within ``peer_timeout``. Add it again
    (with fresh metadata) to reconnect."""

    #: The peer's name, and why it is considered gone (set by the engine).
    peer: str
    reason: str


class TimeoutError(FreightError, builtins.TimeoutError):  # noqa: A001 (shadows the builtin on purpose)
    """An operation did not finish in time (``Request.wait(timeout)``, etcd waits,
    connecting). Also an instance of the built-in ``TimeoutError``."""


class InvalidStateError(FreightError):
    """The object cannot do that now: a request posted while pending or never posted, a
    closed agent or directory, memory deregistered under a prepared request..."""


class IoError(FreightError, OSError):
    """An operating-system error (sockets, memfd, mmap)."""


class NoSpaceError(FreightError, MemoryError):
    """A pool, store or buffer has no room left for what was asked of it (a receiver's
    store at its capacity, say); nothing already stored is lost."""


class EtcdError(FreightError):
    """etcd could not be reached or refused an operation."""


class CudaError(FreightError, RuntimeError):
    """A CUDA driver or NVRTC call failed; the message names the call and its error code."""
