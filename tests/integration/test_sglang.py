"""The SGLang HiCache storage backend (``gcache_client.engines.sglang``) against a real
local deployment (meta + 2 servers), driven with SGLang 0.5.23's own classes in
``.venv-sglang`` (made by ``make sglang-venv``): ``HiCacheStorageConfig``,
``StorageBackendFactory``'s dynamic loader, ``MHATokenToKVPoolHost`` and
``MLATokenToKVPoolHost`` host pools on CPU, ``PoolTransfer`` / ``PoolHitPolicy``.
One driver process (tests/sglang_driver.py) runs every case, calling the backend
as SGLang's cache controllers do; the tests assert on what it recorded. The last
case SIGKILLs the deployment's servers.

SGLang's engine itself does not run on this CPU (docs/engines.md, "SGLang"):
deploy/sglang_e2e.py is the end-to-end check for a GPU host.

Without ``.venv-sglang`` the module is skipped locally and FAILS under CI.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gcache.cli.deploy import LocalDeployment

ROOT = Path(__file__).resolve().parents[2]
SGLANG_PY = ROOT / ".venv-sglang" / "bin" / "python"
# The child imports this tree's gcache and gcache_client, ahead of an installed copy.
TREE_PATH = os.pathsep.join([str(ROOT), str(ROOT / "client")])
DRIVER = ROOT / "tests" / "sglang_driver.py"

if not SGLANG_PY.exists():
    if os.environ.get("CI", "").lower() not in ("", "0", "false", "no"):
        pytest.fail(f"{SGLANG_PY} missing: `make sglang-venv` must build it", pytrace=False)
    pytest.skip("no .venv-sglang (make sglang-venv)", allow_module_level=True)

LAYOUTS = [
    f"{kind}.{layout}"
    for kind in ("mha", "mla")
    for layout in ("layer_first", "page_first", "page_first_direct")
]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("sglang")
    d = LocalDeployment(tmp / "deploy", servers=2, capacity="64MiB")
    d.start()
    try:
        spec = {
            "meta": d.meta_addr,
            "meta_grpc": d.meta_grpc,
            "server_pids": [s.popen.pid for s in d.servers],
        }
        (tmp / "spec.json").write_text(json.dumps(spec))
        out, log = tmp / "out.json", tmp / "driver.log"
        with open(log, "wb") as fh:
            proc = subprocess.run(
                [str(SGLANG_PY), str(DRIVER), str(tmp / "spec.json"), str(out)],
                cwd=ROOT,
                env={**os.environ, "PYTHONPATH": TREE_PATH},
                stdout=fh,
                stderr=subprocess.STDOUT,
                timeout=240,
            )
        text = log.read_text(errors="replace")
        ok = proc.returncode == 0 and out.exists()
        assert ok, f"driver exited {proc.returncode}:\n{text[-4000:]}"
        yield json.loads(out.read_text())
    finally:
        d.stop()


def case(run: dict[str, Any], name: str) -> dict[str, Any]:
    got = run[name]
    assert "error" not in got, got.get("error")
    return got


def test_dynamic_factory_loads_the_backend_and_refuses_bad_settings(run: dict[str, Any]) -> None:
    c = case(run, "factory")
    assert (c["module"], c["class"]) == ("gcache_client.sglang", "GCacheHiCacheStorage")
    assert "unknown setting 'bogus_setting'" in c["unknown_key_error"]
    assert "\n" not in c["unknown_key_error"]
    assert c["bad_type_error"] == "gcache sglang backend: timeout_s must be float, got str"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_v1_zero_copy_round_trip_is_byte_exact(run: dict[str, Any], layout: str) -> None:
    c = case(run, "layouts")[layout]
    assert c["set"] == [True] * 6
    assert c["stored_delta"] == 6 * c["page_bytes"]  # one object per page, page bytes only
    assert (c["exists"], c["exists_more"], c["exists_first_absent"]) == (6, 6, 0)
    assert c["exists_one"] is True
    assert c["set_again"] == [True] * 6 and c["stored_delta_again"] == c["stored_delta"]  # deduped
    assert c["get"] == [True] * 6 and c["equal"] is True
    assert c["get_absent"] == [True, False]


def test_unsupported_host_layout_is_refused_with_one_line(run: dict[str, Any]) -> None:
    err = case(run, "layouts")["unsupported_error"]
    assert "host layout 'page_unified'" in err and "not supported" in err and "\n" not in err


def test_flat_pages_path_and_single_key_calls(run: dict[str, Any]) -> None:
    c = case(run, "flat")
    assert c["set"] is True and c["exists"] == 3 and c["got"] == [True] * 3
    assert c["equal"] is True
    assert c["set_one"] and c["exists_one"] and c["get_one_equal"] and c["get_absent"]
    assert c["v1_sees_flat"] == 0  # the two page formats never mix


def test_tp_ranks_each_read_only_their_own_shard(run: dict[str, Any]) -> None:
    c = case(run, "tp")
    assert c["set0"] == [True] * 4
    assert c["exists1_before"] == 0 and c["get1_before"] == [False] * 4
    assert c["set1"] == [True] * 4 and c["get0"] == [True] * 4 and c["get1"] == [True] * 4
    assert c["own0"] and c["own1"] and c["shards_differ"]


def test_mla_rank0_writes_rank1_reads_the_one_copy(run: dict[str, Any]) -> None:
    c = case(run, "mla")
    assert c["writer"] == [True, False]
    assert c["set1"] == [True] * 4  # skipped (the writer stores), reported done
    assert c["stored_after_rank1"] == 0 and c["exists_after_rank1"] == 0
    assert c["set0"] == [True] * 4 and c["stored_after_rank0"] == 4 * c["page_bytes"]
    assert c["exists1"] == 4 and c["get1"] == [True] * 4 and c["rank1_has_rank0_bytes"]


def test_sliding_window_pool_stores_only_the_trailing_window(run: dict[str, Any]) -> None:
    c = case(run, "hybrid")
    assert c["set_kv"] == [True] * 8 and c["set_v2"] == {"swa": [True] * 8}
    # 8 KV pages, but of the 8 SWA pages handed over only the 2-page window went in
    assert c["stored_delta"] == 8 * c["kv_page_bytes"] + 2 * c["swa_page_bytes"]
    assert c["objects_delta"] == 10
    full = c["exists_full_window2"]
    assert full == {"kv_hit_pages": 8, "extra": {"kv": 8, "swa": 8}, "restorable": [8]}
    # a prefix one page shorter has no complete window: nothing restorable
    assert c["exists_cut_window2"]["kv_hit_pages"] == 0
    assert c["exists_cut_window2"]["restorable"] == []
    assert c["exists_all_pages"]["kv_hit_pages"] == 0  # ALL_PAGES needs every SWA page
    assert c["exists_no_pools"] == 8
    assert c["get_kv"] == [True] * 8 and c["get_swa"] == {"swa": [True, True]}
    assert c["kv_equal"] and c["swa_equal"]
    assert c["get_swa_outside_window"] == {"swa": [False]}


def test_stats_metrics_and_clear(run: dict[str, Any]) -> None:
    c = case(run, "stats_clear")
    assert c["metrics_type"] == "StorageMetrics"
    assert c["backup_pgs"] == [5] and c["prefetch_pgs"] == [5] and c["metrics_drained"] == []
    s = c["stats"]
    assert s["pages_stored"] == 5 and s["pages_read"] == 5 and s["tracked_pages"] == 5
    assert s["client_hits"] == 5
    assert c["exists_before_clear"] == 5 and c["clear"] is True and c["exists_after_clear"] == 0
    assert c["after_close_exists"] == 0


def test_unreachable_store_is_a_miss_not_an_exception(run: dict[str, Any]) -> None:
    c = case(run, "store_down")
    assert c["exists"] == 0 and c["set"] == [False] * 3 and c["get"] == [False] * 3
    assert c["secs"] < 10


def test_killed_servers_make_misses_and_no_wrong_bytes(run: dict[str, Any]) -> None:
    c = case(run, "killed")
    assert c["set"] == [True] * 4
    assert c["get"] == [False] * 4 and c["wrong_bytes"] == 0
    assert c["set_after"] == [False, False]
    assert c["stats"]["pages_failed_read"] == 4
    assert c["secs"] < 15
