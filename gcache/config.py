"""Typed settings. Defaults live here and only here.
One file on purpose: the value objects of every component (plain frozen
dataclasses, no logic beyond validation) side by side, so every default and the
one loader/flag generator that reads them all are in one place.

Each component has one frozen dataclass. Values come, later winning, from the
defaults, a TOML config file (section ``[meta]``, ``[server]`` or ``[client]``),
environment variables (``GCACHE_META_PORT=7700``) and command-line flags
(``--port 7700``); flags are generated from the fields, so ``--help`` always lists
every setting with its default.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any, TypeVar

from gcache.errors import ConfigError
from gcache.leader import check_meta, parse_etcd

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(?:([kmgtp])(i?)(b?)|(b))?\s*$", re.IGNORECASE)
_PREFIXES = "kmgtp"
SIZE_RULE = (
    "sizes: a number with an optional unit K, M, G, T or P; a bare letter or one with "
    "'i' is binary (1M = 1MiB = 2**20 bytes), a letter with 'B' and no 'i' is decimal "
    "(1MB = 10**6 bytes), as dd reads them; case does not matter"
)


def parse_size(text: str | int) -> int:
    """Bytes in ``text``: ``"64M"`` and ``"64MiB"`` -> 67108864, ``"1GB"`` -> 10**9.

    One rule (dd's): K, M, G, T, P alone or with ``i`` (``Ki``, ``KiB``) are powers
    of 1024; with ``B`` and no ``i`` (``KB``, ``GB``) powers of 1000. A fraction of
    a byte is dropped (``"1.5K"`` -> 1536).
    """
    if isinstance(text, bool) or not isinstance(text, (str, int)):
        raise ConfigError(f"not a size: {text!r} (examples: 4096, 64M, 64MiB, 2GB)")
    if isinstance(text, int):
        if text < 0:
            raise ConfigError(f"not a size: {text!r} (a size is >= 0)")
        return text
    m = _SIZE.match(text)
    if not m:
        raise ConfigError(f"not a size: {text!r} (examples: 4096, 64M, 64MiB, 2GB)")
    digits, prefix, binary, b = m.group(1), (m.group(2) or "").lower(), m.group(3), m.group(4)
    mult = 1
    if prefix:
        power = _PREFIXES.index(prefix) + 1
        mult = 1000**power if b and not binary else 1024**power
    return int(Decimal(digits) * mult)  # exact, even past 2**53


# Capabilities expire this long before the meta reuses their memory, so a clock
# step between meta and server cannot let a stale grant touch reused bytes.
GRANT_MARGIN_S = 1.0


def _doc(text: str, *, zero_ok: bool = False, **kw: Any) -> Any:
    """A field with its ``--help`` text. ``zero_ok``: a ``*_s`` duration may be 0
    (meaning off); otherwise durations must be > 0."""
    return field(metadata={"help": text, "zero_ok": zero_ok}, **kw)


# Rules every field obeys by its name and type, so a field added later is checked
# too (each check() calls _check_fields first):
#   every float      finite: nan and inf are refused
#   *_s              seconds, > 0 (>= 0 where the field says zero_ok)
#   port, *_port     0..65535, 0 = any free port; those in _PORT_OFF also -1 = off
#   *_watermark      a fraction in (0, 1]
_PORT_OFF = frozenset({"metrics_port", "http_port"})


def _where(cfg: Any, name: str) -> str:
    return f"{_SECTIONS[type(cfg)]}.{name}"


def _check_fields(cfg: Any) -> None:
    for f in dataclasses.fields(cfg):
        name, value, where = f.name, getattr(cfg, f.name), _where(cfg, f.name)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{where} must be a finite number, got {value!r}")
        if name.endswith("_s"):
            if f.metadata.get("zero_ok") and value < 0:
                raise ConfigError(f"{where} must be >= 0 seconds (0: off), got {value!r}")
            if not f.metadata.get("zero_ok") and value <= 0:
                raise ConfigError(f"{where} must be > 0 seconds, got {value!r}")
        if name == "port" or name.endswith("_port"):
            off = name in _PORT_OFF
            if not (-1 if off else 0) <= value <= 65535:
                raise ConfigError(
                    f"{where} must be a port in 1..65535 (0: any free"
                    f"{', -1: off' if off else ''}), got {value!r}"
                )
        if name.endswith("_watermark") and not 0 < value <= 1:
            raise ConfigError(f"{where} must be a fraction in (0, 1], got {value!r}")


def _check_advertise(section: str, host: str, advertise: str) -> None:
    if host in ("0.0.0.0", "::", "") and not advertise:
        raise ConfigError(
            f"{section}.host is {host or 'empty'} (every address): set {section}.advertise_host "
            "(--advertise-host) to the address others reach it at"
        )


def _check_hostport(where: str, value: str) -> None:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ConfigError(f"{where} must be host:port with a port in 1..65535, got {value!r}")


# Bounds of the connection settings both daemons have (gcache/transport).
MIN_BODY = 4 << 10
MAX_BODY = 32 << 20  # the wire's own limit (wire.MAX_BODY)
MAX_CONNECTIONS = 1 << 20


def _check_connections(cfg: Any) -> None:
    section = _SECTIONS[type(cfg)]
    try:
        body = parse_size(cfg.max_body)
    except ConfigError as exc:
        raise ConfigError(f"{section}.max_body: {exc}") from exc
    if not MIN_BODY <= body <= MAX_BODY:
        raise ConfigError(
            f"{section}.max_body must be between 4KiB and 32MiB, got {cfg.max_body!r}"
        )
    if not 1 <= cfg.max_connections <= MAX_CONNECTIONS:
        raise ConfigError(
            f"{section}.max_connections must be in 1..{MAX_CONNECTIONS}, got {cfg.max_connections}"
        )
    if not 1 <= cfg.max_connections_per_peer <= cfg.max_connections:
        raise ConfigError(
            f"{section}.max_connections_per_peer must be in 1..max_connections "
            f"({cfg.max_connections}), got {cfg.max_connections_per_peer}"
        )


@dataclass(frozen=True)
class MetaConfig:
    host: str = _doc("address the hot path and gRPC listen on", default="127.0.0.1")
    port: int = _doc("hot-path (framed TCP) port; 0 picks a free one", default=7700)
    grpc_port: int = _doc("control-plane gRPC port; 0 picks a free one", default=7701)
    heartbeat_timeout_s: float = _doc("drop a server silent for this long", default=5.0)
    lease_ttl_s: float = _doc("read lease lifetime granted by Lookup", default=10.0)
    # -- high availability (gcache/meta/election.py, ha.py; docs/operations.md) --
    etcd: str = _doc(
        "etcd://HOST:PORT[,HOST:PORT]/PREFIX: run as one of several metas, the leader "
        "elected through etcd (empty: a single meta, no etcd)",
        default="",
    )
    meta_id: str = _doc("this meta's name in the election; default hostname:port", default="")
    advertise_host: str = _doc(
        "address others reach this meta at (leader record, redirects); default: host "
        "(required when host is 0.0.0.0)",
        default="",
    )
    etcd_lease_ttl_s: float = _doc(
        "TTL of the leader's etcd lease (at most 2 s; a standby takes over within about "
        "this long after the leader dies)",
        default=2.0,
    )
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
    # -- bounds of pending puts and leases (gcache/meta/puts.py, leases.py) --
    max_pending_per_client: float = _doc(
        "fraction of the store's capacity one client connection's pending (uncommitted) "
        "puts may reserve; objects past it get no_space",
        default=0.25,
    )
    max_pending_total: float = _doc(
        "fraction of the store's capacity all pending puts together may reserve", default=0.5
    )
    max_evict_per_put: float = _doc(
        "fraction of the store's capacity one PutBegin may evict to make room", default=0.1
    )
    max_leases_per_client: int = _doc(
        "read leases one client connection may hold at once", default=16384
    )
    metrics_port: int = _doc("Prometheus /metrics HTTP port; -1 disables, 0 any free", default=7702)
    ready_file: str = _doc("write 'host port grpc_port metrics_port' here when up", default="")
    # -- auth (gcache/auth.py) --
    cluster_token_file: str = _doc(
        "file holding the cluster token servers must present (else $GCACHE_CLUSTER_TOKEN; "
        "neither: no control-plane authentication)",
        default="",
    )
    tenants_file: str = _doc(
        "TOML/JSON file of client access tokens: token -> name, namespaces (cache_salt "
        "prefixes), quota, admin; empty: clients are not authenticated",
        default="",
    )
    tls_cert: str = _doc("PEM certificate of the gRPC port (TLS on when set)", default="")
    tls_key: str = _doc("PEM private key of tls_cert", default="")
    # -- connections (gcache/transport) --
    max_body: str = _doc(
        "largest frame body the hot path accepts (a PutBegin of max_keys_per_request "
        "keys needs about 28 bytes a key)",
        default="4MiB",
    )
    idle_timeout_s: float = _doc(
        "close a hot-path connection that sends no frame for this long", default=300.0
    )
    send_timeout_s: float = _doc(
        "close a hot-path connection whose client takes no byte of a reply for this long "
        "(it stopped reading)",
        default=30.0,
    )
    max_connections: int = _doc("hot-path connections open at once", default=4096)
    max_connections_per_peer: int = _doc(
        "hot-path connections open at once from one address", default=1024
    )
    # -- tiers and restarts (gcache/meta/tiers.py, rebuild.py) --
    demote: bool = _doc(
        "above high_watermark, copy DRAM objects to their server's NVMe tier instead "
        "of dropping them: all of them while the tier is below nvme_low_watermark, "
        "only those worth a disk write past it",
        default=True,
    )
    nvme_high_watermark: float = _doc(
        "start evicting (deleting) NVMe objects above this fraction of a tier", default=0.95
    )
    nvme_low_watermark: float = _doc("evict NVMe objects down to this fraction", default=0.85)
    compute_tflops: float = _doc(
        "prefill throughput assumed for the recompute side of the demotion rule (TFLOP/s)",
        default=400.0,
    )
    demote_min_gain: float = _doc(
        "past nvme_low_watermark, demote an object only if recomputing its block takes "
        "at least this many times longer than reading it back from NVMe",
        default=1.0,
    )
    max_demotions_in_flight: int = _doc(
        "demotions sent to a server and not reported done yet; past it demotion is "
        "behind: nothing the tier has room for is dropped, puts that need the room wait "
        "(put_wait_s)",
        default=4096,
    )
    demote_watermark: float = _doc(
        "above this fraction used (and below high_watermark), demote DRAM objects "
        "continuously (as the demote rule says, dropping none), so a server's disk "
        "always has a batch while puts arrive; at or above high_watermark: off",
        default=0.85,
    )
    put_wait_s: float = _doc(
        "a put that finds DRAM full while demotions in flight will make its room (or "
        "demotion is behind) waits in the meta up to this long (then evicts as before, "
        "counted dropped_put_could_not_wait) instead of dropping objects the NVMe tier "
        "would keep; keep it below the clients' timeout_s; 0: off",
        zero_ok=True,
        default=1.0,
    )
    pressure_heartbeat_s: float = _doc(
        "while a server with an NVMe tier is past demote_watermark, or would pass it "
        "within a second at its recent write rate, the meta asks its heartbeats this "
        "often (instead of heartbeat_interval_s), so demotions a waiting put queued "
        "start at once; 0: off",
        zero_ok=True,
        default=0.05,
    )
    adopt_outbox: int = _doc(
        "in-process drivers' commits queued per server for its manifest (sent in the "
        "next heartbeat reply; clients' puts are recorded by the server at the write); "
        "past it they are counted and not recorded (lost on a restart, never wrong)",
        default=1 << 16,
    )
    max_parked_objects: int = _doc(
        "reported objects waiting for their namespace to be registered again or their "
        "parent block to be reported; past it the oldest are freed",
        default=1 << 22,
    )
    parked_ttl_s: float = _doc("free parked reported objects after this long", default=300.0)
    promotion: str = _doc(
        "copy NVMe objects back to DRAM on repeated hits: off, or hits:N (an NVMe object "
        "read by N leased lookups is copied into a DRAM range of its server, when that "
        "stays below high_watermark)",
        default="off",
    )
    write_balance_s: float = _doc(
        "time constant of the recent write load placement balances against free space",
        default=10.0,
    )
    # -- removal feed for KV events (gcache/meta/events.py) --
    event_ring: int = _doc(
        "removals kept per watched namespace for WatchRemovals subscribers; one that "
        "falls further behind is told it missed some (a gap)",
        default=65536,
    )
    max_event_subscribers: int = _doc(
        "WatchRemovals subscribers at once (all namespaces); one more is refused",
        default=256,
    )

    @property
    def max_body_bytes(self) -> int:
        return parse_size(self.max_body)

    @property
    def promotion_hits(self) -> int:
        """Hits that promote an NVMe object (``hits:N``); 0 = off; -1 = malformed."""
        if self.promotion == "off":
            return 0
        name, _, n = self.promotion.partition(":")
        if name != "hits" or not n.isdigit() or int(n) < 1:
            return -1
        return int(n)

    def check(self) -> None:
        _check_fields(self)
        _check_connections(self)
        if self.etcd:
            parse_etcd("meta.etcd, --etcd", self.etcd)
            if not 1.0 <= self.etcd_lease_ttl_s <= 2.0:
                raise ConfigError(
                    f"meta.etcd_lease_ttl_s must be between 1 and 2 s, got {self.etcd_lease_ttl_s}"
                )
        _check_advertise("meta", self.host, self.advertise_host)
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError("tls_cert and tls_key go together")
        if not 0 < self.nvme_low_watermark < self.nvme_high_watermark <= 1:
            raise ConfigError(
                "need 0 < meta.nvme_low_watermark < meta.nvme_high_watermark <= 1, got "
                f"{self.nvme_low_watermark} and {self.nvme_high_watermark}"
            )
        if self.promotion_hits < 0:
            raise ConfigError(
                f"meta.promotion must be off or hits:N with N >= 1, got {self.promotion!r}"
            )
        for name in ("compute_tflops", "write_balance_s", "parked_ttl_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"meta.{name} must be > 0, got {getattr(self, name)!r}")
        for name in (
            "max_demotions_in_flight",
            "adopt_outbox",
            "max_parked_objects",
            "event_ring",
            "max_event_subscribers",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"meta.{name} must be >= 1, got {getattr(self, name)}")
        if not self.low_watermark < self.high_watermark:
            raise ConfigError(
                f"meta.low_watermark ({self.low_watermark}) must be below meta.high_watermark "
                f"({self.high_watermark}): need 0 < low_watermark < high_watermark <= 1"
            )
        if self.eviction_policy not in ("lru", "cost"):
            raise ConfigError(
                f"meta.eviction_policy must be lru or cost, got {self.eviction_policy!r}"
            )
        if self.checkpoint_interval < 0:
            raise ConfigError(
                f"meta.checkpoint_interval must be >= 0 (0: off), got {self.checkpoint_interval}"
            )
        if self.max_keys_per_request < 1:
            raise ConfigError(
                f"meta.max_keys_per_request must be >= 1, got {self.max_keys_per_request}"
            )
        for name in ("max_pending_per_client", "max_pending_total", "max_evict_per_put"):
            if not 0 < getattr(self, name) <= 1:
                raise ConfigError(
                    f"meta.{name} must be a fraction in (0, 1], got {getattr(self, name)!r}"
                )
        if self.max_leases_per_client < 1:
            raise ConfigError(
                f"meta.max_leases_per_client must be >= 1, got {self.max_leases_per_client}"
            )
        for name in ("lease_ttl_s", "put_timeout_s"):
            if getattr(self, name) <= GRANT_MARGIN_S:
                raise ConfigError(
                    f"meta.{name} must exceed {GRANT_MARGIN_S} s (capabilities end that long "
                    f"before the lease or put does), got {getattr(self, name)!r}"
                )


@dataclass(frozen=True)
class ServerConfig:
    server_id: str = _doc("unique name; default host:port", default="")
    host: str = _doc("address the data plane listens on", default="127.0.0.1")
    port: int = _doc("data-plane port; 0 picks a free one", default=7800)
    meta: str = _doc(
        "meta gRPC address host:port, several as H:P,H:P (followed to the leader), or "
        "etcd://HOST:PORT/PREFIX (the leader found in etcd)",
        default="127.0.0.1:7701",
    )
    advertise_host: str = _doc(
        "address clients reach this server at (registered with the meta); default: "
        "host (required when host is 0.0.0.0)",
        default="",
    )
    capacity: str = _doc("DRAM segment size (e.g. 1GiB)", default="1GiB")
    shm_dir: str = _doc("directory of the shared-memory segment file", default="/dev/shm")
    heartbeat_interval_s: float = _doc("heartbeat period", default=1.0)
    populate: bool = _doc(
        "pre-fault every page of the segment at start (first writes take no page faults)",
        default=True,
    )
    reserve: bool = _doc(
        "reserve the segment's whole size in its tmpfs at start, so a full tmpfs fails "
        "start-up instead of killing server and clients with SIGBUS later; off only for "
        "index-only benchmarks that never write",
        default=True,
    )
    ready_file: str = _doc("write 'host port' here once registered", default="")
    # -- auth (gcache/auth.py) --
    cluster_token_file: str = _doc(
        "file holding the cluster token sent to the meta (else $GCACHE_CLUSTER_TOKEN)",
        default="",
    )
    tls_ca: str = _doc("PEM CA certificate of the meta's gRPC port (TLS on when set)", default="")
    # -- connections (gcache/transport) --
    max_body: str = _doc("largest frame body the data plane accepts", default="32MiB")
    idle_timeout_s: float = _doc(
        "close a data-plane connection that sends no frame for this long", default=300.0
    )
    send_timeout_s: float = _doc(
        "close a data-plane connection whose client takes no byte of a reply for this "
        "long (it stopped reading)",
        default=30.0,
    )
    max_connections: int = _doc("data-plane connections open at once", default=4096)
    max_connections_per_peer: int = _doc(
        "data-plane connections open at once from one address", default=1024
    )
    # -- NVMe tier and restarts (gcache/storage/nvme.py, manifest.py) --
    nvme_path: str = _doc(
        "directory of the NVMe tier's files (with nvme_size; empty: no NVMe tier)", default=""
    )
    nvme_size: str = _doc(
        "size of the NVMe tier (e.g. 64GiB); needed with nvme_path (empty: not set, an "
        "error when nvme_path is); 0 = no NVMe tier",
        default="",
    )
    nvme_direct: bool = _doc(
        "write the NVMe tier with O_DIRECT (buffered where the file system refuses it)",
        default=True,
    )
    reuse_segment: bool = _doc(
        "re-adopt the segment file a previous run of this server id left (its manifest "
        "and checksums decide what is kept); off: DRAM starts empty",
        default=True,
    )
    # -- staging area for same-host tier-1 reads (server/staging.py) --
    staging_size: str = _doc(
        "tmpfs staging file (in shm_dir) that NVMe objects are read into for clients on "
        "this host; 0 = off (they read over TCP)",
        default="128MiB",
    )
    staging_ttl_s: float = _doc(
        "a staging range not given back by its client within this is freed", default=10.0
    )

    @property
    def max_body_bytes(self) -> int:
        return parse_size(self.max_body)

    @property
    def staging_size_bytes(self) -> int:
        return parse_size(self.staging_size)

    @property
    def capacity_bytes(self) -> int:
        return parse_size(self.capacity)

    @property
    def nvme_size_bytes(self) -> int:
        return parse_size(self.nvme_size) if self.nvme_size.strip() else 0

    def check(self) -> None:
        _check_fields(self)
        _check_connections(self)
        try:
            capacity = self.capacity_bytes
        except ConfigError as exc:
            raise ConfigError(f"server.capacity: {exc}") from exc
        if capacity < 1 << 20:
            raise ConfigError(f"server.capacity must be at least 1MiB, got {self.capacity!r}")
        check_meta("server.meta, --meta", self.meta)
        _check_advertise("server", self.host, self.advertise_host)
        try:
            nvme = self.nvme_size_bytes
        except ConfigError as exc:
            raise ConfigError(f"server.nvme_size: {exc}") from exc
        if nvme and nvme < 2 << 20:
            raise ConfigError(
                f"server.nvme_size must be 0 or at least 2MiB, got {self.nvme_size!r}"
            )
        if nvme and not self.nvme_path:
            raise ConfigError("server.nvme_size needs server.nvme_path (--nvme-path DIR)")
        if self.nvme_path and not self.nvme_size.strip():
            raise ConfigError(
                f"server.nvme_path ({self.nvme_path}) needs server.nvme_size: give the "
                "tier a size (--nvme-size 64GiB), or --nvme-size 0 to run without one"
            )
        try:
            staging = self.staging_size_bytes
        except ConfigError as exc:
            raise ConfigError(f"server.staging_size: {exc}") from exc
        if staging % 4096:
            raise ConfigError(
                f"server.staging_size must be a multiple of 4KiB, got {self.staging_size!r}"
            )
        if not self.staging_ttl_s > 0:
            raise ConfigError(f"server.staging_ttl_s must be positive, got {self.staging_ttl_s}")


@dataclass(frozen=True)
class ClientConfig:
    meta: str = _doc(
        "meta hot-path address host:port, several as H:P,H:P (the leader is followed), "
        "or etcd://HOST:PORT/PREFIX (the leader found in etcd; meta_grpc unused)",
        default="127.0.0.1:7700",
    )
    meta_grpc: str = _doc(
        "meta gRPC address host:port, several as H:P,H:P in the order of meta",
        default="127.0.0.1:7701",
    )
    timeout_s: float = _doc("per-operation timeout; a timeout is a miss", default=5.0)
    layers_in_flight: int = _doc("get_layers: layer reads kept in flight", default=8)
    layer_bytes_in_flight: int = _doc(
        "get_layers: read further ahead than layers_in_flight while the layers in "
        "flight hold at most this many bytes (a hybrid model's next full layer)",
        default=256 << 20,
    )
    max_inflight_writes: int = _doc("put: object writes in flight per server", default=8)
    transport: str = _doc(
        "data path: auto (shared memory when the server is local), tcp, shm", default="auto"
    )
    shm_populate: bool = _doc(
        "shm: map a server's whole segment at first use (copies take no page faults)",
        default=True,
    )
    # -- auth (gcache/auth.py) --
    token: str = _doc(
        "access token sent to the meta (env GCACHE_CLIENT_TOKEN; never a flag)",
        default="",
        repr=False,
    )
    token_file: str = _doc("file holding the access token", default="")
    tls_ca: str = _doc("PEM CA certificate of the meta's gRPC port (TLS on when set)", default="")
    # -- router reports (client/gcache_client/router.py) --
    router: str = _doc(
        "gcache-router hot-path address host:port; with instance_id set, match() "
        "reports its hits there (empty: no reports)",
        default="",
    )
    instance_id: str = _doc("this engine instance's id at the router", default="")
    # -- load or recompute (client/gcache_client/tiers.py) --
    load_or_recompute: bool = _doc(
        "match() stops where fetching the rest of the match (at the servers' measured "
        "tier bandwidths) would take longer than recomputing it",
        default=True,
    )
    compute_tflops: float = _doc(
        "the engine's effective prefill throughput for that rule (TFLOP/s; the model's "
        "FLOPs come from the compute model of docs/eviction.md); 0: not known, so the "
        "rule cannot judge and every match is loaded whole",
        default=0.0,
    )

    def check(self) -> None:
        _check_fields(self)
        if not self.compute_tflops >= 0:
            raise ConfigError(f"client.compute_tflops must be >= 0, got {self.compute_tflops!r}")
        if self.router:
            _check_hostport("client.router", self.router)
            if not self.instance_id:
                raise ConfigError("client.router is set: set client.instance_id too")
        for name in ("layers_in_flight", "max_inflight_writes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"client.{name} must be >= 1, got {getattr(self, name)}")
        if self.layer_bytes_in_flight < 0:
            raise ConfigError(
                f"client.layer_bytes_in_flight must be >= 0, got {self.layer_bytes_in_flight}"
            )
        if self.transport not in ("auto", "tcp", "shm"):
            raise ConfigError(f"client.transport must be auto, tcp or shm, got {self.transport!r}")
        check_meta("client.meta", self.meta)
        if not self.meta.startswith("etcd://"):
            check_meta("client.meta_grpc", self.meta_grpc)
            if len(self.meta.split(",")) != len(self.meta_grpc.split(",")):
                raise ConfigError(
                    "client.meta and client.meta_grpc must list the same number of metas"
                )
        if self.token and self.token_file:
            raise ConfigError("set either token or token_file, not both")


@dataclass(frozen=True)
class RouterConfig:
    """``gcache-router`` (gcache/router/daemon.py, docs/router.md)."""

    host: str = _doc("address the router listens on (hot path and HTTP)", default="127.0.0.1")
    port: int = _doc("framed hot-path port (Route, ReportHits, ReportLoad)", default=7900)
    http_port: int = _doc(
        "HTTP port: OpenAI proxy, /route, /healthz, /metrics; -1 disables", default=7901
    )
    instances: str = _doc(
        "engine instances known at start, comma-separated [ID=]URL[@EVENTS]: ID defaults "
        "to the URL's host:port, EVENTS is the instance's KV-event ZMQ PUB endpoint "
        "(tcp://host:5557) the router subscribes to",
        default="",
    )
    events_bind: str = _doc(
        "ZMQ endpoint the router binds a SUB socket on for engines that connect their "
        "KV-event publisher to it (vLLM: endpoint tcp://ROUTER:PORT); the topic is the "
        "instance id; empty: none",
        default="",
    )
    events_max_bytes: str = _doc("largest KV-event message accepted", default="16MiB")
    namespace: str = _doc(
        "namespace fingerprint (32 hex digits, as the meta registers it) the prompts' "
        "block keys chain from; empty: derived from model (then the pool match is off)",
        default="",
    )
    model: str = _doc("model name used when namespace is empty", default="gcache-router")
    layout: str = _doc(
        "layout preset (mimo-v2-flash, llama-3-8b) or a layout JSON file: decides "
        "window-safe matches",
        default="mimo-v2-flash",
    )
    block_size: int = _doc("tokens per block (the engines' and GCache's)", default=64)
    tokenizer: str = _doc(
        "how the HTTP front turns a text prompt into token ids: bytes (UTF-8 bytes, "
        "as gcache-engine does) or none (prompts must be token ids)",
        default="bytes",
    )
    meta: str = _doc(
        "GCache meta hot-path host:port for the pool match (Lookup, no lease), several as "
        "H:P,H:P or etcd://HOST:PORT/PREFIX (the leader is followed); empty: off",
        default="",
    )
    pool_timeout_s: float = _doc(
        "longest wait for the meta's pool match; past it a route counts no pool hit",
        default=0.05,
    )
    token: str = _doc(
        "access token the router sends (HELLO) on its meta connection for the pool "
        "match (env GCACHE_ROUTER_TOKEN; never a flag)",
        default="",
        repr=False,
    )
    token_file: str = _doc("file holding that access token", default="")
    policy: str = _doc(
        "routing policy: gcache, round-robin, least-load, sglang, dynamo", default="gcache"
    )
    weights: str = _doc(
        "policy weights overriding their documented defaults, comma-separated name=value "
        "(e.g. pool_token_cost=0.1,load_weight=1)",
        default="",
    )
    seed: int = _doc("seed of the policy's tie-breaking random generator", default=0)
    instance_ttl_s: float = _doc(
        "an instance not heard from (load report, KV event, health probe) for this long "
        "is not routed to",
        default=10.0,
    )
    instance_forget_s: float = _doc(
        "an instance silent for this long is forgotten with its index", default=600.0
    )
    health_interval_s: float = _doc(
        "probe each instance URL's health_path this often (a success keeps it live); 0: off",
        default=2.0,
        zero_ok=True,
    )
    health_path: str = _doc("engine health endpoint probed", default="/health")
    max_instances: int = _doc("instances tracked at once", default=64)
    max_blocks_per_instance: int = _doc(
        "blocks indexed per instance; past it the oldest are evicted", default=262144
    )
    max_proxied: int = _doc(
        "HTTP requests proxied at once; past it the router answers 503", default=1024
    )
    proxy_timeout_s: float = _doc(
        "longest a proxied request may take, streaming included", default=600.0
    )
    max_http_body: str = _doc("largest HTTP request body accepted", default="16MiB")
    ready_file: str = _doc("write 'host port http_port' here when up", default="")
    # -- hot-path connections (gcache/transport) --
    max_body: str = _doc("largest frame body the hot path accepts", default="4MiB")
    idle_timeout_s: float = _doc(
        "close a hot-path connection that sends no frame for this long", default=300.0
    )
    send_timeout_s: float = _doc(
        "close a hot-path connection whose client takes no byte of a reply for this long",
        default=30.0,
    )
    max_connections: int = _doc("hot-path connections open at once", default=4096)
    max_connections_per_peer: int = _doc(
        "hot-path connections open at once from one address", default=1024
    )
    http_max_connections: int = _doc(
        "HTTP connections open at once; past it one 503 answer and close", default=1024
    )
    http_max_connections_per_peer: int = _doc(
        "HTTP connections open at once from one address", default=256
    )

    @property
    def max_body_bytes(self) -> int:
        return parse_size(self.max_body)

    def check(self) -> None:
        _check_fields(self)
        _check_connections(self)
        if not 1 <= self.http_max_connections_per_peer <= self.http_max_connections:
            raise ConfigError(
                "router: need 1 <= http_max_connections_per_peer <= http_max_connections"
            )
        for name in ("events_max_bytes", "max_http_body"):
            try:
                if parse_size(getattr(self, name)) < 4096:
                    raise ConfigError(f"router.{name} must be at least 4KiB")
            except ConfigError as exc:
                raise ConfigError(f"router.{name}: {exc}") from exc
        if self.namespace:
            try:
                if len(bytes.fromhex(self.namespace)) != 16:
                    raise ValueError
            except ValueError:
                raise ConfigError(
                    f"router.namespace must be 32 hex digits, got {self.namespace!r}"
                ) from None
        if not 1 <= self.block_size <= 4096:
            raise ConfigError(f"router.block_size must be in 1..4096, got {self.block_size}")
        if self.tokenizer not in ("bytes", "none"):
            raise ConfigError(f"router.tokenizer must be bytes or none, got {self.tokenizer!r}")
        if self.meta:
            check_meta("router.meta, --meta", self.meta)
        if self.token and self.token_file:
            raise ConfigError("router: set either token or token_file, not both")
        if not 1 <= self.max_instances <= 1024:
            raise ConfigError(f"router.max_instances must be in 1..1024, got {self.max_instances}")
        for name in ("max_blocks_per_instance", "max_proxied"):
            if getattr(self, name) < 1:
                raise ConfigError(f"router.{name} must be >= 1, got {getattr(self, name)}")
        if self.instance_forget_s < self.instance_ttl_s:
            raise ConfigError("router.instance_forget_s must be >= router.instance_ttl_s")
        if not self.health_path.startswith("/"):
            raise ConfigError(f"router.health_path must start with /, got {self.health_path!r}")


@dataclass(frozen=True)
class EngineConfig:
    """``gcache-engine`` (client/gcache_client/engines/demo/server.py): the toy OpenAI-
    compatible engine instance with its own prefix cache and GCache as the pool."""

    host: str = _doc("address the HTTP server listens on", default="127.0.0.1")
    port: int = _doc("HTTP port (0: any free)", default=8000)
    url: str = _doc(
        "URL the router is told to reach this instance at (empty: http://host:port)", default=""
    )
    instance_id: str = _doc(
        "this instance's id at the router (empty: host:port of url)", default=""
    )
    meta: str = _doc("GCache meta hot-path address host:port (the pool)", default="127.0.0.1:7700")
    meta_grpc: str = _doc("GCache meta gRPC address host:port", default="127.0.0.1:7701")
    transport: str = _doc("GCache data path: auto, tcp, shm", default="auto")
    router: str = _doc(
        "gcache-router hot-path host:port: hit reports after each lookup and load reports "
        "(empty: none)",
        default="",
    )
    kv_events_endpoint: str = _doc(
        "ZMQ endpoint KV events (vLLM format) are published on: with '*' bound "
        "(tcp://*:5557, the router subscribes), else connected to (the router's "
        "events_bind); empty: no events",
        default="",
    )
    kv_events_topic: str = _doc("ZMQ topic of the events (empty: the instance id)", default="")
    model_id: str = _doc(
        "model name the GCache namespace is registered under", default="demo/tiny-mimo-v2-flash"
    )
    layers: int = _doc("layers of the tiny random-weight MiMo-V2-Flash model", default=6)
    hidden: int = _doc("hidden size of the model", default=256)
    seed: int = _doc("weight seed (every instance of a fleet needs the same)", default=0)
    block_size: int = _doc("tokens per block", default=64)
    local_capacity: str = _doc(
        "bytes of KV the instance's own prefix cache holds", default="256MiB"
    )
    max_queue: int = _doc("requests waiting at once; past it the engine answers 503", default=64)
    max_prompt_tokens: int = _doc("longest prompt accepted", default=32768)
    max_tokens: int = _doc("most tokens one request may generate", default=4096)
    default_max_tokens: int = _doc("tokens generated when a request names none", default=16)
    load_interval_s: float = _doc("report load to the router this often", default=0.5)
    ready_file: str = _doc("write 'host port' here when serving", default="")

    def check(self) -> None:
        _check_fields(self)
        for name in ("meta", "meta_grpc"):
            _check_hostport(f"engine.{name}", getattr(self, name))
        if self.router:
            _check_hostport("engine.router", self.router)
        if self.transport not in ("auto", "tcp", "shm"):
            raise ConfigError(f"engine.transport must be auto, tcp or shm, got {self.transport!r}")
        if self.kv_events_endpoint and not self.kv_events_endpoint.startswith(
            ("tcp://", "ipc://", "inproc://")
        ):
            raise ConfigError(
                "engine.kv_events_endpoint must start with tcp://, ipc:// or inproc://, "
                f"got {self.kv_events_endpoint!r}"
            )
        if self.url and not self.url.startswith(("http://", "https://")):
            raise ConfigError(f"engine.url must start with http:// or https://, got {self.url!r}")
        try:
            if parse_size(self.local_capacity) < 1 << 20:
                raise ConfigError("must be at least 1MiB")
        except ConfigError as exc:
            raise ConfigError(f"engine.local_capacity: {exc}") from exc
        for name in (
            "layers",
            "hidden",
            "block_size",
            "max_queue",
            "max_prompt_tokens",
            "max_tokens",
            "default_max_tokens",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"engine.{name} must be >= 1, got {getattr(self, name)}")
        if self.default_max_tokens > self.max_tokens:
            raise ConfigError("engine.default_max_tokens must be <= engine.max_tokens")


C = TypeVar("C", MetaConfig, ServerConfig, ClientConfig, RouterConfig, EngineConfig)
_SECTIONS = {
    MetaConfig: "meta",
    ServerConfig: "server",
    ClientConfig: "client",
    RouterConfig: "router",
    EngineConfig: "engine",
}


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _convert(cls: type, name: str, raw: Any) -> Any:
    """Strict conversion: no silent truncation, no guessing at booleans."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    where = f"{_SECTIONS[cls]}.{name}"
    if name not in fields:
        raise ConfigError(f"unknown setting {where}")
    kind = str(fields[name].type)
    if not fields[name].repr:  # a secret (an access token): never echoed in an error
        raw_text = "a value (hidden)"
    else:
        raw_text = repr(raw)
    if kind == "bool":
        if isinstance(raw, bool):
            return raw
        text = str(raw).strip().lower()
        if text in _TRUE or text in _FALSE:
            return text in _TRUE
        raise ConfigError(f"{where}: expected a boolean (true/false), got {raw_text}")
    scalars = (str, int) if kind == "str" else (str, int, float)
    if isinstance(raw, bool) or not isinstance(raw, scalars):
        raise ConfigError(f"{where}: expected {kind}, got {raw_text}")
    if kind == "int" and isinstance(raw, float) and not raw.is_integer():
        raise ConfigError(f"{where}: expected an integer, got {raw_text}")
    try:
        return {"int": int, "float": float, "str": str}[kind](raw)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: expected {kind}, got {raw_text}") from exc


def _read_file(file: str) -> dict[type, dict[str, Any]]:
    """Every section of a config file, each key checked against its class: an
    unknown section (``[metaa]``), a section that is not a table or an unknown
    key anywhere in the file is refused, whichever daemon reads the file."""
    try:
        with open(file, "rb") as fh:
            data = tomllib.load(fh)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"cannot read config file {file}: {exc}") from exc
    by_name = {name: cls for cls, name in _SECTIONS.items()}
    known = ", ".join(f"[{name}]" for name in by_name)
    out: dict[type, dict[str, Any]] = {cls: {} for cls in _SECTIONS}
    for name, body in data.items():
        if name not in by_name:
            what = "section" if isinstance(body, dict) else "top-level key"
            raise ConfigError(f"{file}: unknown {what} [{name}] (known sections: {known})")
        if not isinstance(body, dict):
            raise ConfigError(f"{file}: {name} must be a section [{name}], got {body!r}")
        fields = {f.name for f in dataclasses.fields(by_name[name])}
        for key in body:
            if key not in fields:
                raise ConfigError(f"{file}: unknown setting [{name}] {key}")
        out[by_name[name]] = body
    return out


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
        for other, body in _read_file(file).items():
            try:
                converted = {key: _convert(other, key, val) for key, val in body.items()}
                if other is cls:
                    values.update(converted)
                elif body:  # the other sections of the file must be valid too
                    other(**converted).check()
            except ConfigError as exc:
                raise ConfigError(f"{file}: {exc}") from exc
    prefix = f"GCACHE_{section.upper()}_"
    for key, val in (os.environ if env is None else env).items():
        if key.startswith(prefix):
            name = key[len(prefix) :].lower()
            if name not in names:
                raise ConfigError(f"unknown environment setting {key}")
            try:
                values[name] = _convert(cls, name, val)
            except ConfigError as exc:
                raise ConfigError(f"environment {key}: {exc}") from exc
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
        if not f.repr:  # secrets (an access token) never travel as flags
            continue
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
