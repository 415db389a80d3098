"""Blocking raw-socket helpers for feeding daemons hand-made frames."""

from __future__ import annotations

import socket
from typing import Any

from gcache import wire


def connect(port: int, host: str = "127.0.0.1") -> socket.socket:
    s = socket.create_connection((host, port), timeout=5)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def recv_exact(s: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("closed")
        buf += chunk
    return bytes(buf)


def recv_frame(s: socket.socket) -> tuple[wire.FrameHead, Any, bytes]:
    head = wire.parse_header(recv_exact(s, wire.HEADER_SIZE))
    body = wire.decode_body(head.msg_type, recv_exact(s, head.body_len))
    payload = recv_exact(s, head.payload_len) if head.payload_len else b""
    return head, body, payload


def call(port: int, msg: wire.Msg, payload: bytes = b"") -> tuple[wire.FrameHead, Any, bytes]:
    with connect(port) as s:
        s.sendall(wire.pack_frame(msg, 7, len(payload)) + payload)
        return recv_frame(s)


def closed_by_peer(s: socket.socket, timeout: float = 5.0) -> bool:
    """True if the peer closes the connection (possibly after an error frame)."""
    s.settimeout(timeout)
    try:
        while True:
            if not s.recv(65536):
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


def obj(
    fp: bytes, layout: Any, ks: list[bytes], p: wire.Placement, sums: bytes | None = None
) -> wire.ObjectInfo:
    """The record placement ``p``'s write grant is bound to (prompt keys ``ks`` of
    namespace ``fp``), with ``sums`` (default: zero checksums, a miss if read)."""
    from gcache_client.writer import object_info

    if sums is None:
        sums = bytes(8 * len(layout.group_layers[p.group]))
    return object_info(layout, fp, ks, p.block, p.group, sums)
