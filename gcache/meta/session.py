"""Who is asking: the identity every hot-path request carries into :class:`MetaCore`.

A :class:`Session` is one hot-path connection. Puts and leases belong to the
session that created them: only it may commit, abort or release them, and when the
connection ends its pending puts are aborted and its leases released. The
:class:`Principal` is the tenant the session authenticated as (``Hello`` with an
access token), or :data:`ANONYMOUS` when the meta runs without tenant tokens.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from gcache.principal import ANONYMOUS, Principal

__all__ = ["ANONYMOUS", "LOCAL", "Principal", "Session"]

_SESSION_IDS = itertools.count(1)


@dataclass(slots=True, eq=False)
class Session:
    """One hot-path connection (or one in-process driver)."""

    peer: str = "local"
    principal: Principal = ANONYMOUS
    authenticated: bool = False
    sid: int = field(default_factory=lambda: next(_SESSION_IDS))
    # Ids of the puts and leases this session owns (kept by MetaCore).
    puts: set[int] = field(default_factory=set)
    leases: set[int] = field(default_factory=set)

    def __repr__(self) -> str:
        return f"Session({self.sid}, {self.peer}, {self.principal.name})"


LOCAL = Session("in-process")
