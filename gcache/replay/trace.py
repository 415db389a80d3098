"""Mooncake FAST'25 request traces, read and checked, as index block keys.

One JSON object a line: ``timestamp`` (ms), ``input_length``, ``output_length``
and ``hash_ids``, one id per 512-token trace block (the last one usually partial);
equal ids mean an equal prefix up to and including that block (the ids are chained
prefix hashes). A trace block maps onto ``512 / block_size`` index blocks: index
block ``s`` of trace block ``h`` gets the 16-byte key ``(h, s)``. Because the ids
are chained, that key names the whole prefix up to it, as a chained xxh3 key of
the real tokens would, so the index sees the same tree. Only full index blocks are
keyed (``input_length // block_size``), as the client does; a partial last trace
block contributes its full index blocks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

TRACE_BLOCK = 512  # tokens per hash id in the Mooncake traces


class TraceError(Exception):
    """A trace that cannot be replayed; the message names the file and line."""


class _Record(msgspec.Struct, forbid_unknown_fields=False):
    timestamp: float
    input_length: int
    output_length: int
    hash_ids: list[int]


_DECODER = msgspec.json.Decoder(_Record)


@dataclass
class Trace:
    """Requests in arrival order, each as the keys of its full index blocks."""

    path: str
    block_size: int
    times: list[float] = field(default_factory=list)  # seconds from the start
    lengths: list[int] = field(default_factory=list)  # prompt tokens
    outputs: list[int] = field(default_factory=list)  # generated tokens
    keys: list[list[bytes]] = field(default_factory=list)

    @property
    def requests(self) -> int:
        return len(self.lengths)

    @property
    def blocks(self) -> int:
        return sum(len(k) for k in self.keys)

    @property
    def tokens(self) -> int:
        return sum(self.lengths)


def load(path: str | Path, block_size: int, limit: int = 0) -> Trace:
    """Read ``path`` (the first ``limit`` records if > 0). Raises :class:`TraceError`
    naming the first malformed line."""
    if block_size <= 0 or TRACE_BLOCK % block_size:
        raise TraceError(f"block size {block_size} must divide the trace block of {TRACE_BLOCK}")
    sub = TRACE_BLOCK // block_size
    trace = Trace(str(path), block_size)
    cache: dict[int, list[bytes]] = {}
    last_ts = -math.inf
    try:
        fh = open(path, "rb")  # noqa: SIM115 - closed below, errors reported per line
    except OSError as exc:
        raise TraceError(f"{path}: cannot open: {exc.strerror or exc}") from None
    with fh:
        for lineno, raw in enumerate(fh, 1):
            if not raw.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                rec = _DECODER.decode(raw)
            except msgspec.DecodeError as exc:
                raise TraceError(f"{where}: malformed record: {exc}") from None
            n_ids = len(rec.hash_ids)
            if rec.input_length <= 0 or rec.output_length < 0:
                raise TraceError(f"{where}: input_length must be > 0 and output_length >= 0")
            if not math.isfinite(rec.timestamp) or rec.timestamp < 0:
                raise TraceError(f"{where}: timestamp must be a finite number >= 0")
            if rec.timestamp < last_ts:
                raise TraceError(f"{where}: timestamp {rec.timestamp} goes back in time")
            if n_ids != -(-rec.input_length // TRACE_BLOCK):
                raise TraceError(
                    f"{where}: {n_ids} hash_ids for {rec.input_length} tokens "
                    f"(want one per {TRACE_BLOCK} tokens: {-(-rec.input_length // TRACE_BLOCK)})"
                )
            if any(h < 0 for h in rec.hash_ids):
                raise TraceError(f"{where}: hash_ids must be >= 0")
            last_ts = rec.timestamp
            nblocks = rec.input_length // block_size
            keys: list[bytes] = []
            for i, h in enumerate(rec.hash_ids):
                ks = cache.get(h)
                if ks is None:
                    ks = cache[h] = [((h << 16) | s).to_bytes(16, "little") for s in range(sub)]
                keys += ks if (i + 1) * sub <= nblocks else ks[: nblocks - i * sub]
            trace.times.append(rec.timestamp / 1000.0)
            trace.lengths.append(rec.input_length)
            trace.outputs.append(rec.output_length)
            trace.keys.append(keys)
            if limit and trace.requests >= limit:
                break
    if not trace.requests:
        raise TraceError(f"{path}: no requests")
    return trace
