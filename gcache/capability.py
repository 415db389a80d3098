"""Capabilities: what lets a client touch a byte range of a server's segment.

The meta owns placement (it runs the allocator of every segment), so a server does
not know which ranges hold which objects. Instead the meta mints, for each range it
hands out, a tag ``BLAKE2b-64(secret, kind|offset|length|expiry)`` keyed with a secret
the server sent at registration. The server checks the tag, the expiry and that
every accessed byte lies inside the granted range: RDMA's rkey, for TCP. Write
grants are minted by ``PutBegin`` for freshly allocated ranges; read grants by a
leased ``Lookup`` for committed objects only, and they expire with the lease.

A write grant is also bound to the one object it may write: its tag covers
:func:`bind_digest` of the object's record (namespace, block key, parent key,
position, group, per-layer lengths). The writer sends that record with its
``WRITE`` / ``SEAL``; the server recomputes the digest from it, so a grant checks
only with the record the meta minted it for, and the server can append that record
to its manifest before it answers the receipt (the commit is durable on the server
before the meta acknowledges it). Read grants carry no binding (``bind=b""``).
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from typing import Final

KIND_READ: Final = b"R"
KIND_WRITE: Final = b"W"
_MSG: Final = struct.Struct("!cQQQBQ")
TAG_SIZE: Final = 8
BIND_SIZE: Final = 16
_BIND_HEAD: Final = struct.Struct("!HHHQIH")


def bind_digest(
    namespace: bytes,
    key: bytes,
    parent: bytes,
    pos: int,
    group: int,
    layer_bytes: tuple[int, ...] | list[int] = (),
) -> bytes:
    """The 16-byte digest a write grant is bound to: BLAKE2b-128 of a canonical
    encoding of the object's record (length-prefixed fields, so no two records
    encode alike). The meta mints with it; the server recomputes it from the record
    a ``WRITE`` / ``SEAL`` carries."""
    if not 0 <= pos < 1 << 64 or not 0 <= group < 1 << 32 or len(layer_bytes) >= 1 << 16:
        return b""  # never equal to a minted digest: the grant fails its check
    h = hashlib.blake2b(
        _BIND_HEAD.pack(len(namespace), len(key), len(parent), pos, group, len(layer_bytes)),
        digest_size=BIND_SIZE,
    )
    h.update(namespace)
    h.update(key)
    h.update(parent)
    if layer_bytes:
        try:
            h.update(struct.pack(f"!{len(layer_bytes)}Q", *layer_bytes))
        except struct.error:
            return b""
    return h.digest()


def mint(
    secret: bytes,
    kind: bytes,
    offset: int,
    length: int,
    expiry_ms: int,
    tier: int = 0,
    epoch: int = 0,
    bind: bytes = b"",
) -> bytes:
    """The tag of a grant; ``tier`` (0 DRAM, 1 NVMe), the minting meta's ``epoch``
    and, for a write grant, the object it may write (``bind``, :func:`bind_digest`)
    are covered, so none can be changed by the holder."""
    return hashlib.blake2b(
        _MSG.pack(kind, offset, length, expiry_ms, tier, epoch) + bind,
        key=secret,
        digest_size=TAG_SIZE,
    ).digest()


def check(
    secret: bytes,
    kind: bytes,
    offset: int,
    length: int,
    expiry_ms: int,
    tag: bytes,
    tier: int = 0,
    epoch: int = 0,
    bind: bytes = b"",
) -> bool:
    """Constant-time comparison of a presented tag with the expected one."""
    return hmac.compare_digest(
        mint(secret, kind, offset, length, expiry_ms, tier, epoch, bind), tag
    )


KIND_DONE: Final = b"D"


def receipt(secret: bytes, offset: int, length: int, expiry_ms: int) -> int:
    """Proof that a server consumed the write grant ``(offset, length, expiry_ms)``:
    the server returns it when a ``WRITE`` (or ``SEAL``) used the grant, the client
    hands it to the meta in ``PutCommit``, and the meta, which knows ``secret``,
    commits only placements whose grant was consumed (so no grant of a committed
    put can write again). 64 bits, unsigned."""
    return int.from_bytes(mint(secret, KIND_DONE, offset, length, expiry_ms), "big")
