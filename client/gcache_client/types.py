"""Plain value types the client hands to engines."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gcache import wire
from gcache.layout import Layout

# (K, V) of one layer: numpy arrays or torch tensors, [tokens, kv_heads, head_dim].
KVPair = tuple[Any, Any]


@dataclass(frozen=True)
class Namespace:
    fingerprint: bytes
    model: str
    layout: Layout
    # The RegisterNamespace request, replayed if a restarted meta forgot it.
    request: Any = field(default=None, repr=False, compare=False)

    def __repr__(self) -> str:
        return f"Namespace({self.model!r}, {self.fingerprint.hex()[:12]}…)"


class Match:
    """A leased valid prefix: ``blocks``/``tokens`` matched and where the objects lie."""

    __slots__ = ("blocks", "lease_id", "namespace", "objects", "servers", "tokens")

    def __init__(
        self,
        namespace: Namespace,
        blocks: int,
        tokens: int,
        lease_id: int = 0,
        objects: list[wire.ObjectLoc] | None = None,
        servers: list[wire.ServerAddr] | None = None,
    ) -> None:
        self.namespace = namespace
        self.blocks = blocks
        self.tokens = tokens
        self.lease_id = lease_id
        self.objects = {(o.block, o.group): o for o in objects or ()}
        self.servers = servers or []

    def __repr__(self) -> str:
        return f"Match(tokens={self.tokens}, blocks={self.blocks}, lease={self.lease_id})"


@dataclass
class LayerKV:
    """One layer's KV for a match: rows ``[start, start + len(k))`` of the prompt."""

    layer: int
    start: int
    k: Any
    v: Any


@dataclass
class PutResult:
    blocks: int = 0
    stored: int = 0  # objects written and committed
    deduped: int = 0  # objects already in the store
    no_space: int = 0  # objects the store had no room for
    failed: int = 0  # objects whose write failed
    bytes_written: int = 0
    error: str = field(default="")

    @property
    def ok(self) -> bool:
        return not self.error and not self.failed
