"""Metadata exchange of the NIXL face: with one peer's listener (socket) or through etcd.

NIXL queues these calls to a thread and returns at once; so does this module: one worker
thread per agent runs them in the order they were made (a push, then an invalidation,
arrive in that order). A job that fails is logged with its reason; a fetch that fails
leaves the peer unknown (``check_remote_metadata`` stays False).

etcd is used when ``NIXL_ETCD_ENDPOINTS`` is set (NIXL's variable) and the call names no
peer address: entries live under ``NIXL_ETCD_NAMESPACE`` (default ``/nixl/agents/``), an
agent's full metadata under its name and partial metadata sent with a label under
``labels/<label>/<name>``; they vanish with the process (a lease).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from typing import Callable, Dict, Optional

from .._native import EtcdDirectory
from . import _side_channel

log = logging.getLogger("freight.nixl")

#: How long a push or fetch keeps trying a listener that refuses connections (it may
#: not have started yet).
RETRY_SECONDS = 10.0


def etcd_endpoints() -> str:
    return os.environ.get("NIXL_ETCD_ENDPOINTS", "")


class Exchange:
    """The agent's metadata traffic: a worker thread and, where wanted, etcd."""

    def __init__(self, name: str, token: Optional[bytes], load: Callable[[bytes], object],
                 watch_timeout: float) -> None:
        self._name = name
        self._token = token
        self._load = load
        self._watch_timeout = watch_timeout
        self._jobs: "queue.Queue[Optional[Callable[[], None]]]" = queue.Queue()
        self._dirs: Dict[str, EtcdDirectory] = {}
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        self._closed = False

    # ------------------------------------------------------------------ etcd

    def directory(self, label: str = "") -> EtcdDirectory:
        """The etcd directory for full metadata (label "") or for one label's."""

        endpoints = etcd_endpoints()
        ns = os.environ.get("NIXL_ETCD_NAMESPACE", "/nixl/agents/")
        if not ns.endswith("/"):
            ns += "/"
        with self._lock:
            d = self._dirs.get(label)
            if d is None:
                prefix = ns if not label else f"{ns}labels/{label}/"
                d = EtcdDirectory(endpoints, prefix=prefix)
                self._dirs[label] = d
            return d

    # ------------------------------------------------------------------ jobs

    def submit(self, what: str, job: Callable[[], None]) -> None:
        """Runs ``job`` on the worker thread after the jobs before it."""
        if self._closed:
            raise RuntimeError("the agent's metadata exchange is closed")

        def run() -> None:
            try:
                job()
            except Exception as e:  # logged, as NIXL's listener thread does
                log.error("nixl agent %s: %s failed: %s", self._name, what, e)

        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name=f"nixl-md-{self._name}", daemon=True)
                self._thread.start()
        self._jobs.put(run)

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            job()

    def close(self) -> None:
        self._closed = True
        with self._lock:
            thread, self._thread = self._thread, None
            dirs, self._dirs = list(self._dirs.values()), {}
        if thread is not None:
            self._jobs.put(None)
            thread.join(timeout=RETRY_SECONDS + 5)
        for d in dirs:
            try:
                d.close()
            except Exception as e:
                log.debug("closing an etcd directory: %s", e)

    # ------------------------------------------------------------------ the calls

    def push(self, ip: str, port: int, blob: bytes) -> None:
        self.submit(f"sending metadata to {ip}:{port}",
                    lambda: _retrying(lambda: _side_channel.push(ip, port, blob, token=self._token, timeout=5.0)))

    def fetch(self, remote: str, ip: str, port: int, label: str) -> None:
        def job() -> None:
            blob = _retrying(lambda: _side_channel.fetch(ip, port, label or None, token=self._token, timeout=5.0))
            self._load_named(remote, blob)

        self.submit(f"fetching {remote}'s metadata from {ip}:{port}", job)

    def invalidate(self, ip: str, port: int) -> None:
        self.submit(f"invalidating metadata at {ip}:{port}",
                    lambda: _side_channel.invalidate(ip, port, self._name, token=self._token, timeout=5.0))

    def publish(self, blob: bytes, label: str = "") -> None:
        self.submit("publishing metadata in etcd", lambda: self.directory(label).publish(self._name, blob))

    def fetch_etcd(self, remote: str, label: str) -> None:
        def job() -> None:
            blob = self.directory(label).wait_for(remote, self._watch_timeout)
            self._load_named(remote, blob)

        self.submit(f"fetching {remote}'s metadata from etcd", job)

    def withdraw(self) -> None:
        def job() -> None:
            with self._lock:
                labels = list(self._dirs)
            for label in labels or [""]:
                self.directory(label).withdraw(self._name)

        self.submit("withdrawing metadata from etcd", job)

    def _load_named(self, remote: str, blob: bytes) -> None:
        name = self._load(blob)
        if isinstance(name, bytes):
            name = name.decode(errors="replace")
        if name != remote:
            log.warning("nixl agent %s: asked for %s's metadata, got %s's (loaded)", self._name, remote, name)


def _retrying(call: Callable[[], object]):
    """``call()``, again while the listener refuses connections, for up to RETRY_SECONDS."""
    deadline = time.monotonic() + RETRY_SECONDS
    while True:
        try:
            return call()
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
