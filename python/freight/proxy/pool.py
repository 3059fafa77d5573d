"""Which instance of a role gets the next request: the instances, how many requests
each has in flight, and whether each is alive.

No sockets, no clock, no tasks: the server (server.py) tells a :class:`Pool` what it
saw (a request started or ended, a health check answered or failed, a connection
refused) and asks it whom to send to. Tests drive it directly.

Invariants (checked by :meth:`Pool.check`):

- an instance's ``in_flight`` is the number of :meth:`Pool.acquire` calls for it not
  yet matched by :meth:`Pool.release`, never negative;
- :meth:`Pool.pick` returns only alive instances; among them the one with the fewest
  requests in flight, ties going round the instances in turn;
- an instance goes down after ``fails_to_down`` failed health checks in a row, or at
  once when a connection to it is refused or breaks; it comes back on the first
  health check it answers;
- ``silent`` only on a down instance whose last failure was a health check that went
  unanswered (not a refused or broken connection, not an error status).

When no instance of a role is alive, :meth:`Pool.pick` falls back to the silent ones:
an overloaded server answers its health checks late, and failing every request for it
would turn a slow moment into an outage. A request sent there that cannot connect takes
the instance out for good (``connection_failed``), as for any instance.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence


@dataclass
class Instance:
    """One upstream server of a role."""

    url: str
    role: str
    alive: bool = True
    in_flight: int = 0
    failed_checks: int = 0
    # Why the instance is down (or was last seen failing), for 503s and /health.
    reason: Optional[str] = None
    served: int = 0
    # Down only because its health checks went unanswered: busy, perhaps, not dead.
    silent: bool = False


class NoInstance(Exception):
    """No instance of a role is alive; the message names each one and why it is down."""


@dataclass
class Pool:
    role: str
    instances: List[Instance]
    fails_to_down: int = 2
    _turn: int = field(default=0, repr=False)

    @classmethod
    def of(cls, role: str, urls: Sequence[str], fails_to_down: int = 2) -> "Pool":
        if not urls:
            raise ValueError(f"no {role} instance given")
        if fails_to_down < 1:
            raise ValueError(f"fails_to_down must be at least 1, not {fails_to_down}")
        seen = set()
        for url in urls:
            if url in seen:
                raise ValueError(f"{role} instance {url} given twice")
            seen.add(url)
        return cls(role, [Instance(url, role) for url in urls], fails_to_down)

    def alive(self) -> List[Instance]:
        return [i for i in self.instances if i.alive]

    def pick(self, exclude: Sequence[Instance] = ()) -> Instance:
        """The alive instance (not in ``exclude``) with the fewest requests in flight;
        with none alive, the silent one with the fewest (a last resort: the caller can
        tell by ``alive`` being false). Raises :class:`NoInstance` when there is none."""
        best = self._least_loaded(lambda i: i.alive, exclude) or self._least_loaded(lambda i: i.silent, exclude)
        if best is None:
            raise NoInstance(self.why_none(exclude))
        self._turn = (self.instances.index(best) + 1) % len(self.instances)
        return best

    def _least_loaded(self, usable: Callable[[Instance], bool], exclude: Sequence[Instance]) -> Optional[Instance]:
        n = len(self.instances)
        best: Optional[Instance] = None
        for k in range(n):
            inst = self.instances[(self._turn + k) % n]
            if not usable(inst) or any(inst is e for e in exclude):
                continue
            if best is None or inst.in_flight < best.in_flight:
                best = inst
        return best

    def why_none(self, tried: Sequence[Instance] = ()) -> str:
        parts = []
        for inst in self.instances:
            if any(inst is t for t in tried) and (inst.alive or inst.silent):
                parts.append(f"{inst.url}: failed this request ({inst.reason or 'no reason given'})")
            else:
                parts.append(f"{inst.url}: {inst.reason or 'down'}")
        return f"no {self.role} instance is alive (" + "; ".join(parts) + ")"

    def acquire(self, inst: Instance) -> None:
        inst.in_flight += 1

    def release(self, inst: Instance) -> None:
        if inst.in_flight <= 0:
            raise AssertionError(f"{inst.url}: released more requests than it was given")
        inst.in_flight -= 1
        inst.served += 1

    def connection_failed(self, inst: Instance, reason: str) -> None:
        """A connection to ``inst`` was refused or broke: down until a health check
        answers."""
        inst.alive = False
        inst.silent = False
        inst.reason = reason

    def check_failed(self, inst: Instance, reason: str, unanswered: bool = False) -> bool:
        """A health check failed: ``unanswered`` when it got no answer in time, else it
        was refused an error status. Returns whether this took the instance down."""
        inst.failed_checks += 1
        inst.reason = reason
        took_down = inst.alive and inst.failed_checks >= self.fails_to_down
        if took_down:
            inst.alive = False
        inst.silent = not inst.alive and unanswered
        return took_down

    def check_passed(self, inst: Instance) -> bool:
        """A health check answered. Returns whether this brought the instance back."""
        inst.failed_checks = 0
        came_back = not inst.alive
        inst.alive = True
        inst.silent = False
        inst.reason = None
        return came_back

    def state(self) -> Dict[str, Dict[str, object]]:
        return {i.url: {"alive": i.alive, "silent": i.silent, "in_flight": i.in_flight, "served": i.served,
                        "reason": i.reason} for i in self.instances}

    def check(self) -> None:
        for inst in self.instances:
            assert inst.in_flight >= 0, inst
            assert inst.role == self.role, inst
            assert inst.alive or inst.reason, f"{inst.url} is down without a reason"
            assert not (inst.alive and inst.silent), f"{inst.url} is alive and silent"
