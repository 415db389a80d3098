"""Capabilities: what lets a client touch a byte range of a server's segment.

The meta owns placement (it runs the allocator of every segment), so a server does
not know which ranges hold which objects. Instead the meta mints, for each range it
hands out, a tag ``BLAKE2b-64(secret, kind|offset|length|expiry)`` keyed with a secret
the server sent at registration. The server checks the tag, the expiry and that
every accessed byte lies inside the granted range: RDMA's rkey, for TCP. Write
grants are minted by ``PutBegin`` for freshly allocated ranges; read grants by a
leased ``Lookup`` for committed objects only, and they expire with the lease.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Final

KIND_READ: Final = b"R"
KIND_WRITE: Final = b"W"
_MSG: Final = struct.Struct("!cQQQBQ")
TAG_SIZE: Final = 8


def mint(
    secret: bytes,
    kind: bytes,
    offset: int,
    length: int,
    expiry_ms: int,
    tier: int = 0,
    epoch: int = 0,
) -> bytes:
    """The tag of a grant; ``tier`` (0 DRAM, 1 NVMe) and the minting meta's
    ``epoch`` are covered, so neither can be changed by the holder."""
    return hashlib.blake2b(
        _MSG.pack(kind, offset, length, expiry_ms, tier, epoch), key=secret, digest_size=TAG_SIZE
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
) -> bool:
    """Constant-time comparison of a presented tag with the expected one."""
    import hmac

    return hmac.compare_digest(mint(secret, kind, offset, length, expiry_ms, tier, epoch), tag)


KIND_DONE: Final = b"D"


def receipt(secret: bytes, offset: int, length: int, expiry_ms: int) -> int:
    """Proof that a server consumed the write grant ``(offset, length, expiry_ms)``:
    the server returns it when a ``WRITE`` (or ``SEAL``) used the grant, the client
    hands it to the meta in ``PutCommit``, and the meta, which knows ``secret``,
    commits only placements whose grant was consumed (so no grant of a committed
    put can write again). 64 bits, unsigned."""
    return int.from_bytes(mint(secret, KIND_DONE, offset, length, expiry_ms), "big")
