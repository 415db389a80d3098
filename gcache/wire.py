"""The one wire module: frame header, message bodies, encode/decode. No I/O.

A frame is ``header | body | payload``:

* header: ``HEADER`` (24 bytes, network order): magic ``b"GC"``, version, message
  type, flags, reserved, request id, body length, payload length;
* body: one typed MessagePack struct (``msgspec``), chosen by the message type;
* payload: raw bytes (``WRITE`` requests and ``READ`` replies only), never decoded,
  moved straight between sockets and the segment.

The data plane (``gcache-server``) and the meta's hot path share this module.
Decoding validates everything a peer controls; any violation raises
:class:`~gcache.errors.ProtocolError`, after which the connection is closed.
"""

from __future__ import annotations

import struct
from typing import Annotated, Any, Final

import msgspec

from gcache.errors import InvalidBody, ProtocolError

MAGIC: Final = 0x4743  # "GC"
VERSION: Final = 1
HEADER: Final = struct.Struct("!HBBHHIIQ")
HEADER_SIZE: Final = HEADER.size
MAX_BODY: Final = 32 << 20
MAX_PAYLOAD: Final = 4 << 30

# Message types. Requests are odd-free; replies use their own numbers.
T_ERROR: Final = 1
T_OK: Final = 2
T_PING: Final = 3
T_WRITE: Final = 10
T_READ: Final = 11
T_READ_DATA: Final = 12
T_SEAL: Final = 13
T_SEALED: Final = 14
T_PUT_BEGIN: Final = 20
T_PUT_PLACED: Final = 21
T_PUT_COMMIT: Final = 22
T_PUT_ABORT: Final = 23
T_LOOKUP: Final = 24
T_LOOKUP_RESULT: Final = 25
T_RELEASE: Final = 26
T_HELLO: Final = 27
# Router hot path (gcache-router speaks the same framing as the meta).
T_ROUTE: Final = 40
T_ROUTED: Final = 41
T_REPORT_HITS: Final = 42
T_REPORT_LOAD: Final = 43
# A server's own counters (its ``stats()``: read buffers, pipelined NVMe replies).
T_SERVER_STATS: Final = 15
T_SERVER_STATS_REPLY: Final = 16
# Tier-1 reads through the server's staging file (same host; gcache/server/staging.py).
T_READ_STAGED: Final = 17
T_STAGED: Final = 18
T_UNSTAGE: Final = 19


# A block key (gcache.keys.KEY_SIZE bytes), checked by the decoder in C: a lookup of
# a 128k-token prompt carries 2048 of them.
BlockKey = Annotated[bytes, msgspec.Meta(min_length=16, max_length=16)]


class Msg(msgspec.Struct, array_like=True, forbid_unknown_fields=False):
    """Base of every body; array-encoded to keep frames small."""


# ---- generic -------------------------------------------------------------------


class Error(Msg):
    code: int
    message: str


class Ok(Msg):
    value: int = 0


class Ping(Msg):
    pass


# ---- data plane ------------------------------------------------------------------


class Grant(Msg):
    """A capability minted by the meta: access to ``[offset, offset+length)`` until
    ``expiry_ms`` (unix ms), authenticated by ``tag`` (keyed BLAKE2b, see
    :mod:`gcache.capability`)."""

    offset: int
    length: int
    expiry_ms: int
    tag: bytes
    # Which tier the range lies in (0 = DRAM segment, 1 = NVMe tier,
    # read-only), and the meta epoch that minted it (a server refuses write
    # grants of an epoch older than the meta it registered with). Both are
    # covered by the tag.
    tier: int = 0
    epoch: int = 0


class ObjectInfo(Msg):
    """The record of the object a write grant was minted for, sent with its
    ``WRITE`` / ``SEAL``: the server checks the grant's tag against
    :func:`gcache.capability.bind_digest` of these fields and appends the record
    (with ``sums``, the per-layer xxh3-64 checksums the writer computed, 8 bytes
    each) to its manifest before it answers the receipt. ``parent``: the key of
    block ``pos - 1`` (``b""`` for block 0); ``layer_bytes``: each layer's length
    when the group's layers differ in size, else empty."""

    namespace: bytes
    key: bytes
    parent: bytes
    pos: int
    group: int
    sums: bytes
    layer_bytes: list[int] = []


class Write(Msg):
    """Write ``payload`` (exactly ``grant.length`` bytes) at ``grant.offset``.
    ``obj``: the object the grant is bound to (every grant the meta mints is);
    None only for an unbound grant, whose write is not recorded."""

    grant: Grant
    obj: ObjectInfo | None = None


class Read(Msg):
    """Scatter-gather read. ``ranges`` are ``(grant index, offset, length)`` with the
    offset absolute in the segment; the reply payload is the ranges in order."""

    grants: list[Grant]
    ranges: list[tuple[int, int, int]]


class ReadData(Msg):
    total: int


class Seal(Msg):
    """Consume write grants whose bytes the client wrote itself (shared memory):
    the server marks each grant used, exactly as a ``WRITE`` does, and answers with
    one receipt per grant (``Sealed``). A used grant cannot write again.
    ``objs``: the object of each grant, index-aligned (as ``Write.obj``); empty
    only when every grant is unbound."""

    grants: list[Grant]
    objs: list[ObjectInfo] = []


class Sealed(Msg):
    """Receipts (``capability.receipt``) of the grants a ``Seal`` consumed, in order."""

    receipts: list[int]


# ---- meta hot path ----------------------------------------------------------------


class ServerAddr(Msg):
    server_id: str
    host: str
    port: int
    hostname: str
    shm_path: str
    incarnation: int = 0  # new on every server start: a client's mapping of an older one is stale
    # Measured by the server at start (GB/s), for the client's load-or-recompute rule.
    dram_read_gbps: float = 0.0
    nvme_read_gbps: float = 0.0


class PutBegin(Msg):
    """Chained keys of the prompt's blocks from block 0, and for each block a bitmask
    of the layout groups the client offers to store. ``checkpoint_from``: the first
    block whose windowed (sliding) rows the client holds, so the meta may ask for
    checkpoint windows from there on; -1 (old clients): only what ``groups`` offers."""

    namespace: bytes
    keys: list[BlockKey]
    groups: list[int]
    checkpoint_from: int = -1


class Placement(Msg):
    block: int
    group: int
    server: int  # index into ``PutPlaced.servers``
    grant: Grant


class PutPlaced(Msg):
    """``checkpoints``: block positions where the meta added a window (the windowed
    objects of the ``tail`` blocks before each) to what the client offered; their
    placements are among ``placements``."""

    put_id: int
    placements: list[Placement]
    servers: list[ServerAddr]
    no_space: int = 0
    checkpoints: list[int] = []


class PutCommit(Msg):
    """``done``: (placement index, per-layer xxh3-64 checksums, 8 bytes each).
    ``receipts``: for each ``done`` entry, in order, the receipt the server returned
    when the placement's write grant was used (``WRITE`` reply value or ``Sealed``)."""

    put_id: int
    done: list[tuple[int, bytes]]
    receipts: list[int] = []


class PutAbort(Msg):
    put_id: int


class Lookup(Msg):
    namespace: bytes
    keys: list[BlockKey]
    lease: bool = False
    # Leases the client is done with, released before the lookup: a client batches
    # its Releases onto its next Lookup instead of paying a message for each.
    release: list[int] = msgspec.field(default_factory=list)


class ObjectLoc(Msg):
    block: int
    group: int
    server: int
    grant: Grant  # grant.tier says which tier the object is on
    sums: bytes


class LookupResult(Msg):
    blocks: int
    tokens: int
    lease_id: int = 0
    objects: list[ObjectLoc] = []
    servers: list[ServerAddr] = []


class Release(Msg):
    lease_id: int
    also: list[int] = msgspec.field(default_factory=list)  # more leases, same message


class Hello(Msg):
    """First frame of an authenticated hot-path connection: a tenant access token.
    Answered with ``Ok``; without it a connection is anonymous (allowed only when
    the meta runs without tenant tokens)."""

    token: str


# ---- router hot path -----------------------------------------------------------------


class Route(Msg):
    """Pick an engine instance for a prompt: its chained block keys (the meta's
    keys for the prompt's namespace) and its length in tokens."""

    keys: list[BlockKey]
    tokens: int
    request_id: str = ""


class Routed(Msg):
    """The choice: instance id and URL, the window-safe blocks it holds locally and
    those the pool adds, the policy's cost and a one-word reason."""

    instance: str
    url: str
    local_blocks: int
    pool_blocks: int
    cost: float
    reason: str


class ReportHits(Msg):
    """After a lookup on ``instance``: tokens of the prompt matched in the
    instance's own memory (``local_tokens``) and fetched from the pool."""

    instance: str
    prompt_tokens: int
    local_tokens: int
    pool_tokens: int


class ReportLoad(Msg):
    """An instance's load now; also its liveness signal."""

    instance: str
    queued: int
    running: int
    tokens_in_flight: int
    active_blocks: int = 0
    url: str = ""


class ServerStats(Msg):
    """Ask a ``gcache-server`` for its counters (answered ``ServerStatsReply``)."""


class ServerStatsReply(Msg):
    values: dict[str, float]


class ReadStaged(Msg):
    """A ``READ`` of tier-1 ranges whose bytes the server reads into its staging
    file instead of the reply (answered ``STAGED``)."""

    grants: list[Grant]
    ranges: list[tuple[int, int, int]]
    # staging ranges of this connection given back first (saves their UNSTAGE)
    release: list[int] = msgspec.field(default_factory=list)


class Staged(Msg):
    """Where a ``READ_STAGED`` landed: the staging file (``path``, mapped by the
    client) and each range's offset in it; copy nothing after ``expiry_ms`` and give
    ``stage_id`` back with ``UNSTAGE``."""

    stage_id: int
    path: str
    offsets: list[int]
    expiry_ms: int


class Unstage(Msg):
    stage_ids: list[int]


BODY_TYPES: Final[dict[int, type[Msg]]] = {
    T_ERROR: Error,
    T_OK: Ok,
    T_PING: Ping,
    T_WRITE: Write,
    T_READ: Read,
    T_READ_DATA: ReadData,
    T_SEAL: Seal,
    T_SEALED: Sealed,
    T_PUT_BEGIN: PutBegin,
    T_PUT_PLACED: PutPlaced,
    T_PUT_COMMIT: PutCommit,
    T_PUT_ABORT: PutAbort,
    T_LOOKUP: Lookup,
    T_LOOKUP_RESULT: LookupResult,
    T_RELEASE: Release,
    T_HELLO: Hello,
    T_ROUTE: Route,
    T_ROUTED: Routed,
    T_REPORT_HITS: ReportHits,
    T_REPORT_LOAD: ReportLoad,
    T_SERVER_STATS: ServerStats,
    T_SERVER_STATS_REPLY: ServerStatsReply,
    T_READ_STAGED: ReadStaged,
    T_STAGED: Staged,
    T_UNSTAGE: Unstage,
}
TYPE_OF: Final[dict[type[Msg], int]] = {v: k for k, v in BODY_TYPES.items()}
_DECODERS: Final = {t: msgspec.msgpack.Decoder(cls) for t, cls in BODY_TYPES.items()}
# Frames that may carry a payload; any other frame with payload_len > 0 is rejected.
PAYLOAD_TYPES: Final = frozenset({T_WRITE, T_READ_DATA})


class FrameHead(msgspec.Struct, frozen=True):
    msg_type: int
    flags: int
    req_id: int
    body_len: int
    payload_len: int


def parse_header(buf: bytes | bytearray | memoryview) -> FrameHead:
    """Validate and unpack one header. Raises :class:`ProtocolError`."""
    if len(buf) < HEADER_SIZE:
        raise ProtocolError(f"truncated header: {len(buf)} of {HEADER_SIZE} bytes")
    magic, version, msg_type, flags, _res, req_id, body_len, payload_len = HEADER.unpack_from(buf)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic 0x{magic:04x}")
    if version != VERSION:
        raise ProtocolError(f"unsupported protocol version {version} (speaks {VERSION})")
    if msg_type not in BODY_TYPES:
        raise ProtocolError(f"unknown message type {msg_type}")
    if body_len > MAX_BODY:
        raise ProtocolError(f"body length {body_len} exceeds {MAX_BODY}")
    if payload_len and msg_type not in PAYLOAD_TYPES:
        raise ProtocolError(f"message type {msg_type} cannot carry a payload")
    if payload_len > MAX_PAYLOAD:
        raise ProtocolError(f"payload length {payload_len} exceeds {MAX_PAYLOAD}")
    return FrameHead(msg_type, flags, req_id, body_len, payload_len)


def decode_body(msg_type: int, body: bytes | bytearray | memoryview) -> Any:
    """Decode and type-check a body for ``msg_type``. Raises :class:`ProtocolError`."""
    try:
        return _DECODERS[msg_type].decode(body)
    except msgspec.ValidationError as exc:
        raise InvalidBody(f"invalid body for message type {msg_type}: {exc}") from exc
    except (msgspec.DecodeError, KeyError, RecursionError) as exc:
        raise ProtocolError(f"bad body for message type {msg_type}: {exc}") from exc


class FrameEncoder:
    """Packs header + body into one reused buffer (no per-frame allocation)."""

    __slots__ = ("_buf", "_enc")

    def __init__(self, initial: int = 4096) -> None:
        self._buf = bytearray(initial)
        self._enc = msgspec.msgpack.Encoder()

    def encode(self, msg: Msg, req_id: int = 0, payload_len: int = 0) -> memoryview:
        """Return a view of ``header|body`` in the reused buffer. The caller must
        release it (or drop every reference) before the next ``encode``: the buffer
        cannot be resized while a view is exported (``BufferError``)."""
        buf = self._buf
        self._enc.encode_into(msg, buf, HEADER_SIZE)
        body_len = len(buf) - HEADER_SIZE
        HEADER.pack_into(
            buf, 0, MAGIC, VERSION, TYPE_OF[type(msg)], 0, 0, req_id, body_len, payload_len
        )
        return memoryview(buf)[: HEADER_SIZE + body_len]

    def encode_bytes(self, msg: Msg, req_id: int = 0, payload_len: int = 0) -> bytes:
        """Like :meth:`encode` but returns an owned copy (for queued frames)."""
        with self.encode(msg, req_id, payload_len) as view:
            return bytes(view)


def pack_frame(msg: Msg, req_id: int = 0, payload_len: int = 0) -> bytes:
    """One-off frame as bytes (tests, tools). Hot paths use :class:`FrameEncoder`."""
    return FrameEncoder(256).encode_bytes(msg, req_id, payload_len)
