"""The committed gRPC modules are exactly what proto/generate.py produces."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "gcache" / "_proto"
FILES = ("gcache_pb2.py", "gcache_pb2.pyi", "gcache_pb2_grpc.py")


def _load_generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "gcache_proto_generate", ROOT / "proto" / "generate.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("grpc_tools")
    out = tmp_path_factory.mktemp("proto") / "out"
    _load_generator().generate(out)
    return out


@pytest.mark.parametrize("name", FILES)
def test_committed_module_is_regenerated_identically(generated: Path, name: str) -> None:
    fresh = (generated / name).read_bytes()
    committed = (COMMITTED / name).read_bytes()
    assert fresh == committed, (
        f"gcache/_proto/{name} is stale: run `python proto/generate.py` and commit"
    )


def test_generated_grpc_module_imports_package_path(generated: Path) -> None:
    text = (generated / "gcache_pb2_grpc.py").read_text()
    assert "from gcache._proto import gcache_pb2 as gcache__pb2" in text
    assert "\nimport gcache_pb2 as" not in text


def test_generated_files_are_exactly_these(generated: Path) -> None:
    assert sorted(p.name for p in generated.iterdir()) == sorted(FILES)
