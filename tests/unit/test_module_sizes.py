"""No source module grows past ~450 lines without saying why at its top.

A long module is a sign that it holds more than one responsibility; where it
does not (one state machine, one format with its writer and reader, one parser
of every flag), its first lines say so ("One file ... : why"), so a reader knows
it was a choice. Generated code (``gcache/_proto``) is exempt."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 450
HEAD = 12  # the reason must be in the module's first lines


def sources() -> list[Path]:
    out = [*(ROOT / "gcache").rglob("*.py"), *(ROOT / "client" / "gcache_client").rglob("*.py")]
    return sorted(p for p in out if "_proto" not in p.parts)


def test_the_tree_is_found() -> None:
    assert len(sources()) > 100


@pytest.mark.parametrize("path", sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_long_modules_say_why(path: Path) -> None:
    lines = path.read_text().splitlines()
    if len(lines) <= LIMIT:
        return
    head = "\n".join(lines[:HEAD]).lower()
    assert "one file" in head, (
        f"{path.relative_to(ROOT)} has {len(lines)} lines (over {LIMIT}) and no reason "
        f"at its top: split it along its responsibilities, or say in its first "
        f"{HEAD} lines why it is one file ('One file ...: why')"
    )
