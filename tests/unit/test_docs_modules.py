"""docs/architecture.md names only code that exists.

The convention (what the page may name, and how each name is checked):

* A dotted name in backticks that starts with ``gcache.`` or ``gcache_client.``
  (``gcache.layout``, ``gcache._native.read_layer``, ``gcache_client.hf.WindowCapture``)
  must resolve: its longest importable prefix is imported and the rest is looked
  up as attributes of it.
* A path in backticks that ends in ``.py`` (``gcache/meta/core.py``, ``meta/core.py``,
  ``aio.py``, ``client/gcache_client/aio.py``) must be a file under one of the
  roots the page writes paths relative to: the repository, ``gcache/`` (the shared
  core, daemons and CLI) or ``client/gcache_client/`` (the client).
* The same holds for every module listed under the page's "Modules" section, one
  ``gcache.x`` / ``gcache_client.x`` name per bullet.
* A module whose third-party dependency is not installed (vLLM, SGLang) is found
  by its file instead of imported, and a name after it must be defined there.

Names that carry a glob or a placeholder (``*``, ``<``) are not checked.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
PATH_ROOTS = (ROOT, ROOT / "gcache", ROOT / "client" / "gcache_client")

_TICKED = re.compile(r"`([^`\n]+)`")
_DOTTED = re.compile(r"^(gcache|gcache_client)(\.[A-Za-z_][A-Za-z0-9_]*)+$")
_PATH = re.compile(r"^[A-Za-z0-9_./-]+\.py$")


def _ticked() -> list[str]:
    return _TICKED.findall(DOC.read_text(encoding="utf-8"))


def dotted_names() -> list[str]:
    names = {t.split("(")[0] for t in _ticked()}
    return sorted(n for n in names if _DOTTED.match(n))


def py_paths() -> list[str]:
    return sorted({t for t in _ticked() if _PATH.match(t) and "*" not in t and "<" not in t})


def _source(module: str) -> Path | None:
    """The file of a ``gcache``/``gcache_client`` module, found without importing it."""
    rel = Path(*module.split("."))
    base = ROOT / "client" if module.startswith("gcache_client") else ROOT
    for p in (base / rel.with_suffix(".py"), base / rel / "__init__.py"):
        if p.is_file():
            return p
    return None


def _defines(src: Path, attr: str) -> bool:
    tree = ast.parse(src.read_text(encoding="utf-8"))
    for node in tree.body:
        named = isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        if named and getattr(node, "name", None) == attr:
            return True
        bound = isinstance(node, (ast.Assign, ast.AnnAssign, ast.ImportFrom, ast.Import))
        if bound and attr in ast.unparse(node):
            return True
    return False


def resolve(name: str) -> None:
    """Import the longest importable prefix of ``name``; the rest are attributes.

    A module whose third-party dependency is not installed here (vLLM, SGLang)
    cannot be imported: then its file must exist and define the next name."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        module = ".".join(parts[:cut])
        try:
            obj: object = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if _source(module) is None or (exc.name or "").startswith(("gcache", "gcache_client")):
                continue
            src = _source(module)
            assert src is not None
            if cut < len(parts):
                assert _defines(src, parts[cut]), f"{name}: {src} defines no {parts[cut]}"
            return
        for attr in parts[cut:]:
            obj = getattr(obj, attr)  # AttributeError: the doc names what is not there
        return
    raise ModuleNotFoundError(name)


def test_the_page_names_code() -> None:
    assert len(dotted_names()) >= 3 and len(py_paths()) >= 20


@pytest.mark.parametrize("name", dotted_names())
def test_dotted_name_resolves(name: str) -> None:
    resolve(name)


@pytest.mark.parametrize("path", py_paths())
def test_path_exists(path: str) -> None:
    where = [r / path for r in PATH_ROOTS]
    assert any(p.is_file() for p in where), f"{path}: none of {[str(p) for p in where]}"


def test_modules_section_lists_importable_modules() -> None:
    text = DOC.read_text(encoding="utf-8")
    assert "\n## Modules\n" in text, "docs/architecture.md has no '## Modules' section"
    section = text.split("\n## Modules\n", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"^\* `((?:gcache|gcache_client)[A-Za-z0-9_.]*)`", section, re.M)
    assert len(listed) >= 30
    for name in listed:
        resolve(name)
