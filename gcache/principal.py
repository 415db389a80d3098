"""Who a request acts for: a tenant (:class:`Principal`). Shared by the meta (which
enforces namespaces and quotas), :mod:`gcache.auth` (which maps tokens to
principals) and the tools; no I/O."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Principal:
    """A tenant. ``namespaces``: prefixes of the ``cache_salt`` of namespaces it may
    read and write (``("",)``: all). ``quota_bytes``: bytes it may hold, committed
    plus reserved by its pending puts (0: no quota)."""

    name: str
    namespaces: tuple[str, ...] = ("",)
    quota_bytes: int = 0
    admin: bool = False

    def may_use(self, cache_salt: str) -> bool:
        return any(cache_salt.startswith(p) for p in self.namespaces)


ANONYMOUS = Principal("anonymous", ("",), 0, admin=True)
