"""A GCacheConnector that SIGKILLs GCache servers right after its worker started a
load (reads in flight), for the "killed server during a load" end-to-end test.
Test-only. Armed by a file: when ``$GCACHE_TEST_KILL_FILE`` exists (written by
tests/vllm_driver.py before its killing phase), the next load kills the pids it
names (comma-separated) and removes it; unarmed, it is the plain connector."""

from __future__ import annotations

import os
import signal
from typing import Any

from gcache_client.engines.vllm.connector import GCacheConnector as _Base


class GCacheConnector(_Base):  # type: ignore[misc]
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        super().start_load_kv(forward_context, **kwargs)
        arm = os.environ.get("GCACHE_TEST_KILL_FILE", "")
        if not arm or self._work is None or not self._work.loads or not os.path.exists(arm):
            return
        with open(arm) as fh:
            pids = fh.read().strip()
        os.unlink(arm)
        for pid in pids.split(","):
            os.kill(int(pid), signal.SIGKILL)
