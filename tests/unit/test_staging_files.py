"""A server start removes the staging files a killed predecessor left, and only
those (gcache.server.staging.remove_dead_staging_files)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from gcache.server.staging import remove_dead_staging_files
from gcache.storage.segment import dead_files


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_only_staging_files_of_dead_processes_of_this_server_are_removed(tmp_path: Path) -> None:
    dead, me = _dead_pid(), os.getpid()
    names = [
        f"gcache-s0-{dead}.stage",  # a killed predecessor's: removed
        f"gcache-s0-{me}.stage",  # a live process's: kept
        f"gcache-s0-{dead}.seg",  # a segment (re-adopted or removed elsewhere): kept
        f"gcache-s1-{dead}.stage",  # another server id's: kept
        "gcache-s0-x.stage",  # not a process id: kept
    ]
    for n in names:
        (tmp_path / n).write_bytes(b"")
    seg = str(tmp_path / f"gcache-s0-{me}.seg")
    assert remove_dead_staging_files(str(tmp_path), seg) == [f"gcache-s0-{dead}.stage"]
    assert sorted(os.listdir(tmp_path)) == sorted(names[1:])
    assert dead_files(str(tmp_path), "gcache-s0-", ".seg") == [str(tmp_path / names[2])]
    assert remove_dead_staging_files(str(tmp_path / "missing"), seg) == []
