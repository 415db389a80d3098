"""Regenerate the committed gRPC modules from proto/*.proto.

``python proto/generate.py [OUT_DIR]`` (default ``gcache/_proto``). The generated
import of the sibling module is rewritten to a package import so the modules work
from inside ``gcache._proto``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent


def generate(out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    rc = protoc.main(
        [
            "protoc",
            f"-I{ROOT / 'proto'}",
            f"--python_out={out_dir}",
            f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            str(ROOT / "proto" / "gcache.proto"),
        ]
    )
    if rc != 0:
        raise SystemExit(f"protoc failed with exit code {rc}")
    grpc_mod = out_dir / "gcache_pb2_grpc.py"
    text = grpc_mod.read_text()
    grpc_mod.write_text(
        text.replace(
            "import gcache_pb2 as gcache__pb2",
            "from gcache._proto import gcache_pb2 as gcache__pb2",
        )
    )


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "gcache" / "_proto")
