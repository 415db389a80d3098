"""Typed settings. Defaults live here and only here.

Each component has one frozen dataclass. Values come, later winning, from the
defaults, a TOML config file (section ``[meta]``, ``[server]`` or ``[client]``),
environment variables (``GCACHE_META_PORT=7700``) and command-line flags
(``--port 7700``); flags are generated from the fields, so ``--help`` always lists
every setting with its default.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from gcache.errors import ConfigError

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


def parse_size(text: str | int) -> int:
    """``"64MiB"`` -> 67108864, ``"1GB"`` -> 10**9, ``4096`` -> 4096."""
    if isinstance(text, int):
        return text
    m = _SIZE.match(text)
    if not m:
        raise ConfigError(f"not a size: {text!r} (examples: 4096, 64MiB, 2GB)")
    digits, unit = m.group(1), (m.group(2) or "").lower()
    if "i" in unit:
        mult = 1 << (10 * "kmgt".index(unit[0]) + 10)
    else:
        mult = _UNITS[unit[:1]]
    if "." not in digits:
        return int(digits) * mult  # exact, even past 2**53
    return int(float(digits) * mult)


# Capabilities expire this long before the meta reuses their memory, so a clock
# step between meta and server cannot let a stale grant touch reused bytes.
GRANT_MARGIN_S = 1.0


def _doc(text: str, **kw: Any) -> Any:
    return field(metadata={"help": text}, **kw)


@dataclass(frozen=True)
class MetaConfig:
    host: str = _doc("address the hot path and gRPC listen on", default="127.0.0.1")
    port: int = _doc("hot-path (framed TCP) port; 0 picks a free one", default=7700)
    grpc_port: int = _doc("control-plane gRPC port; 0 picks a free one", default=7701)
    heartbeat_timeout_s: float = _doc("drop a server silent for this long", default=5.0)
    lease_ttl_s: float = _doc("read lease lifetime granted by Lookup", default=10.0)
    put_timeout_s: float = _doc("reclaim a begun, uncommitted put after this", default=30.0)
    high_watermark: float = _doc("start evicting above this fraction used", default=0.90)
    low_watermark: float = _doc("evict down to this fraction used", default=0.80)
    eviction_policy: str = _doc(
        "eviction policy: cost (recompute FLOPs x decaying reuse / bytes) or lru",
        default="lru",
    )
    checkpoint_interval: int = _doc(
        "tokens between SWA checkpoint positions the meta asks clients to save; 0: off",
        default=512,
    )
    max_keys_per_request: int = _doc("largest batch a request may carry", default=1 << 17)
    metrics_port: int = _doc("Prometheus /metrics HTTP port; -1 disables, 0 any free", default=7702)
    ready_file: str = _doc("write 'host port grpc_port metrics_port' here when up", default="")

    def check(self) -> None:
        if not 0 < self.low_watermark < self.high_watermark <= 1.0:
            raise ConfigError("need 0 < low_watermark < high_watermark <= 1")
        if self.eviction_policy not in ("lru", "cost"):
            raise ConfigError(f"unknown eviction policy {self.eviction_policy!r}")
        if self.checkpoint_interval < 0:
            raise ConfigError("checkpoint_interval must be >= 0")
        if self.lease_ttl_s <= 0 or self.put_timeout_s <= 0 or self.heartbeat_timeout_s <= 0:
            raise ConfigError("timeouts must be positive")
        if min(self.lease_ttl_s, self.put_timeout_s) <= GRANT_MARGIN_S:
            raise ConfigError(
                f"lease_ttl_s and put_timeout_s must exceed {GRANT_MARGIN_S} s: capabilities "
                "end that long before the lease or put does"
            )


@dataclass(frozen=True)
class ServerConfig:
    server_id: str = _doc("unique name; default host:port", default="")
    host: str = _doc("address the data plane listens on", default="127.0.0.1")
    port: int = _doc("data-plane port; 0 picks a free one", default=7800)
    meta: str = _doc("meta gRPC address host:port", default="127.0.0.1:7701")
    capacity: str = _doc("DRAM segment size (e.g. 1GiB)", default="1GiB")
    shm_dir: str = _doc("directory of the shared-memory segment file", default="/dev/shm")
    heartbeat_interval_s: float = _doc("heartbeat period", default=1.0)
    populate: bool = _doc(
        "pre-fault every page of the segment at start (first writes take no page faults)",
        default=True,
    )
    ready_file: str = _doc("write 'host port' here once registered", default="")

    @property
    def capacity_bytes(self) -> int:
        return parse_size(self.capacity)

    def check(self) -> None:
        if self.capacity_bytes < 1 << 20:
            raise ConfigError("capacity must be at least 1MiB")
        if ":" not in self.meta:
            raise ConfigError(f"meta must be host:port, got {self.meta!r}")


@dataclass(frozen=True)
class ClientConfig:
    meta: str = _doc("meta hot-path address host:port", default="127.0.0.1:7700")
    meta_grpc: str = _doc("meta gRPC address host:port", default="127.0.0.1:7701")
    timeout_s: float = _doc("per-operation timeout; a timeout is a miss", default=5.0)
    layers_in_flight: int = _doc("get_layers: layer reads kept in flight", default=8)
    max_inflight_writes: int = _doc("put: object writes in flight per server", default=8)
    transport: str = _doc(
        "data path: auto (shared memory when the server is local), tcp, shm", default="auto"
    )
    shm_populate: bool = _doc(
        "shm: map a server's whole segment at first use (copies take no page faults)",
        default=True,
    )

    def check(self) -> None:
        if self.layers_in_flight < 1 or self.max_inflight_writes < 1:
            raise ConfigError("in-flight limits must be >= 1")
        if self.transport not in ("auto", "tcp", "shm"):
            raise ConfigError(f"transport must be auto, tcp or shm, got {self.transport!r}")


C = TypeVar("C", MetaConfig, ServerConfig, ClientConfig)
_SECTIONS = {MetaConfig: "meta", ServerConfig: "server", ClientConfig: "client"}


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _convert(cls: type, name: str, raw: Any) -> Any:
    """Strict conversion: no silent truncation, no guessing at booleans."""
    kinds = {f.name: str(f.type) for f in dataclasses.fields(cls)}
    where = f"{_SECTIONS[cls]}.{name}"
    if name not in kinds:
        raise ConfigError(f"unknown setting {where}")
    kind = kinds[name]
    if kind == "bool":
        if isinstance(raw, bool):
            return raw
        text = str(raw).strip().lower()
        if text in _TRUE or text in _FALSE:
            return text in _TRUE
        raise ConfigError(f"{where}: expected a boolean (true/false), got {raw!r}")
    if isinstance(raw, bool) or (kind != "str" and not isinstance(raw, (str, int, float))):
        raise ConfigError(f"{where}: expected {kind}, got {raw!r}")
    if kind == "int" and isinstance(raw, float) and not raw.is_integer():
        raise ConfigError(f"{where}: expected an integer, got {raw!r}")
    try:
        return {"int": int, "float": float, "str": str}[kind](raw)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: expected {kind}, got {raw!r}") from exc


def load(
    cls: type[C],
    file: str | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> C:
    """Merge defaults < file < env < overrides into a checked ``cls``."""
    section = _SECTIONS[cls]
    names = {f.name for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {}
    if file:
        try:
            with open(file, "rb") as fh:
                data = tomllib.load(fh).get(section, {})
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot read config file {file}: {exc}") from exc
        for key, val in data.items():
            if key not in names:
                raise ConfigError(f"{file}: unknown setting [{section}] {key}")
            values[key] = _convert(cls, key, val)
    prefix = f"GCACHE_{section.upper()}_"
    for key, val in (os.environ if env is None else env).items():
        if key.startswith(prefix):
            name = key[len(prefix) :].lower()
            if name not in names:
                raise ConfigError(f"unknown environment setting {key}")
            values[name] = _convert(cls, name, val)
    for key, val in (overrides or {}).items():
        if val is not None:
            values[key] = _convert(cls, key, val)
    cfg = cls(**values)
    cfg.check()
    return cfg


def add_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """One ``--flag`` per field, defaulting to None so unset flags do not override."""
    parser.add_argument("--config", help="TOML config file", default=None)
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        help_text = f"{f.metadata.get('help', '')} (default: {f.default!r})"
        if f.type == "bool":
            parser.add_argument(
                flag,
                dest=f.name,
                action=argparse.BooleanOptionalAction,
                default=None,
                help=help_text,
            )
        else:
            parser.add_argument(flag, dest=f.name, default=None, help=help_text)


def from_args(cls: type[C], args: argparse.Namespace) -> C:
    fields = {f.name for f in dataclasses.fields(cls)}
    return load(cls, args.config, overrides={k: v for k, v in vars(args).items() if k in fields})
