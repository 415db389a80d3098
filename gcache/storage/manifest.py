"""The server's DRAM manifest: the owner's record of every object committed in its
segment, so a restarted server (clean or ``kill -9``) re-adopts the segment file it
left in the tmpfs and reports what it holds.

The meta sends each committed object's record in a heartbeat reply (``adopt``) and
each freed range (``free``); the server appends them to a log next to the segment
file (the same tmpfs: it survives the process, not a reboot, exactly like the
segment it describes). Every log entry is one frame::

    u32 body length | u32 CRC-32 of the body | body (MessagePack)

A frame that is cut short or fails its CRC ends the replay (a torn tail after a
``kill -9``, or damage): it and everything after it are dropped, so those objects
are simply not re-adopted (a miss, never wrong bytes). Each ``ADD`` also carries
``xxh3_64`` of the object's bytes, taken when the server recorded it; at start every
replayed record is checked against the segment and dropped when the bytes differ.

The log is compacted (the live records rewritten to a new file, then renamed over
the old one) when it holds more than twice the live records plus
:data:`COMPACT_SLACK` bytes, so it stays proportional to what the segment holds.
"""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Iterator
from typing import Final

import msgspec
import xxhash

from gcache.errors import GCacheError

_FRAME: Final = struct.Struct("<II")
MAX_FRAME: Final = 1 << 20
COMPACT_SLACK: Final = 1 << 20
KIND_ADD: Final = 1
KIND_FREE: Final = 2
KIND_OWNER: Final = 3  # first frame of every log: whose segment this is


class StoredRecord(msgspec.Struct, array_like=True):
    """One object a server holds (the owner's record; the wire twin is
    ``StoredObject`` in proto/gcache.proto)."""

    namespace: bytes
    key: bytes
    parent: bytes
    pos: int
    group: int
    tier: int
    offset: int
    length: int
    sums: bytes
    seq: int
    digest: int = 0  # xxh3_64 of the object's bytes when recorded


class _Entry(msgspec.Struct, array_like=True):
    kind: int
    rec: StoredRecord | None = None
    offset: int = 0
    length: int = 0
    owner: str = ""


_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(_Entry).decode


def frame(entry: _Entry) -> bytes:
    body = _encode(entry)
    return _FRAME.pack(len(body), zlib.crc32(body)) + body


def replay(data: bytes | memoryview) -> tuple[list[_Entry], int, int]:
    """Entries of a log, the bytes of its good prefix, and the count of bad frames
    met (0 or 1: the replay stops at the first one)."""
    view = memoryview(data)
    pos = 0
    out: list[_Entry] = []
    while pos + _FRAME.size <= len(view):
        n, crc = _FRAME.unpack_from(view, pos)
        body = view[pos + _FRAME.size : pos + _FRAME.size + n]
        if n > MAX_FRAME or len(body) < n or zlib.crc32(body) != crc:
            return out, pos, 1
        try:
            out.append(_decode(body))
        except msgspec.DecodeError:
            return out, pos, 1
        pos += _FRAME.size + n
    return out, pos, int(pos < len(view))


def _size(rec: StoredRecord) -> int:
    return _FRAME.size + len(_encode(_Entry(KIND_ADD, rec)))


def read_owner(path: str) -> str | None:
    """The owner named by the log at ``path`` (None: no log, or a damaged one)."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(4096)
    except OSError:
        return None
    entries, _, _ = replay(head)
    if entries and entries[0].kind == KIND_OWNER:
        return entries[0].owner
    return None


def digest(view: memoryview) -> int:
    return xxhash.xxh3_64_intdigest(view)


class Manifest:
    """Live records by segment offset, persisted in an append log at ``path``.

    Synchronous and small: the daemon calls :meth:`apply` with a heartbeat's
    ``free`` and ``adopt`` lists; each call is one ``write`` of its frames."""

    __slots__ = (
        "_fd",
        "_live",
        "_log_bytes",
        "bad_frames",
        "dropped",
        "owner",
        "path",
        "records",
        "seq",
        "writes",
    )

    def __init__(self, path: str, owner: str = "") -> None:
        self.path = path
        self.owner = owner  # "server_id@meta": a log of another owner is not replayed
        self.records: dict[int, StoredRecord] = {}
        self.seq = 0
        self.bad_frames = 0  # torn or damaged frames met at start
        self.dropped = 0  # records dropped at start (bytes changed, out of range)
        self.writes = 0
        self._fd = -1
        self._log_bytes = 0
        self._live = 0  # bytes the live records take in a compacted log

    # ---- start -------------------------------------------------------------------

    def load(self) -> None:
        """Replay the log (if any); the records are kept but not yet checked
        against the segment (:meth:`verify`)."""
        try:
            with open(self.path, "rb") as fh:
                data = fh.read()
        except FileNotFoundError:
            data = b""
        except OSError as exc:
            raise GCacheError(f"cannot read the manifest {self.path}: {exc.strerror}") from exc
        entries, _good, bad = replay(data)
        self.bad_frames += bad
        if not entries or entries[0].kind != KIND_OWNER or entries[0].owner != self.owner:
            entries = []  # another server's (or a damaged) log: nothing to re-adopt
        for e in entries:
            if e.kind == KIND_ADD and e.rec is not None:
                self.records.pop(e.rec.offset, None)
                self.records[e.rec.offset] = e.rec
                self.seq = max(self.seq, e.rec.seq)
            elif e.kind == KIND_FREE:
                self._forget(e.offset, e.length)

    def verify(self, segment: memoryview | None) -> int:
        """Keep the records whose bytes in ``segment`` still hash to their digest;
        with no segment (it could not be re-adopted) drop them all. Then rewrite
        the log with what survives. Returns the records kept."""
        keep: dict[int, StoredRecord] = {}
        for off, rec in self.records.items():
            if (
                segment is not None
                and rec.tier == 0
                and off >= 0
                and off + rec.length <= len(segment)
                and digest(segment[off : off + rec.length]) == rec.digest
            ):
                keep[off] = rec
            else:
                self.dropped += 1
        self.records = keep
        self._rewrite()
        return len(keep)

    # ---- running -----------------------------------------------------------------

    def apply(
        self,
        free: list[tuple[int, int]],
        adopt: list[StoredRecord],
        segment: memoryview | None = None,
    ) -> int:
        """Drop the freed ranges' records, then record the adopted objects (their
        digest is taken from ``segment`` when given). One append. Returns the
        adopted records kept (those inside the segment)."""
        out = bytearray()
        for off, length in free:
            if self._forget(off, length):
                out += frame(_Entry(KIND_FREE, None, off, length))
        kept = 0
        for rec in adopt:
            if segment is not None:
                if not (rec.offset >= 0 and rec.offset + rec.length <= len(segment)):
                    self.dropped += 1
                    continue
                rec.digest = digest(segment[rec.offset : rec.offset + rec.length])
            self.seq += 1
            rec.seq = self.seq
            self._forget(rec.offset, rec.length)
            self.records[rec.offset] = rec
            self._live += _size(rec)
            out += frame(_Entry(KIND_ADD, rec))
            kept += 1
        if out:
            self._append(out)
        if self._log_bytes > 2 * self._live + COMPACT_SLACK:
            self._rewrite()
        return kept

    def _forget(self, offset: int, length: int) -> bool:
        """Drop the record of the object at ``offset`` (the meta frees whole
        objects: a range is freed exactly as it was placed)."""
        rec = self.records.get(offset)
        if rec is None or rec.length > length:
            return False
        del self.records[offset]
        self._live -= _size(rec)
        return True

    def _append(self, data: bytes | bytearray) -> None:
        if self._fd < 0:
            self._rewrite()
        try:
            os.write(self._fd, data)
        except OSError as exc:
            raise GCacheError(f"cannot append to the manifest {self.path}: {exc}") from exc
        self._log_bytes += len(data)
        self.writes += 1

    def _rewrite(self) -> None:
        """Write the live records to a new log and rename it over the old one
        (atomic: a crash leaves either log whole)."""
        tmp = self.path + ".tmp"
        body = frame(_Entry(KIND_OWNER, owner=self.owner)) + b"".join(
            frame(_Entry(KIND_ADD, r)) for r in self.records.values()
        )
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.write(fd, body)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, self.path)
            if self._fd >= 0:
                os.close(self._fd)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        except OSError as exc:
            raise GCacheError(f"cannot write the manifest {self.path}: {exc}") from exc
        self._log_bytes = self._live = len(body)

    def __iter__(self) -> Iterator[StoredRecord]:
        return iter(self.records.values())

    def __len__(self) -> int:
        return len(self.records)

    def close(self, remove: bool = False) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if remove:
            for p in (self.path, self.path + ".tmp"):
                try:
                    os.unlink(p)
                except FileNotFoundError:
                    pass

    def stats(self) -> dict[str, int]:
        return {
            "records": len(self.records),
            "log_bytes": self._log_bytes,
            "appends": self.writes,
            "bad_frames": self.bad_frames,
            "dropped": self.dropped,
        }
