"""A server restarted in a new container gets the same pid as the run before it
(each container has its own pid namespace, the server is its first process), so
the segment file that run left has exactly the name this run would create. It is
re-adopted like any dead predecessor's, never refused as already there, and one a
live process still holds is refused."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest

from gcache.config import ServerConfig
from gcache.errors import GCacheError
from gcache.server.tiers import TierState
from gcache.storage.segment import Segment, manifest_path


def _cfg(tmp_path: Path) -> ServerConfig:
    return ServerConfig(
        server_id="node-a",
        shm_dir=str(tmp_path),
        capacity="4MiB",
        populate=False,
        staging_size="0",
        meta="127.0.0.1:7701",
    )


def _path(cfg: ServerConfig) -> str:
    return os.path.join(cfg.shm_dir, Segment.file_name(cfg.server_id))  # this pid's name


def test_a_segment_left_under_this_very_name_is_readopted(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    first = TierState.start(cfg, cfg.server_id, _path(cfg))
    first.segment.view[:5] = b"kept!"
    first.close()  # the previous container's run ends; its files stay
    assert os.path.exists(_path(cfg)) and os.path.exists(manifest_path(_path(cfg)))
    second = TierState.start(cfg, cfg.server_id, _path(cfg))
    try:
        assert second.segment.reused
        assert bytes(second.segment.view[:5]) == b"kept!"
    finally:
        second.close()


def test_a_segment_of_another_meta_under_this_name_is_replaced(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    TierState.start(cfg, cfg.server_id, _path(cfg)).close()
    other = ServerConfig(**{**cfg.__dict__, "meta": "127.0.0.1:7801"})
    again = TierState.start(other, other.server_id, _path(other))
    try:
        assert not again.segment.reused
    finally:
        again.close()


def test_a_segment_a_live_process_holds_under_this_name_is_refused(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    TierState.start(cfg, cfg.server_id, _path(cfg)).close()
    fd = os.open(_path(cfg), os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as a running server holds it
        with pytest.raises(GCacheError, match="in use"):
            TierState.start(cfg, cfg.server_id, _path(cfg))
        assert os.path.exists(_path(cfg))  # and nothing of it was removed
    finally:
        os.close(fd)
