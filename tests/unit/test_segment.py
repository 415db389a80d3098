"""The server's segment file: sizing checks, space reservation and clean-up."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gcache.errors import GCacheError
from gcache.storage.segment import Segment


def _allocated(path: Path) -> int:
    return path.stat().st_blocks * 512


def test_populated_segment_must_fit_its_tmpfs(tmp_path: Path) -> None:
    st = os.statvfs(tmp_path)
    too_big = st.f_bavail * st.f_frsize + (1 << 30)
    path = tmp_path / "seg"
    with pytest.raises(GCacheError, match="does not fit"):
        Segment(str(path), too_big, populate=True)
    assert not path.exists(), "a refused segment leaves no file behind"


def test_unpopulated_segment_must_fit_too(tmp_path: Path) -> None:
    """--no-populate used to map a sparse file larger than the tmpfs: filling it
    later killed the server (and shared-memory clients) with SIGBUS."""
    st = os.statvfs(tmp_path)
    too_big = st.f_bavail * st.f_frsize + (1 << 30)
    path = tmp_path / "seg"
    with pytest.raises(GCacheError, match="does not fit"):
        Segment(str(path), too_big, populate=False)
    assert not path.exists()


def test_segment_space_is_reserved_at_start(tmp_path: Path) -> None:
    for populate in (False, True):
        path = tmp_path / f"seg-{populate}"
        seg = Segment(str(path), 4 << 20, populate=populate)
        assert _allocated(path) >= 4 << 20, "every page is allocated before any write"
        seg.close()
        assert not path.exists()


def test_unreserved_segment_stays_sparse(tmp_path: Path) -> None:
    """reserve=False (index-only benchmarks) leaves the file sparse."""
    path = tmp_path / "seg"
    seg = Segment(str(path), 64 << 20, populate=False, reserve=False)
    assert path.stat().st_size == 64 << 20 and _allocated(path) < 64 << 20
    seg.view[:4] = b"gcac"
    seg.close()
    assert not path.exists()


def test_populated_segment_is_readable_and_writable(tmp_path: Path) -> None:
    seg = Segment(str(tmp_path / "seg"), 1 << 20, populate=True)
    seg.view[-3:] = b"end"
    assert bytes(seg.view[-3:]) == b"end" and seg.in_bounds(0, 1 << 20)
    assert not seg.in_bounds(1, 1 << 20)
    seg.close()
