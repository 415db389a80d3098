"""What every routing policy sees and returns. No I/O, no clock of its own.

A request is routed on the chained GCache block keys of its prompt
(:func:`gcache.keys.block_keys`, full blocks only), so the router, the meta's
index and the engines' KV events (re-keyed from their token ids) all speak the
same keys. Policies are plain synchronous objects: the router daemon and the
trace simulator (``gcache replay --router``) drive the very same classes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(slots=True)
class InstanceLoad:
    """Load of one engine instance, as last reported (or as simulated)."""

    queued: int = 0  # requests waiting
    running: int = 0  # requests in prefill or decode
    tokens_in_flight: int = 0  # prompt tokens still to prefill + tokens being decoded
    active_blocks: int = 0  # KV blocks held by running requests (Dynamo's decode load)


@dataclass(frozen=True, slots=True)
class RouteRequest:
    keys: Sequence[bytes]  # chained block keys of the prompt's full blocks
    tokens: int  # prompt length in tokens
    request_id: str = ""


@dataclass(frozen=True, slots=True)
class Decision:
    instance: str  # instance id chosen
    local_blocks: int  # window-safe blocks the instance holds itself
    pool_blocks: int  # further blocks the GCache pool can serve (window-safe)
    cost: float  # the policy's score of the choice (lower is better; 0 if n/a)
    reason: str  # one word: "affinity", "balance", "load", "round-robin", ...


class ClusterView(Protocol):
    """The router's knowledge of the fleet at one instant."""

    def live(self, now: float) -> Sequence[str]:
        """Ids of instances that reported recently, in a stable order."""
        ...

    def load(self, instance: str) -> InstanceLoad: ...

    def local_match(self, instance: str, keys: Sequence[bytes]) -> int:
        """Window-safe blocks of ``keys`` the instance holds in its own memory."""
        ...

    def pool_match(self, keys: Sequence[bytes]) -> int:
        """Window-safe blocks of ``keys`` the GCache pool holds."""
        ...


class Policy(Protocol):
    name: str

    def choose(self, req: RouteRequest, view: ClusterView, now: float) -> Decision:
        """Pick an instance among ``view.live(now)`` (non-empty: the caller checks)."""
        ...

    def routed(self, req: RouteRequest, decision: Decision, now: float) -> None:
        """Called after a request was sent where ``decision`` says: policies that
        learn only from their own routing (SGLang's approximate tree) update here."""
        ...
