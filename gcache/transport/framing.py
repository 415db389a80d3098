"""I/O-free framing: the receive buffer, the frame parser and the send/scatter
bookkeeping under :class:`~gcache.transport.stream.FrameStream`.

Nothing here touches a socket, so partial frames, partial sends and batches of more
than :data:`IOV_BATCH` views are unit-tested by feeding bytes and fake ``sendmsg``
callables (the shape of h11's ``_receivebuffer``).

Memory rule: the receive buffer grows only with bytes actually received. A header
that declares a 32 MiB body costs nothing until body bytes arrive; the buffer then
doubles each time it fills (so it is never more than about twice what the peer
sent), and shrinks back to the read-ahead size once a large frame is consumed.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from typing import Final, TypeGuard

from gcache import wire
from gcache.errors import InvalidBody, ProtocolError

# Linux IOV_MAX is 1024; keep sendmsg/recvmsg batches well under it.
IOV_BATCH: Final = 512
# Read-ahead: one recv usually holds a header and a small body. Kept small because
# payload bytes it catches are copied once more on their way to the caller's views.
READ_AHEAD: Final = 16 << 10

Buffer = memoryview | bytes | bytearray
# body length (u32) and payload length (u64) at offset 12 of a header (wire.HEADER)
_LENGTHS: Final = struct.Struct("!IQ")


class ReceiveBuffer:
    """Bytes received and not yet consumed, in one reused ``bytearray``.

    Receive with ``recv_into(buf.space(need))`` then ``buf.commit(n)``. Views handed
    out by :meth:`take` stay valid until the next :meth:`space`: the buffer is never
    resized in place (a new one replaces it), so an exported view never blocks it.
    """

    __slots__ = ("_buf", "_end", "_start", "grown", "read_ahead", "shrunk")

    def __init__(self, read_ahead: int = READ_AHEAD) -> None:
        if read_ahead < wire.HEADER_SIZE:
            raise ValueError(f"read_ahead must hold a header ({wire.HEADER_SIZE} bytes)")
        self.read_ahead = read_ahead
        self._buf = bytearray(read_ahead)
        self._start = 0
        self._end = 0
        self.grown = 0  # times the buffer grew past its size (stats, tests)
        self.shrunk = 0

    def __len__(self) -> int:
        return self._end - self._start

    @property
    def capacity(self) -> int:
        """Bytes currently allocated (what a hostile peer can make us hold)."""
        return len(self._buf)

    def space(self, need: int) -> memoryview:
        """A writable view to receive into, for a caller that wants ``need`` bytes
        buffered in all. Makes room by compacting and, only when the buffer is
        already full of received bytes, by doubling it (capped at ``need``): memory
        follows what arrived, never what a header declared."""
        buf, size = self._buf, len(self._buf)
        if self._end < size and self._start + need <= size:
            return memoryview(buf)[self._end :]
        have = self._end - self._start
        if have == size:  # full of received bytes: only now may it grow
            new = bytearray(min(max(need, size + 1), 2 * size))
            new[:have] = buf
            self._buf, self._start, self._end = new, 0, have
            self.grown += 1
        elif self._start:  # compact in place (views from take() are spent by now)
            mv = memoryview(buf)
            mv[:have] = mv[self._start : self._end]
            mv.release()
            self._start, self._end = 0, have
        return memoryview(self._buf)[self._end :]

    def commit(self, n: int) -> None:
        """``n`` bytes were written at the start of the last :meth:`space` view."""
        if n < 0 or self._end + n > len(self._buf):
            raise ValueError(f"commit of {n} bytes past the buffer")
        self._end += n

    def feed(self, data: Buffer) -> None:
        """Copy ``data`` in (tests and tools; sockets use space/commit)."""
        mv = memoryview(data).cast("B")
        while mv:
            dst = self.space(len(self) + mv.nbytes)
            n = min(dst.nbytes, mv.nbytes)
            dst[:n] = mv[:n]
            self.commit(n)
            mv = mv[n:]

    def peek(self, n: int) -> memoryview:
        return memoryview(self._buf)[self._start : self._start + min(n, len(self))]

    def take(self, n: int) -> memoryview:
        """Consume ``n`` buffered bytes; the view is valid until the next receive."""
        if n > len(self):
            raise ValueError(f"take of {n} bytes, {len(self)} buffered")
        v = memoryview(self._buf)[self._start : self._start + n]
        self._start += n
        if self._start == self._end:
            self._start = self._end = 0
            if len(self._buf) > self.read_ahead:
                # A large frame is done: give its memory back.
                self._buf = bytearray(self.read_ahead)
                self.shrunk += 1
        return v

    def drain_into(self, view: memoryview) -> int:
        """Copy what is buffered into ``view``; returns bytes copied."""
        n = min(len(self), view.nbytes)
        if n:
            with self.take(n) as src:
                view[:n] = src
        return n


class FrameParser:
    """Splits received bytes into frame headers and bodies, enforcing this
    daemon's body limit at header time (before any body byte is buffered).

    ``next_head()`` then ``next_body(head)``; each returns ``None`` until enough
    bytes are buffered, and the caller receives more into ``space(parser.need)``.
    Payload bytes are not the parser's business: the caller moves them into its
    own views (``buffer.drain_into`` first, then the socket).
    """

    __slots__ = ("buffer", "max_body", "need")

    def __init__(self, max_body: int = wire.MAX_BODY, read_ahead: int = READ_AHEAD) -> None:
        if not 0 <= max_body <= wire.MAX_BODY:
            raise ValueError(f"max_body must be in [0, {wire.MAX_BODY}]")
        self.buffer = ReceiveBuffer(read_ahead)
        self.max_body = max_body
        self.need = wire.HEADER_SIZE  # bytes to buffer before the next event

    def feed(self, data: Buffer) -> None:
        self.buffer.feed(data)

    def space(self) -> memoryview:
        return self.buffer.space(self.need)

    def commit(self, n: int) -> None:
        self.buffer.commit(n)

    def next_head(self) -> wire.FrameHead | None:
        """The next header, or ``None`` until 24 bytes are buffered. Raises
        :class:`ProtocolError` for a bad header or a body over ``max_body``."""
        buf = self.buffer
        if len(buf) < wire.HEADER_SIZE:
            self.need = wire.HEADER_SIZE
            return None
        with buf.take(wire.HEADER_SIZE) as raw:
            head = wire.parse_header(raw)
        if head.body_len > self.max_body:
            raise ProtocolError(
                f"body length {head.body_len} exceeds this daemon's {self.max_body}"
            )
        self.need = head.body_len
        return head

    def frame_ready(self) -> bool:
        """Between frames: is the next frame, header and body, buffered whole, and
        without payload? (Its header is not validated here; ``next_head`` does.)"""
        buf = self.buffer
        have = len(buf)
        if have < wire.HEADER_SIZE:
            return False
        with buf.peek(wire.HEADER_SIZE) as raw:
            body_len, payload_len = _LENGTHS.unpack_from(raw, 12)
        return bool(payload_len == 0 and have >= wire.HEADER_SIZE + body_len)

    def next_body(self, head: wire.FrameHead) -> memoryview | None:
        """The raw body of ``head`` (valid until the next receive), or ``None``
        until all of it is buffered."""
        if len(self.buffer) < head.body_len:
            self.need = head.body_len
            return None
        self.need = wire.HEADER_SIZE
        return self.buffer.take(head.body_len)


# ---- peeking at msgpack array headers ------------------------------------------------


def _array_len(body: memoryview, pos: int) -> tuple[int, int]:
    """(length, position after the header) of the msgpack array at ``pos``."""
    if pos >= len(body):
        raise InvalidBody("body ends before an array")
    b = body[pos]
    if 0x90 <= b <= 0x9F:
        return b & 0x0F, pos + 1
    if b == 0xDC and pos + 3 <= len(body):
        return int.from_bytes(body[pos + 1 : pos + 3], "big"), pos + 3
    if b == 0xDD and pos + 5 <= len(body):
        return int.from_bytes(body[pos + 1 : pos + 5], "big"), pos + 5
    raise InvalidBody(f"expected an array at body offset {pos}")


def _skip_scalar(body: memoryview, pos: int) -> int:
    """Position after a bin/str/int/bool/nil at ``pos`` (what precedes a peeked field)."""
    if pos >= len(body):
        raise InvalidBody("body ends early")
    b = body[pos]
    if b <= 0x7F or b >= 0xE0 or b in (0xC0, 0xC2, 0xC3):
        return pos + 1
    if 0xA0 <= b <= 0xBF:
        return pos + 1 + (b & 0x1F)
    fixed = {0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8, 0xD0: 1, 0xD1: 2, 0xD2: 4, 0xD3: 8}
    if b in fixed:
        return pos + 1 + fixed[b]
    width = {0xC4: 1, 0xC5: 2, 0xC6: 4, 0xD9: 1, 0xDA: 2, 0xDB: 4}.get(b)
    if width is None or pos + 1 + width > len(body):
        raise InvalidBody(f"unexpected msgpack byte 0x{b:02x} at body offset {pos}")
    return pos + 1 + width + int.from_bytes(body[pos + 1 : pos + 1 + width], "big")


def peek_array_field(body: memoryview, index: int) -> int | None:
    """Declared length of the array that is field ``index`` of an array-encoded body,
    read from the raw bytes without decoding (the fields before it must be scalars).
    Lets a daemon refuse a key list by its header before decoding a million keys.
    ``None`` when the body does not have that shape (the decoder then says why)."""
    try:
        n, pos = _array_len(body, 0)
        if n <= index:
            return None
        for _ in range(index):
            pos = _skip_scalar(body, pos)
        return _array_len(body, pos)[0]
    except InvalidBody:
        return None


# ---- sending and scattering -------------------------------------------------------------


def _is_bytes_view(v: Buffer) -> TypeGuard[memoryview]:
    return isinstance(v, memoryview) and v.format == "B" and v.ndim == 1 and v.contiguous


def as_bytes_views(views: Sequence[Buffer]) -> list[memoryview]:
    """``views`` as flat byte views; views that already are one are reused, not
    wrapped again (a READ of 65536 ranges would otherwise hold 65536 more views,
    about 12 MiB, for as long as its reply takes to send)."""
    return [v if _is_bytes_view(v) else memoryview(v).cast("B") for v in views]


def after_sent(views: Sequence[memoryview], sent: int) -> list[memoryview]:
    """The views still to send once ``sent`` bytes of ``views`` went out."""
    for i, v in enumerate(views):
        if sent < v.nbytes:
            return [v[sent:], *views[i + 1 :]] if sent else list(views[i:])
        sent -= v.nbytes
    return []


def send_some(
    sendmsg: Callable[[list[memoryview]], int], views: list[memoryview]
) -> list[memoryview]:
    """Send ``views`` in batches of at most :data:`IOV_BATCH` until done or the
    socket is full; returns what is left (empty when all went out). ``sendmsg``
    raises ``BlockingIOError`` when full (or accepts fewer bytes than offered)."""
    i = 0
    while i < len(views):
        batch = views[i : i + IOV_BATCH]
        try:
            sent = sendmsg(batch)
        except InterruptedError:
            continue
        except BlockingIOError:
            return views[i:]
        total = sum(v.nbytes for v in batch)
        if sent < total:
            return [*after_sent(batch, sent), *views[i + IOV_BATCH :]]
        i += IOV_BATCH
    return []


class Scatter:
    """Destination views filled in order: what ``recvmsg_into`` gets next
    (:meth:`batch`, at most :data:`IOV_BATCH` views) and where to resume."""

    __slots__ = ("_i", "_views")

    def __init__(self, views: Sequence[memoryview]) -> None:
        self._views = [v.cast("B") if v.format != "B" else v for v in views if v.nbytes]
        self._i = 0

    @property
    def done(self) -> bool:
        return self._i >= len(self._views)

    @property
    def remaining(self) -> int:
        return sum(v.nbytes for v in self._views[self._i :])

    def current(self) -> memoryview:
        return self._views[self._i]

    def batch(self) -> list[memoryview]:
        return self._views[self._i : self._i + IOV_BATCH]

    def advance(self, n: int) -> None:
        """``n`` bytes landed at the front of :meth:`batch`."""
        views = self._views
        while n:
            size = views[self._i].nbytes
            if n >= size:
                n -= size
                self._i += 1
            else:
                views[self._i] = views[self._i][n:]
                n = 0

    def fill_from(self, buf: ReceiveBuffer) -> None:
        """Move what the read-ahead already holds into the views."""
        while not self.done and len(buf):
            self.advance(buf.drain_into(self.current()))
