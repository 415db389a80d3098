"""A GCacheConnector that SIGKILLs the GCache servers named in
``GCACHE_TEST_KILL_PIDS`` right after its worker started its first load (reads in
flight), for the "killed server during a load" end-to-end test. Test-only."""

from __future__ import annotations

import os
import signal
from typing import Any

from gcache_client.vllm import GCacheConnector as _Base


class GCacheConnector(_Base):  # type: ignore[misc]
    _killed = False

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        super().start_load_kv(forward_context, **kwargs)
        pids = os.environ.get("GCACHE_TEST_KILL_PIDS", "")
        if pids and not GCacheConnector._killed and self._work is not None and self._work.loads:
            GCacheConnector._killed = True
            for pid in pids.split(","):
                os.kill(int(pid), signal.SIGKILL)
