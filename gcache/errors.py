"""The GCache exception tree.

Every error a GCache component raises on purpose derives from :class:`GCacheError`.
Foreign exceptions (``OSError``, ``msgspec.DecodeError``, ``grpc.RpcError``) are
translated at each boundary with ``raise ... from`` so callers catch one family::

    GCacheError
    ├── ConfigError            bad settings, flags, env vars or config file
    ├── BindError              a daemon cannot listen on a configured address
    ├── LayoutError            a layout spec is invalid, or data does not match it
    ├── ProtocolError          bytes on the wire are malformed (bad magic, version,
    │   │                      length, body); the connection cannot continue
    │   └── InvalidBody        a whole frame whose body breaks the schema; the
    │                          stream is still in step (the meta answers and goes on)
    ├── RemoteError            the peer understood the request and refused it; it
    │   │                      carries the peer's error ``code`` and message and the
    │   │                      connection stays usable
    │   ├── UnknownNamespace
    │   ├── NoSpace
    │   ├── AccessDenied       a range not covered by a valid capability
    │   └── Busy               the daemon refused the connection (connection limits)
    ├── ConnectionLost         the *peer* broke the connection (EOF, reset, timeout)
    │   └── SendTimeout        the peer accepted no bytes of a reply for
    │                          ``send_timeout_s`` (it stopped reading)
    ├── ClosedError            *you* closed this object and then used it
    └── IntegrityError         bytes read back do not match their checksum

"You closed it" (:class:`ClosedError`) is kept apart from "the peer broke it"
(:class:`ConnectionLost`): the first is a bug in the caller, the second is an
operational event the client turns into a cache miss.

The client library never lets :class:`ConnectionLost`, :class:`RemoteError` or
:class:`IntegrityError` reach an inference engine from a read path: those become
misses. Misuse (wrong buffer shapes, a closed client) still raises.
"""

from __future__ import annotations


class GCacheError(Exception):
    """Base of every error GCache raises on purpose."""


class ConfigError(GCacheError):
    """Invalid configuration value, flag, env var or file."""


class BindError(GCacheError):
    """A listener cannot bind its configured address (in use, not on this host)."""


class LayoutError(GCacheError):
    """A layout spec is invalid or tensors do not match it."""


class CompactIndexError(GCacheError):
    """A call that breaks the compact index's contract (gcache/meta/compact.py:
    an unknown id, a block with children removed, a key not 16 bytes)."""


class ProtocolError(GCacheError):
    """Malformed bytes on the wire; the connection cannot continue."""


class InvalidBody(ProtocolError):
    """A well-framed body whose values break the schema (a 15-byte block key, say).
    The frame was read whole, so the stream is still in step: a server may answer
    with an error and go on."""


class RemoteError(GCacheError):
    """The peer refused a well-formed request. The connection stays usable."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"[{code}] {message}")
        self.code = code
        self.message = message


class UnknownNamespace(RemoteError):
    pass


class NoSpace(RemoteError):
    pass


class AccessDenied(RemoteError):
    pass


class Busy(RemoteError):
    """The daemon is at a connection limit and refused this connection."""


class NoInstance(RemoteError):
    """The router has no live engine instance to route to."""


class NotLeader(RemoteError):
    """This meta is a standby (or a leader that cannot confirm its lease): the
    message names the leader (``gcache.leader.parse_redirect``)."""


class ConnectionLost(GCacheError):
    """The peer closed or reset the connection, or it timed out."""


class SendTimeout(ConnectionLost):
    """A send waited longer than the stream's send timeout for the peer to take
    any byte (a peer that stopped reading its replies)."""


class ClosedError(GCacheError):
    """This object was closed by its owner and then used."""


class IntegrityError(GCacheError):
    """Data read back does not match its checksum."""


# Error codes carried in ``wire.Error`` bodies. Stable: part of the protocol.
E_BAD_REQUEST = 1
E_UNKNOWN_NAMESPACE = 2
E_NO_SPACE = 3
E_ACCESS_DENIED = 4
E_OUT_OF_RANGE = 5
E_UNKNOWN_PUT = 6
E_UNKNOWN_SERVER = 7
E_BUSY = 8  # connection refused at a connection limit (sent with request id 0)
E_NO_INSTANCE = 9  # gcache-router: no live engine instance to route to
E_NOT_LEADER = 10  # a standby meta: "not the leader; leader hot=H:P grpc=H:P"
E_INTERNAL = 99

_BY_CODE: dict[int, type[RemoteError]] = {
    E_UNKNOWN_NAMESPACE: UnknownNamespace,
    E_NO_SPACE: NoSpace,
    E_ACCESS_DENIED: AccessDenied,
    E_OUT_OF_RANGE: AccessDenied,
    E_BUSY: Busy,
    E_NO_INSTANCE: NoInstance,
    E_NOT_LEADER: NotLeader,
}


def remote_error(code: int, message: str) -> RemoteError:
    """Build the most specific :class:`RemoteError` for a wire error code."""
    return _BY_CODE.get(code, RemoteError)(code, message)


class Refusal(Exception):
    """Raised inside a daemon's sync core to refuse one request.

    The I/O layer turns it into a ``wire.Error`` frame; it never escapes a daemon.
    """

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class PutWait(Refusal):
    """A put found DRAM full while demotions in flight will make its room:
    the meta's hot path holds it and places it again when they are reported (at
    most ``meta.put_wait_s``). Anything that does not wait answers it ``E_BUSY``."""

    def __init__(self, message: str) -> None:
        super().__init__(E_BUSY, message)
