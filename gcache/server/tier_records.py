"""The pieces of the server's tiers that need no state: splitting a demotion
batch by segment file, the DRAM bandwidth measured at start, and the checks on a
segment file another process may hold or have left (used by
:class:`gcache.server.tiers.TierState`)."""

from __future__ import annotations

import fcntl
import logging
import os
import time

import numpy as np

from gcache.errors import GCacheError
from gcache.storage.manifest import read_owner
from gcache.storage.record import StoredRecord
from gcache.storage.segment import manifest_path

log = logging.getLogger("gcache.server")


def split_batch(cmds: list[StoredRecord], segment: int) -> list[list[StoredRecord]]:
    """A reply's demotions as the worker jobs they are written in (each synced and
    reported on its own): when they hold more than half of the ``segment``-byte DRAM
    segment, two halves by bytes, in order; else one job. One job per reply left the
    disk idle for a heartbeat interval whenever a reply held most of DRAM (16 MiB
    objects in a 128 MiB segment): its one report freed all the room at the end, the
    puts waiting took it, and their demotions waited for the next tick. Smaller
    replies stay whole (fewer syncs and reports: 1 MiB objects lost by halving)."""
    total = sum(c.length for c in cmds)
    if len(cmds) < 2 or 2 * total <= segment:
        return [cmds]
    acc, cut = 0, len(cmds) - 1
    for i, c in enumerate(cmds[:-1]):
        acc += c.length
        if 2 * acc >= total:
            cut = i + 1
            break
    return [cmds[:cut], cmds[cut:]]


def dram_gbps(view: memoryview, nbytes: int = 64 << 20) -> float:
    """Read bandwidth of the segment: one timed copy of up to ``nbytes``."""
    n = min(nbytes, len(view))
    if n <= 0:
        return 0.0
    src = np.frombuffer(view[:n], np.uint8)
    dst = np.empty(n, np.uint8)
    np.copyto(dst, src)  # warm
    t0 = time.perf_counter()
    np.copyto(dst, src)
    return n / max(time.perf_counter() - t0, 1e-9) / 1e9


def check_not_held(path: str) -> None:
    """Refuse a segment file a live server holds (each keeps it locked)."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise GCacheError(f"cannot open segment file {path}: {exc}") from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        raise GCacheError(f"segment file {path} is in use by another process") from exc
    finally:
        os.close(fd)  # releases the probe's lock


def left_under_own_name(path: str, owner: str) -> str | None:
    """A segment file already at this process's own name was left by an earlier run
    with the same pid: a server restarted in a new container (its own pid
    namespace, the server its first process) has the same pid every time. Such a
    file of this owner is re-adopted like any dead predecessor's; ``path`` if so."""
    if not os.path.exists(path):
        return None
    check_not_held(path)
    return path if read_owner(manifest_path(path)) == owner else None


def remove_left_under_own_name(path: str) -> None:
    """A file at this process's own name that is not re-adopted (another owner, or
    reuse off) is an earlier run's: removed, so the new segment can be created."""
    check_not_held(path)
    for p in (path, manifest_path(path)):
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise GCacheError(f"cannot remove the earlier run's segment file {p}: {exc}") from exc
    log.warning("removed segment file %s an earlier run with this pid left", path)
