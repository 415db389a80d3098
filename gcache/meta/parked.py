"""The parked books: reported records that wait to be adopted.

A record a server reported is parked while its namespace is not registered yet or
its parent block has not been reported (``meta/rebuild.py`` says when each is
retried). The books hold them three ways, and only this class touches them:

* every parked record in arrival order (bound and expiry walk it oldest first),
  and, per namespace, the records waiting for it and those waiting for a parent
  (lists consumed whole; an entry no longer on the books is stale and skipped);
* whole chunks of one unregistered namespace kept in their columns
  (:class:`ParkedChunk`, no object per record), in arrival order and per
  namespace.

A parked DRAM record or chunk also sits in its server's ``parked`` map (offset ->
what holds it) so no other record is adopted over its range. What leaving the
books means for a server (dropping or freeing the ranges) is
:class:`gcache.meta.adopt.Adoption`'s. No I/O.
"""

from __future__ import annotations

from collections.abc import Iterator

from gcache.meta.records import Parked, ParkedChunk, ServerRecord


class ParkedBooks:
    """Parked records and chunks, by arrival and by what they wait for."""

    def __init__(self) -> None:
        # every parked record in arrival order (id -> record)
        self._all: dict[int, Parked] = {}
        # namespace fingerprint -> records waiting for it / for their parent block
        self._for_ns: dict[bytes, list[Parked]] = {}
        self._for_parent: dict[bytes, list[Parked]] = {}
        # whole chunks waiting for their namespace: in arrival order, per namespace
        self._chunks: dict[int, ParkedChunk] = {}
        self._ns_chunks: dict[bytes, list[ParkedChunk]] = {}
        self._rows = 0  # records held in parked chunks

    # ---- sizes -----------------------------------------------------------------

    def __len__(self) -> int:
        """Records parked, in chunks or one by one."""
        return len(self._all) + self._rows

    @property
    def records(self) -> int:
        return len(self._all)

    @property
    def chunk_rows(self) -> int:
        return self._rows

    @property
    def chunks(self) -> int:
        return len(self._chunks)

    def waiting_for_namespace(self) -> int:
        """Namespaces records or chunks wait for (stale list entries included)."""
        return len(self._for_ns.keys() | self._ns_chunks.keys())

    def waiting_for_parent(self, fp: bytes | None = None) -> int:
        """Records waiting for a parent (of namespace ``fp``, or all), stale list
        entries included."""
        if fp is not None:
            return len(self._for_parent.get(fp, ()))
        return sum(len(v) for v in self._for_parent.values())

    def is_parked(self, rec: Parked) -> bool:
        return id(rec) in self._all

    def of_server(self, srv: ServerRecord) -> int:
        """Records of ``srv`` parked."""
        rows = sum(len(c.cols) for c in self._chunks.values() if c.server is srv)
        return rows + sum(1 for r in self._all.values() if r.server is srv)

    def chunks_of(self, srv: ServerRecord) -> Iterator[ParkedChunk]:
        return (c for c in self._chunks.values() if c.server is srv)

    # ---- in ----------------------------------------------------------------------

    def park_for_namespace(self, rec: Parked) -> None:
        self._park(rec, self._for_ns.setdefault(rec.namespace, []))

    def park_for_parent(self, rec: Parked) -> None:
        self._park(rec, self._for_parent.setdefault(rec.namespace, []))

    def _park(self, rec: Parked, where: list[Parked]) -> None:
        where.append(rec)
        self._all[id(rec)] = rec
        srv = rec.server
        assert srv is not None
        if rec.tier == 0:
            srv.parked[rec.offset] = rec

    def requeue_for_parent(self, fp: bytes, recs: list[Parked]) -> None:
        """Records taken with :meth:`take_parent_pools` that still wait (still on
        the books), ahead of any parked since."""
        waiting = self._for_parent.setdefault(fp, [])
        waiting[:0] = recs

    def park_chunk(self, chunk: ParkedChunk) -> None:
        chunk.server.parked.update(dict.fromkeys(chunk.ranges, chunk))
        self._chunks[id(chunk)] = chunk
        self._ns_chunks.setdefault(chunk.cols.namespace_at(0), []).append(chunk)
        self._rows += len(chunk.cols)

    # ---- out ---------------------------------------------------------------------

    def unpark(self, rec: Parked) -> None:
        """Take ``rec`` off the books (not off its list: lists are consumed whole,
        and a stale entry there is skipped)."""
        self._all.pop(id(rec), None)
        srv = rec.server
        if srv is not None and rec.tier == 0 and srv.parked.get(rec.offset) is rec:
            del srv.parked[rec.offset]

    def unpark_chunk(self, chunk: ParkedChunk) -> bool:
        """Take ``chunk`` off the books (False: it was not on them)."""
        if self._chunks.pop(id(chunk), None) is None:
            return False
        self._rows -= len(chunk.cols)
        sparked = chunk.server.parked
        for off in chunk.ranges:
            if sparked.get(off) is chunk:
                del sparked[off]
        return True

    def take_parent_pools(self) -> dict[bytes, list[Parked]]:
        """Every list of records waiting for a parent, per namespace (their records
        stay on the books: :meth:`unpark` each one adopted,
        :meth:`requeue_for_parent` the ones still waiting)."""
        pools, self._for_parent = self._for_parent, {}
        return pools

    def take_namespace(self, fp: bytes) -> tuple[list[ParkedChunk], list[Parked]]:
        """The chunks (off the books) and the records (still on them, stale ones
        left out) that waited for namespace ``fp``."""
        chunks = [c for c in self._ns_chunks.pop(fp, ()) if self.unpark_chunk(c)]
        recs = [r for r in self._for_ns.pop(fp, ()) if id(r) in self._all]
        return chunks, recs

    def oldest_chunk(self) -> ParkedChunk | None:
        return next(iter(self._chunks.values()), None)

    def oldest_record(self) -> Parked | None:
        return next(iter(self._all.values()), None)

    def drop_stale(self) -> None:
        """With nothing left on the books, the consumed lists hold only stale
        entries: drop them."""
        if not self._chunks:
            self._ns_chunks.clear()
        if not self._all:
            self._for_ns.clear()
            self._for_parent.clear()

    def stats(self) -> dict[str, int]:
        return {"parked_objects": len(self)}
