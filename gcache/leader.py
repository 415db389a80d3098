"""Finding the meta leader: ``etcd://`` addresses, the leader record, and the
meta address lists servers and clients follow (docs/architecture.md, "High
availability").

A meta address is either ``H:P[,H:P...]`` (one or more metas, tried in order) or
``etcd://HOST:PORT[,HOST:PORT]/PREFIX``: the leader's record, JSON under
``PREFIX/leader``, names its hot-path and gRPC addresses. A standby answers with
``not the leader; leader hot=H:P grpc=H:P`` (:func:`redirect_text`), which
:func:`parse_redirect` reads back."""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from typing import Any

from gcache.errors import ConfigError, GCacheError

ETCD_SCHEME = "etcd://"
NOT_LEADER = "not the leader"


@dataclass(frozen=True)
class EtcdTarget:
    """Where the election lives: etcd endpoints and the key prefix."""

    endpoints: tuple[tuple[str, int], ...]
    prefix: str

    @property
    def leader_key(self) -> bytes:
        return f"{self.prefix}/leader".encode()

    @property
    def epoch_key(self) -> bytes:
        return f"{self.prefix}/epoch".encode()

    def url(self) -> str:
        hosts = ",".join(f"{h}:{p}" for h, p in self.endpoints)
        return f"{ETCD_SCHEME}{hosts}{self.prefix}"


def is_etcd(addr: str) -> bool:
    return addr.startswith(ETCD_SCHEME)


def _hostport(where: str, text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ConfigError(f"{where}: {text!r} is not host:port with a port in 1..65535")
    return host, int(port)


def parse_etcd(where: str, url: str) -> EtcdTarget:
    """``etcd://HOST:PORT[,HOST:PORT]/PREFIX`` -> :class:`EtcdTarget`; a bad one
    raises :class:`ConfigError` naming ``where`` (the setting)."""
    if not is_etcd(url):
        raise ConfigError(f"{where} must look like etcd://HOST:PORT/PREFIX, got {url!r}")
    rest = url[len(ETCD_SCHEME) :]
    hosts, slash, prefix = rest.partition("/")
    prefix = "/" + prefix.rstrip("/")
    if not slash or prefix == "/" or not re.fullmatch(r"[\w./-]+", prefix):
        raise ConfigError(
            f"{where} needs a key prefix of letters, digits, '_', '-', '.' and '/' "
            f"(etcd://HOST:PORT/PREFIX), got {url!r}"
        )
    if not hosts:
        raise ConfigError(f"{where} names no etcd endpoint, got {url!r}")
    endpoints = tuple(_hostport(where, h) for h in hosts.split(","))
    return EtcdTarget(endpoints, prefix)


def parse_meta_list(where: str, text: str) -> list[str]:
    """``H:P[,H:P...]`` -> the addresses, each checked."""
    out = [a.strip() for a in text.split(",")]
    for a in out:
        _hostport(where, a)
    return out


def check_meta(where: str, text: str) -> None:
    """A meta address setting: a list of host:port or an etcd:// URL."""
    if is_etcd(text):
        parse_etcd(where, text)
    else:
        parse_meta_list(where, text)


@dataclass(frozen=True)
class LeaderRecord:
    """``PREFIX/leader``: the leader's identity, addresses and epoch."""

    id: str
    hot: str
    grpc: str
    metrics: str
    epoch: int

    def encode(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def decode(cls, raw: bytes) -> LeaderRecord | None:
        try:
            d = json.loads(raw)
            return cls(
                str(d["id"]), str(d["hot"]), str(d["grpc"]), str(d["metrics"]), int(d["epoch"])
            )
        except (ValueError, KeyError, TypeError):
            return None


def redirect_text(leader: LeaderRecord | None) -> str:
    """What a standby answers instead of data."""
    if leader is None:
        return f"{NOT_LEADER}; no leader yet"
    return f"{NOT_LEADER}; leader hot={leader.hot} grpc={leader.grpc}"


_REDIRECT = re.compile(r"leader hot=(\S+) grpc=(\S+)")


def parse_redirect(text: str) -> tuple[str, str] | None:
    """(hot, grpc) of the leader a standby's refusal names, or None."""
    m = _REDIRECT.search(text)
    return (m.group(1), m.group(2)) if m else None


async def read_leader(target: EtcdTarget, timeout_s: float = 1.0) -> LeaderRecord | None:
    """The current leader record in etcd (None: no leader now). Tries each
    endpoint; raises :class:`GCacheError` when none answers."""
    import aetcd  # imported here: only HA deployments need it

    last: Exception | None = None
    for host, port in target.endpoints:
        client = aetcd.Client(host, port, timeout=timeout_s)
        try:
            got: Any = await client.get(target.leader_key)
            return None if got is None else LeaderRecord.decode(got.value)
        except Exception as exc:  # aetcd raises its own and grpc's errors
            last = exc
        finally:
            try:
                await client.close()
            except Exception:  # closing a channel that never connected
                pass
    raise GCacheError(f"no etcd endpoint of {target.url()} answers: {last}") from last


class MetaFinder:
    """Which meta to talk to: the one a setting names, the next of a list, the
    one a standby's redirect names, or the leader etcd names. ``meta``: a list of
    addresses or an etcd:// URL; ``meta_grpc``: the gRPC addresses index-aligned
    with ``meta`` (clients; servers give only gRPC addresses in ``meta``)."""

    def __init__(self, meta: str, meta_grpc: str = "") -> None:
        self.target = parse_etcd("meta", meta) if is_etcd(meta) else None
        self.candidates: list[tuple[str, str]] = []
        if self.target is None:
            hots = parse_meta_list("meta", meta)
            grpcs = parse_meta_list("meta_grpc", meta_grpc) if meta_grpc else hots
            if not meta_grpc:
                hots = [""] * len(grpcs)
            self.candidates = list(zip(hots, grpcs, strict=False))
        self.index = 0
        self.hint: tuple[str, str] | None = None
        self.resolutions = 0

    @property
    def several(self) -> bool:
        """More than one meta may lead (etcd, or a list): worth following."""
        return self.target is not None or len(self.candidates) > 1

    async def find(self, timeout_s: float = 1.0) -> tuple[str, str] | None:
        """(hot, grpc) of the meta to try now; None: etcd names no leader (or
        cannot be read) at the moment."""
        self.resolutions += 1
        if self.hint is not None:
            hint, self.hint = self.hint, None
            return hint
        if self.target is not None:
            try:
                rec = await read_leader(self.target, timeout_s)
            except GCacheError:
                return None
            return None if rec is None else (rec.hot, rec.grpc)
        return self.candidates[self.index % len(self.candidates)]

    def failed(self, refusal: str = "") -> None:
        """The meta tried last did not serve; ``refusal``: its answer, which may
        name the leader."""
        to = parse_redirect(refusal) if refusal else None
        if to is not None:
            self.hint = to
        elif self.target is None:
            self.index += 1
