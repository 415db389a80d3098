"""The server's segment file: sizing checks and clean-up."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gcache.errors import GCacheError
from gcache.storage.segment import Segment


def test_populated_segment_must_fit_its_tmpfs(tmp_path: Path) -> None:
    st = os.statvfs(tmp_path)
    too_big = st.f_bavail * st.f_frsize + (1 << 30)
    path = tmp_path / "seg"
    with pytest.raises(GCacheError, match="does not fit"):
        Segment(str(path), too_big, populate=True)
    assert not path.exists(), "a refused segment leaves no file behind"


def test_sparse_segment_may_exceed_free_space_and_is_removed_on_close(tmp_path: Path) -> None:
    st = os.statvfs(tmp_path)
    big = st.f_bavail * st.f_frsize + (1 << 30)
    path = tmp_path / "seg"
    seg = Segment(str(path), big, populate=False)
    assert path.stat().st_size == big
    seg.view[:4] = b"gcac"
    seg.close()
    assert not path.exists()


def test_populated_segment_is_readable_and_writable(tmp_path: Path) -> None:
    seg = Segment(str(tmp_path / "seg"), 1 << 20, populate=True)
    seg.view[-3:] = b"end"
    assert bytes(seg.view[-3:]) == b"end" and seg.in_bounds(0, 1 << 20)
    assert not seg.in_bounds(1, 1 << 20)
    seg.close()
