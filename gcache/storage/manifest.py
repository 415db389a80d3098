# One file (over 450 lines): the frame format, its writer and its replay share one layout.
"""The server's DRAM manifest: the owner's record of every object written and
committed in its segment, so a restarted server (clean or ``kill -9``) re-adopts the
segment file it left in the tmpfs and reports what it holds, and a restarted meta
rebuilds its index from those reports.

A client's write records its object: the ``WRITE`` / ``SEAL`` carries the record
its write grant is bound to (:func:`gcache.capability.bind_digest`), and the server
appends it here (:meth:`Manifest.record_writes`) before it answers the receipt
the meta needs to commit, so every acknowledged commit is in this log. A write
drops every record its range overlaps: a valid write grant on a range means the
meta holds that range free of live objects. The meta also sends each freed range
(``free``; and, for in-process drivers, committed records as ``adopt``) in
heartbeat replies. The log lives next to the segment file (the same tmpfs: it
survives the process, not a reboot, exactly like the segment it describes). Every
log entry is one frame::

    u32 body length | u32 CRC-32 of the body | body (MessagePack)

A heartbeat reply's ``free`` may be older than a write to the same range: the meta
freed the range, placed a new object there, and the new object's write reached
the server before the reply carrying the free. So a free drops only records
written before the server sent the last heartbeat answered before that reply
(every free in a reply was made after the meta built the previous reply, which
was after that heartbeat was sent); a record it spares is at worst stale: its
bytes are the object's own or fail their checksums (a miss, never wrong bytes),
and the next write over its range drops it.

A frame that is cut short or fails its CRC ends the replay (a torn tail after a
``kill -9``, or damage): it and everything after it are dropped, so those objects
are simply not re-adopted (a miss, never wrong bytes). Each ``ADD`` carries the
object's per-layer checksums (``sums``: the ones its putter computed and every reader
verifies); recording an object reads none of its bytes. At start every replayed
record is checked against the segment (:meth:`Manifest.verify`, on a worker thread,
:data:`VERIFY_BATCH` bytes per call of the shared checksum function,
:func:`gcache._native.checksums`) and dropped when its bytes differ. The server does
not know the layout: an object of ``n`` checksums is split into the layer lengths
its record carries (``layer_bytes``, sent when a group's layers differ in size),
else into ``n`` equal layers; a record whose lengths do not add up fails the check
and is dropped (a miss). Logs of older servers (no ``layer_bytes``) are read as
before: their objects of unequal layers were never re-adoptable.

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
from sortedcontainers import SortedList

from gcache import _native
from gcache.errors import GCacheError
from gcache.storage.record import StoredRecord

_FRAME: Final = struct.Struct("<II")
MAX_FRAME: Final = 1 << 20
COMPACT_SLACK: Final = 1 << 20
KIND_ADD: Final = 1
KIND_FREE: Final = 2
KIND_OWNER: Final = 3  # first frame of every log: whose segment this is
VERIFY_BATCH: Final = 64 << 20  # bytes checked per checksum call at start


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


def layers(rec: StoredRecord, segment: memoryview) -> list[memoryview] | None:
    """The object's layers in ``segment``: ``rec.layer_bytes`` when the record has
    them, else ``len(sums) / 8`` equal parts; None when the record cannot be checked
    (outside the segment, no checksums, layer lengths that do not add up to its
    length, a length that does not split evenly)."""
    n = len(rec.sums) // 8
    off, length = rec.offset, rec.length
    if (
        rec.tier != 0
        or n == 0
        or len(rec.sums) % 8
        or length <= 0
        or off < 0
        or off + length > len(segment)
    ):
        return None
    sizes = rec.layer_bytes
    if sizes:
        if len(sizes) != n or sum(sizes) != length or min(sizes) <= 0:
            return None
        out = []
        for size in sizes:
            out.append(segment[off : off + size])
            off += size
        return out
    if length % n:
        return None
    step = length // n
    return [segment[off + i * step : off + (i + 1) * step] for i in range(n)]


class Manifest:
    """Live records by segment offset, persisted in an append log at ``path``.

    Synchronous and small: the daemon calls :meth:`apply` with a heartbeat's
    ``free`` and ``adopt`` lists; each call is one ``write`` of its frames."""

    __slots__ = (
        "_answered",
        "_fd",
        "_live",
        "_log_bytes",
        "_stamp",
        "_starts",
        "bad_frames",
        "beats",
        "dropped",
        "overlaps_dropped",
        "owner",
        "path",
        "records",
        "seq",
        "spared_frees",
        "verified_bytes",
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
        self.verified_bytes = 0  # bytes checked and kept at start
        self._fd = -1
        self._log_bytes = 0
        self._live = 0  # bytes the live records take in a compacted log
        self._starts = SortedList()  # offsets of ``records`` (overlap checks)
        # Heartbeats sent, and how many had been sent when the last answered one
        # was; a written record's stamp is ``beats`` when it was written (see the
        # module doc: which frees may drop it).
        self.beats = 0
        self._answered = 0
        self._stamp: dict[int, int] = {}
        self.overlaps_dropped = 0  # records dropped because a write overlapped them
        self.spared_frees = 0  # frees older than the record at their offset

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
                self._insert(e.rec, count=False)
                self.seq = max(self.seq, e.rec.seq)
            elif e.kind == KIND_FREE:
                self._forget(e.offset, e.length)

    def verify(self, segment: memoryview | None, batch: int = VERIFY_BATCH) -> int:
        """Keep the records whose layers in ``segment`` still match their checksums;
        with no segment (it could not be re-adopted) drop them all. Then rewrite
        the log with what survives. Returns the records kept.

        Reads every recorded byte once: a restart runs it on a worker thread
        (:meth:`gcache.server.tiers.TierState.open`), ``batch`` bytes per call of the
        checksum function (views of the segment, no copies)."""
        keep: dict[int, StoredRecord] = {}
        pending: list[StoredRecord] = []
        pieces: list[memoryview] = []
        size = 0

        def check() -> None:
            nonlocal size
            if pieces:
                got = _native.checksums(pieces, 1)
                want = b"".join(r.sums for r in pending)
                if got == want:
                    keep.update((r.offset, r) for r in pending)
                else:  # a damaged object in the batch: find it
                    for r in pending:
                        parts = layers(r, segment) if segment is not None else None
                        if parts is not None and _native.checksums(parts, 1) == r.sums:
                            keep[r.offset] = r
                        else:
                            self.dropped += 1
            pending.clear()
            pieces.clear()
            size = 0

        for rec in self.records.values():
            parts = layers(rec, segment) if segment is not None else None
            if parts is None:
                self.dropped += 1
                continue
            pending.append(rec)
            pieces.extend(parts)
            size += rec.length
            if size >= batch:
                check()
        check()
        self.records = keep
        self._starts = SortedList(keep)
        self._stamp.clear()
        self.verified_bytes = sum(r.length for r in keep.values())
        self._rewrite()
        return len(keep)

    # ---- running -----------------------------------------------------------------

    def apply(
        self,
        free: list[tuple[int, int]],
        adopt: list[StoredRecord],
        segment: memoryview | None = None,
    ) -> int:
        """Drop the freed ranges' records (a record written after the last answered
        heartbeat was sent is spared: the free may be older than it), then record
        the adopted objects with the checksums they carry (their bytes are not
        read: that is the restart's job, :meth:`verify`); with ``segment``, one
        outside it is not recorded. One append. Returns the adopted records kept."""
        out = bytearray()
        before = self._answered
        for off, length in free:
            if self._forget(off, length, before):
                out += frame(_Entry(KIND_FREE, None, off, length))
        kept = 0
        for rec in adopt:
            if segment is not None and not (0 <= rec.offset <= len(segment) - rec.length):
                self.dropped += 1
                continue
            self.seq += 1
            rec.seq = self.seq
            self._insert(rec)
            out += frame(_Entry(KIND_ADD, rec))
            kept += 1
        if out:
            self._append(out)
        self._maybe_compact()
        return kept

    def record_writes(self, recs: list[StoredRecord]) -> None:
        """Record objects just written under their bound write grants (one
        ``WRITE``, or every grant of one ``SEAL``): each drops the records its
        range overlaps, and all of them go out in one append, which must succeed
        before the server answers the receipts (raises :class:`GCacheError`)."""
        out = bytearray()
        stamp = self.beats
        for rec in recs:
            self.seq += 1
            rec.seq = self.seq
            self.overlaps_dropped += self._insert(rec)
            self._stamp[rec.offset] = stamp
            out += frame(_Entry(KIND_ADD, rec))
        if out:
            self._append(out)
        self._maybe_compact()

    def beat_sent(self) -> None:
        """A heartbeat is going to the meta."""
        self.beats += 1

    def beat_answered(self) -> None:
        """The reply to the heartbeat last sent was applied: frees in later replies
        were made after it was sent (one heartbeat is in flight at a time)."""
        self._answered = self.beats

    def registered(self) -> None:
        """Registered with a meta (it gets every record in the report that follows,
        and grants of older metas are refused from now on): a free from it may drop
        any record it was reported."""
        self._stamp.clear()

    def _maybe_compact(self) -> None:
        if self._log_bytes > 2 * self._live + COMPACT_SLACK:
            self._rewrite()

    def _insert(self, rec: StoredRecord, count: bool = True) -> int:
        """Make ``rec`` the record of its range, dropping every record that range
        overlaps (``count``: keep the live-bytes tally, which a replay at start
        need not: :meth:`verify` rewrites the log). Returns the records dropped."""
        starts, records = self._starts, self.records
        lo, hi = rec.offset, rec.offset + rec.length
        i = starts.bisect_left(lo)
        if i and (prev := records[starts[i - 1]]).offset + prev.length > lo:
            i -= 1
        over = list(starts.islice(i, starts.bisect_left(max(hi, lo + 1))))
        for off in over:
            old = records.pop(off)
            if count:
                self._live -= _size(old)
            self._stamp.pop(off, None)
            starts.remove(off)
        starts.add(lo)
        records[lo] = rec
        if count:
            self._live += _size(rec)
        return len(over)

    def _forget(self, offset: int, length: int, before: int | None = None) -> bool:
        """Drop the record of the object at ``offset`` (the meta frees whole
        objects: a range is freed exactly as it was placed); with ``before``, not a
        record written since heartbeat ``before`` was sent."""
        rec = self.records.get(offset)
        if rec is None or rec.length > length:
            return False
        if before is not None and self._stamp.get(offset, -1) >= before:
            self.spared_frees += 1
            return False
        del self.records[offset]
        self._stamp.pop(offset, None)
        self._starts.remove(offset)
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
            "overlaps_dropped": self.overlaps_dropped,
            "spared_frees": self.spared_frees,
        }
