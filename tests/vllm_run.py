"""One vLLM process of the end-to-end tests: a driver script (tests/vllm_driver.py,
tests/vllm_mm_driver.py) run under ``.venv-vllm/bin/python`` in the background
with its spec as JSON; ``result()`` waits for it and returns its JSON and log."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"
DRIVER = ROOT / "tests" / "vllm_driver.py"
MM_DRIVER = ROOT / "tests" / "vllm_mm_driver.py"
# The child imports this tree's gcache and gcache_client, ahead of an installed copy.
TREE_PATH = os.pathsep.join([str(ROOT), str(ROOT / "client")])
PROC_TIMEOUT = 300  # one process takes ~40 s


class Run:
    """One vLLM process (tests/vllm_driver.py) for one role, started in the
    background; ``result()`` waits for it and returns its JSON (with its log)."""

    def __init__(
        self,
        tmp: Path,
        name: str,
        spec: dict[str, Any],
        env: dict[str, str] | None = None,
        driver: Path = DRIVER,
    ) -> None:
        self.name, self.out, self.log = name, tmp / f"{name}.out", tmp / f"{name}.log"
        spec_path = tmp / f"{name}.json"
        spec_path.write_text(json.dumps(spec))
        penv = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": TREE_PATH, **(env or {})}
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [str(VLLM_PY), str(driver), str(spec_path), str(self.out)],
                cwd=ROOT,
                env=penv,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self.t0 = time.monotonic()
        self._result: dict[str, Any] | None = None

    def result(self) -> dict[str, Any]:
        if self._result is None:
            try:
                rc = self.proc.wait(timeout=PROC_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                rc = self.proc.wait()
            wall = time.monotonic() - self.t0
            text = self.log.read_text(errors="replace")
            assert rc == 0 and self.out.exists(), f"vLLM {self.name} exited {rc}:\n{text[-4000:]}"
            self._result = {**json.loads(self.out.read_text()), "log": text, "wall": wall}
        return self._result
