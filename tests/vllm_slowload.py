"""A GCacheConnector whose async loads start ``$GCACHE_TEST_LOAD_DELAY_S`` seconds
late (on the loader thread), so a test can abort a request while its load is
surely in flight (tests/integration/test_vllm_events.py). Test-only; without the
variable it is the plain connector."""

from __future__ import annotations

import os
import time
from typing import Any

from gcache_client.engines.vllm.connector import GCacheConnector as _Base


class GCacheConnector(_Base):  # type: ignore[misc]
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        delay = float(os.environ.get("GCACHE_TEST_LOAD_DELAY_S", "0") or 0)
        work = self._work
        if work is None or delay <= 0:
            return
        load_all = work._load_all

        def slow(ld: Any) -> str:
            with open(os.environ["GCACHE_TEST_LOAD_MARK"], "a") as fh:
                fh.write(f"{ld.req_id}\n")  # the load is in flight
            time.sleep(delay)
            return str(load_all(ld))

        work._load_all = slow
