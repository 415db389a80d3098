"""Daemon start-up as an operator sees it: listeners that fail with one line naming
the address and the setting, and a ``main`` wrapper that turns every failure into
one line on stderr and a non-zero exit, never a traceback.

Exit codes: 2 for a setting that is refused (flag, environment, config file),
1 for any other failure to start or run, 130 for an interrupt before the daemon
installed its own signal handlers.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import socket
import sys
from collections.abc import Callable
from typing import NoReturn, TypeVar

from gcache.errors import BindError, ConfigError, GCacheError

T = TypeVar("T")

EXIT_CONFIG = 2
EXIT_FAILED = 1
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, what a C tool's shell status would be

_HINTS = {
    errno.EADDRINUSE: "another process listens there; stop it or choose another port",
    errno.EADDRNOTAVAIL: "not an address of this host; use one of its addresses or 0.0.0.0",
    errno.EACCES: "ports below 1024 need privileges; choose a port >= 1024",
}


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose refusals are one line (``prog: message (see
    --help)``, exit 2) instead of the whole usage text and then the message."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_CONFIG, f"{self.prog}: {one_line(message)} (see {self.prog} --help)\n")


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def install_uvloop() -> None:
    import asyncio

    import uvloop

    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


def one_line(text: object) -> str:
    """``text`` on one line (newlines folded), so a log or stderr line stays whole."""
    return " ".join(str(text).split())


def bind_error(host: str, port: int, setting: str, exc: OSError) -> BindError:
    """``cannot listen on HOST:PORT (setting): reason; hint`` as a :class:`BindError`."""
    reason = exc.strerror or str(exc)
    hint = _HINTS.get(exc.errno or 0, "")
    if isinstance(exc, socket.gaierror):
        hint = "the host name does not resolve on this host"
    text = f"cannot listen on {host}:{port} ({setting}): {reason.lower()}"
    return BindError(one_line(f"{text}; {hint}" if hint else text))


def _addr(host: str, port: int) -> tuple[socket.AddressFamily, tuple[str, int]]:
    """The first passive address ``host`` names (IPv4 or IPv6)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, sockaddr = infos[0]
    return family, (str(sockaddr[0]), int(sockaddr[1]))


def listen_tcp(host: str, port: int, setting: str, backlog: int) -> socket.socket:
    """A non-blocking listening socket on ``host:port`` (0: a free port).

    Any failure (address in use, not on this host, no permission, a host name
    that does not resolve) is a :class:`BindError` naming the address and
    ``setting``, the key an operator changes to fix it.
    """
    sock: socket.socket | None = None
    try:
        family, addr = _addr(host, port)
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(backlog)
        sock.setblocking(False)
    except OSError as exc:
        if sock is not None:
            sock.close()
        raise bind_error(host, port, setting, exc) from exc
    return sock


def probe_port(host: str, port: int, setting: str) -> None:
    """Check that ``host:port`` can be listened on, for listeners GCache does not
    bind itself (gRPC): the library's own failure is a vague ``RuntimeError``
    preceded by native log lines on stderr. Port 0 needs no check."""
    if port != 0:
        listen_tcp(host, port, setting, 1).close()


def run_main(prog: str, log: logging.Logger, body: Callable[[], None]) -> NoReturn:
    """Run a daemon's ``body`` and exit; every failure is one line on stderr.

    A refused setting exits 2, any other :class:`GCacheError` or ``OSError`` 1,
    an interrupt 130. An unexpected exception is reported in one line too; its
    traceback goes to the debug log only (``--log-level debug``).
    """
    try:
        body()
    except ConfigError as exc:
        print(f"{prog}: {one_line(exc)}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_CONFIG) from None
    except GCacheError as exc:
        log.error("%s", one_line(exc))
        raise SystemExit(EXIT_FAILED) from None
    except OSError as exc:
        log.error("%s", one_line(f"{exc.strerror or exc}: {exc.filename or ''}".rstrip(": ")))
        raise SystemExit(EXIT_FAILED) from None
    except KeyboardInterrupt:
        log.error("interrupted while starting")
        raise SystemExit(EXIT_INTERRUPTED) from None
    except Exception as exc:
        log.debug("internal error", exc_info=True)
        log.error(
            "internal error: %s (run with --log-level debug for the traceback)",
            one_line(f"{type(exc).__name__}: {exc}"),
        )
        raise SystemExit(EXIT_FAILED) from None
    raise SystemExit(0)


def run_command(prog: str, func: Callable[[T], int], args: T) -> int:
    """Run a command (``gcache up``, ``gcache-bench``) and return its exit code;
    every failure is one line on stderr, never a traceback (``GCACHE_DEBUG=1``
    shows it for a bug report). A closed stdout (``| head``) ends quietly."""
    try:
        code = int(func(args))
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        # `gcache status | head`: the reader left; say nothing, like any Unix tool.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except GCacheError as exc:
        print(f"{prog}: {one_line(exc)}", file=sys.stderr)
        return EXIT_CONFIG if isinstance(exc, ConfigError) else 1
    except OSError as exc:
        where = f": {exc.filename}" if exc.filename else ""
        print(f"{prog}: {one_line(exc.strerror or exc)}{where}", file=sys.stderr)
        return 1
    except Exception as exc:
        if os.environ.get("GCACHE_DEBUG"):
            raise
        print(
            f"{prog}: internal error: {one_line(f'{type(exc).__name__}: {exc}')} "
            "(GCACHE_DEBUG=1 shows the traceback)",
            file=sys.stderr,
        )
        return 1
