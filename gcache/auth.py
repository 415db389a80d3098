"""Who may talk to the meta: cluster token, tenant access tokens, TLS for gRPC.

* **Cluster token** (control plane): a shared secret the storage servers send in
  gRPC metadata on ``RegisterServer`` and ``Heartbeat``. Read from a file
  (``cluster_token_file``) or the environment (``GCACHE_CLUSTER_TOKEN``), never from a
  command-line flag (flags show in ``ps``).
* **Tenant tokens** (clients): a TOML or JSON file (``tenants_file``) mapping each
  access token to a :class:`~gcache.principal.Principal`: the ``cache_salt``
  prefixes it may read and write, a byte quota, admin or not. Only the sha256 of each
  token is kept in memory; a token is looked up by its hash and the hash compared in
  constant time.
* **TLS** (gRPC only): ``tls_cert``/``tls_key`` on the meta, ``tls_ca`` on servers and
  clients.

Without any of them the meta runs as before: everything allowed, on trust.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from gcache.config import parse_size
from gcache.errors import ConfigError
from gcache.principal import Principal

CLUSTER_TOKEN_ENV = "GCACHE_CLUSTER_TOKEN"
# Metadata key of the token on every gRPC call (lowercase: gRPC requires it).
TOKEN_METADATA = "authorization"
_BEARER = "Bearer "
MIN_TOKEN_LEN = 16
MAX_TENANTS = 10_000

# The cluster token acts as this principal on RegisterNamespace and admin calls.
CLUSTER = Principal("cluster", ("",), 0, admin=True)

# gRPC reconnect back-off of the channels servers and clients open to the meta:
# after a meta outage of any length the channel tries again at least every
# 500 ms, so a server re-registers within one heartbeat interval (plus this) of the
# meta being ready. gRPC's default grows to 120 s.
RECONNECT_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 500),
)


def token_hash(token: str | bytes) -> bytes:
    raw = token.encode() if isinstance(token, str) else token
    return hashlib.sha256(raw).digest()


def _read_secret_file(path: str, what: str) -> str:
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read {what} file {path}: {exc}") from exc
    if not text:
        raise ConfigError(f"{what} file {path} is empty")
    return text


def _checked_token(token: str, where: str) -> str:
    if len(token) < MIN_TOKEN_LEN:
        raise ConfigError(f"{where}: tokens must be at least {MIN_TOKEN_LEN} characters")
    if any(c.isspace() for c in token) or not token.isprintable():
        raise ConfigError(f"{where}: a token must be printable and without whitespace")
    return token


def load_cluster_token(path: str, env: Mapping[str, str] | None = None) -> str | None:
    """The cluster token from ``path`` if set, else from ``$GCACHE_CLUSTER_TOKEN``;
    None when neither is set (the control plane then runs without authentication)."""
    if path:
        return _checked_token(_read_secret_file(path, "cluster token"), path)
    value = (os.environ if env is None else env).get(CLUSTER_TOKEN_ENV, "").strip()
    return _checked_token(value, CLUSTER_TOKEN_ENV) if value else None


def load_client_token(token: str, token_file: str) -> str | None:
    """A client's access token: ``token`` itself, or the content of ``token_file``."""
    if token and token_file:
        raise ConfigError("set either token or token_file, not both")
    if token_file:
        return _checked_token(_read_secret_file(token_file, "access token"), token_file)
    return token or None


# ---- tenant table ----------------------------------------------------------------------


def _principal(where: str, entry: Any) -> Principal:
    if not isinstance(entry, dict):
        raise ConfigError(f"{where}: expected a table of name, namespaces, quota, admin")
    unknown = set(entry) - {"name", "namespaces", "quota", "admin"}
    if unknown:
        raise ConfigError(f"{where}: unknown keys {sorted(unknown)}")
    name = entry.get("name")
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{where}: name is required")
    spaces = entry.get("namespaces")
    if not isinstance(spaces, list) or not spaces or not all(isinstance(p, str) for p in spaces):
        raise ConfigError(
            f"{where}: namespaces must be a non-empty list of cache_salt prefixes "
            '([""] allows every namespace)'
        )
    quota = entry.get("quota", 0)
    if isinstance(quota, bool) or not isinstance(quota, (int, str)):
        raise ConfigError(f"{where}: quota must be a size (bytes or e.g. '4GiB')")
    quota_bytes = parse_size(quota)
    if quota_bytes < 0:
        raise ConfigError(f"{where}: quota must be >= 0")
    admin = entry.get("admin", False)
    if not isinstance(admin, bool):
        raise ConfigError(f"{where}: admin must be true or false")
    return Principal(name, tuple(spaces), quota_bytes, admin)


@dataclass(frozen=True)
class TenantTable:
    """sha256(token) -> principal. Tokens themselves are not kept."""

    by_hash: dict[bytes, Principal] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.by_hash)

    def lookup(self, token: str) -> Principal | None:
        # Keyed by sha256: a caller cannot steer the probe without knowing a token,
        # and what a timing difference could reveal is a hash, not a token.
        return self.by_hash.get(token_hash(token))

    @classmethod
    def parse(cls, data: Mapping[str, Any], where: str) -> TenantTable:
        """``{token: {name, namespaces, quota, admin}}``; a key ``sha256:<hex>``
        names a token by its hash, so the file need not hold the secret."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"{where}: expected a table of tokens")
        if len(data) > MAX_TENANTS:
            raise ConfigError(f"{where}: more than {MAX_TENANTS} tokens")
        table: dict[bytes, Principal] = {}
        for key, entry in data.items():
            label = f"{where}: tenant {entry.get('name', '?') if isinstance(entry, dict) else '?'}"
            if key.startswith("sha256:"):
                try:
                    digest = bytes.fromhex(key[7:])
                except ValueError as exc:
                    raise ConfigError(f"{label}: bad sha256 hex") from exc
                if len(digest) != 32:
                    raise ConfigError(f"{label}: sha256 must be 64 hex digits")
            else:
                digest = token_hash(_checked_token(key, label))
            if digest in table:
                raise ConfigError(f"{label}: token listed twice")
            table[digest] = _principal(label, entry)
        if not table:
            raise ConfigError(f"{where}: no tokens")
        return cls(table)

    @classmethod
    def load(cls, path: str) -> TenantTable:
        try:
            with open(path, "rb") as fh:
                raw = fh.read()
        except OSError as exc:
            raise ConfigError(f"cannot read tenants file {path}: {exc}") from exc
        try:
            if path.endswith(".json"):
                data = json.loads(raw)
            else:
                data = tomllib.loads(raw.decode())
        except (ValueError, UnicodeDecodeError) as exc:  # JSON and TOML errors
            raise ConfigError(f"cannot parse tenants file {path}: {exc}") from exc
        return cls.parse(data, path)


# ---- the meta's view: who is calling ----------------------------------------------------


def bearer(metadata: Sequence[tuple[str, str | bytes]] | None) -> str | None:
    """The token of a gRPC call's ``authorization: Bearer <token>`` metadata."""
    for key, value in metadata or ():
        if key == TOKEN_METADATA:
            text = value.decode() if isinstance(value, bytes) else value
            return text[len(_BEARER) :] if text.startswith(_BEARER) else None
    return None


@dataclass(frozen=True)
class Authenticator:
    """The meta's credentials: decides who a token is. Pure: no I/O after loading."""

    cluster_token_hash: bytes | None = None
    tenants: TenantTable | None = None

    @classmethod
    def from_files(
        cls, cluster_token_file: str, tenants_file: str, env: Mapping[str, str] | None = None
    ) -> Authenticator:
        token = load_cluster_token(cluster_token_file, env)
        return cls(
            token_hash(token) if token is not None else None,
            TenantTable.load(tenants_file) if tenants_file else None,
        )

    @property
    def enabled(self) -> bool:
        return self.cluster_token_hash is not None or self.tenants is not None

    def is_cluster(self, token: str | None) -> bool:
        """``token`` is the cluster token. True for anyone when none is configured."""
        if self.cluster_token_hash is None:
            return True
        if token is None:
            return False
        return hmac.compare_digest(token_hash(token), self.cluster_token_hash)

    def tenant(self, token: str) -> Principal | None:
        """The hot path's ``Hello``: the principal of an access token."""
        return self.tenants.lookup(token) if self.tenants is not None else None

    def principal(self, token: str | None) -> Principal | None:
        """Who a gRPC caller is: the cluster (admin), a tenant, or nobody (None).
        Without any token configured every caller is the cluster."""
        if not self.enabled:
            return CLUSTER
        if token is None:
            return None
        if self.cluster_token_hash is not None and self.is_cluster(token):
            return CLUSTER
        return self.tenant(token)

    def may_register_namespace(self, token: str | None, cache_salt: str) -> str | None:
        """None if the caller may register a namespace with ``cache_salt``, else why not.
        Only tenant tokens restrict namespaces: without a tenants file anyone may."""
        if self.tenants is None:
            return None
        who = self.principal(token)
        if who is None:
            return "a valid access token is required"
        if not who.may_use(cache_salt):
            return f"tenant {who.name} may not use cache_salt {cache_salt!r}"
        return None

    def may_administer(self, token: str | None) -> str | None:
        """None if the caller may run admin calls (Evict), else why not."""
        who = self.principal(token)
        if who is None:
            return "a cluster token or an admin access token is required"
        if not who.admin:
            return f"tenant {who.name} is not an admin"
        return None

    def describe(self) -> str:
        parts = [
            "cluster token: " + ("required" if self.cluster_token_hash else "none"),
            "tenant tokens: " + (str(len(self.tenants)) if self.tenants else "none"),
        ]
        return ", ".join(parts)


# ---- gRPC channels and credentials ------------------------------------------------------


def _read_pem(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc}") from exc


def server_credentials(cert: str, key: str) -> grpc.ServerCredentials:
    """TLS credentials of the meta's gRPC port from PEM files."""
    if bool(cert) != bool(key):
        raise ConfigError("tls_cert and tls_key go together")
    return grpc.ssl_server_credentials(
        [(_read_pem(key, "TLS key"), _read_pem(cert, "TLS certificate"))]
    )


def add_port(server: grpc.aio.Server, address: str, tls: grpc.ServerCredentials | None) -> int:
    """Bind the meta's gRPC ``address`` (TLS with ``tls``). Returns the port (0: not bound)."""
    if tls is not None:
        return int(server.add_secure_port(address, tls))
    return int(server.add_insecure_port(address))


class _TokenInterceptor(grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    """Adds ``authorization: Bearer <token>`` to every unary call."""

    def __init__(self, token: str) -> None:
        self.entry = (TOKEN_METADATA, _BEARER + token)

    async def intercept_unary_unary(
        self, continuation: Any, client_call_details: Any, request: Any
    ) -> Any:
        metadata = list(client_call_details.metadata or ())
        metadata.append(self.entry)
        details = client_call_details._replace(metadata=metadata)
        return await continuation(details, request)


class _StreamTokenInterceptor(grpc.aio.StreamUnaryClientInterceptor):  # type: ignore[misc]
    """The same for client-streaming calls (``ReportObjects``)."""

    def __init__(self, token: str) -> None:
        self.entry = (TOKEN_METADATA, _BEARER + token)

    async def intercept_stream_unary(
        self, continuation: Any, client_call_details: Any, request_iterator: Any
    ) -> Any:
        metadata = list(client_call_details.metadata or ())
        metadata.append(self.entry)
        details = client_call_details._replace(metadata=metadata)
        return await continuation(details, request_iterator)


def channel_options() -> list[tuple[str, int]]:
    return list(RECONNECT_OPTIONS)


def aio_channel(target: str, *, token: str | None = None, tls_ca: str = "") -> grpc.aio.Channel:
    """An asyncio gRPC channel to the meta: TLS when ``tls_ca`` names the CA
    certificate, the token (if any) on every call, fast reconnects."""
    interceptors = [_TokenInterceptor(token), _StreamTokenInterceptor(token)] if token else None
    options = channel_options()
    if tls_ca:
        creds = grpc.ssl_channel_credentials(root_certificates=_read_pem(tls_ca, "TLS CA"))
        return grpc.aio.secure_channel(target, creds, options=options, interceptors=interceptors)
    return grpc.aio.insecure_channel(target, options=options, interceptors=interceptors)


def sync_channel(target: str, *, tls_ca: str = "") -> grpc.Channel:
    """A blocking gRPC channel (CLI, tests); pass the token per call with
    :func:`call_metadata`."""
    options = channel_options()
    if tls_ca:
        creds = grpc.ssl_channel_credentials(root_certificates=_read_pem(tls_ca, "TLS CA"))
        return grpc.secure_channel(target, creds, options=options)
    return grpc.insecure_channel(target, options=options)


def call_metadata(token: str | None) -> list[tuple[str, str]]:
    return [(TOKEN_METADATA, _BEARER + token)] if token else []


def summary(
    cluster_token_file: str,
    tenants_file: str,
    tls_cert: str,
    env: Mapping[str, str] | None = None,
) -> str:
    """One line for operators: what the meta with these settings authenticates."""
    parts = []
    if cluster_token_file or (os.environ if env is None else env).get(CLUSTER_TOKEN_ENV):
        parts.append("cluster token")
    if tenants_file:
        parts.append("tenant tokens")
    if tls_cert:
        parts.append("gRPC TLS")
    if not parts:
        return (
            "none: runs without authentication (no cluster or tenant tokens, no TLS); "
            "anyone who can reach these ports may use and administer the cache"
        )
    return ", ".join(parts)
