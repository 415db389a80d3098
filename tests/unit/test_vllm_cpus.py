"""gcache_client.engines.vllm.cpus: where the connector's threads run in a vLLM CPU worker
(vLLM binds its OpenMP threads one to a core; the client's copy threads must not
preempt them), and the load mode that follows."""

from __future__ import annotations

import os
import threading

import pytest

from gcache.errors import ConfigError
from gcache_client.engines.vllm.core import BridgeConfig
from gcache_client.engines.vllm.cpus import (
    ThreadPlacer,
    client_cpus,
    omp_cpus,
    parse_cpu_list,
    shares_omp_cores,
)


def test_parse_cpu_list() -> None:
    assert parse_cpu_list("0,2-4 7") == {0, 2, 3, 4, 7}
    assert parse_cpu_list(" 1 ") == {1}
    assert parse_cpu_list("") == set()
    for bad in ("a", "3-1", "-1", "1-x"):
        with pytest.raises(ConfigError):
            parse_cpu_list(bad)


def test_omp_cpus_reads_what_vllm_sets() -> None:
    # vLLM 0.32's configure_omp_envs: GOMP (torch's libgomp), Intel OpenMP, plain
    assert omp_cpus({"GOMP_CPU_AFFINITY": "0 1"}) == {0, 1}
    assert omp_cpus({"KMP_AFFINITY": "granularity=fine,explicit,proclist=[2,3]"}) == {2, 3}
    assert omp_cpus({"OMP_PLACES": "{0,4}", "OMP_PROC_BIND": "true"}) == {0, 4}
    assert omp_cpus({}) is None  # nothing bound (a GPU worker, VLLM_CPU_OMP_THREADS_BIND=nobind)
    assert omp_cpus({"GOMP_CPU_AFFINITY": "garbage"}) is None


def test_client_cpus_auto_takes_the_cores_openmp_left() -> None:
    two = {0, 1}
    # vLLM without a connector on 2 cores: OpenMP on 0, core 1 reserved
    assert client_cpus("auto", {"GOMP_CPU_AFFINITY": "0"}, two) == {1}
    # with a connector vLLM wants to reserve 2 of 2 cores, gives up: OpenMP on both
    assert client_cpus("auto", {"GOMP_CPU_AFFINITY": "0 1"}, two) is None
    assert client_cpus("auto", {}, two) is None
    assert client_cpus("none", {"GOMP_CPU_AFFINITY": "0"}, two) is None
    assert client_cpus("3,5", {"GOMP_CPU_AFFINITY": "0"}, two) == {3, 5}


def test_shares_omp_cores_decides_when_a_load_runs_before_the_forward() -> None:
    two = {0, 1}
    omp0, omp01 = {"GOMP_CPU_AFFINITY": "0"}, {"GOMP_CPU_AFFINITY": "0 1"}
    assert not shares_omp_cores({1}, omp0, two)  # own core: overlap the forward
    assert shares_omp_cores(None, omp01, two)  # OpenMP has every core: load before
    assert shares_omp_cores(None, omp0, two)  # left unplaced: may land on core 0
    assert not shares_omp_cores(None, {}, two)  # nothing bound: the OS spreads them


def test_bridge_config_load_modes_and_client_cpus() -> None:
    assert BridgeConfig().load_mode == "auto"
    assert BridgeConfig().client_cpus == "auto"
    for mode in ("auto", "layerwise", "before", "async"):
        BridgeConfig.from_extra({"load_mode": mode})
    with pytest.raises(ConfigError):
        BridgeConfig.from_extra({"load_mode": "eager"})
    assert BridgeConfig.from_extra({"client_cpus": "1-2"}).client_cpus == "1-2"
    with pytest.raises(ConfigError):
        BridgeConfig.from_extra({"client_cpus": "one"})
    assert not BridgeConfig.from_extra({"store": False}).store


def test_thread_placer_binds_the_clients_threads_once() -> None:
    mine = sorted(os.sched_getaffinity(0))
    target = {mine[-1]}
    stop = threading.Event()
    client = threading.Thread(target=stop.wait, name="gcache-copy_0", daemon=True)
    other = threading.Thread(target=stop.wait, name="engine-thread", daemon=True)
    client.start()
    other.start()
    found = ThreadPlacer(target)
    try:
        placer = ThreadPlacer(target)
        assert placer.place([client, other]) == 1
        assert client.native_id is not None and other.native_id is not None
        assert os.sched_getaffinity(client.native_id) == target
        assert os.sched_getaffinity(other.native_id) == set(mine)  # not ours: untouched
        assert placer.place([client, other]) == 0  # once per thread
        assert ThreadPlacer(None).place() == 0
        # Without a list it finds the client's threads by name among all of the
        # process's (other tests may have left gcache-* threads: put back below).
        assert found.place() >= 1
        assert client.native_id in found.placed and other.native_id not in found.placed
    finally:
        for tid in found.placed:
            try:
                os.sched_setaffinity(tid, set(mine))
            except OSError:
                pass
        stop.set()
        client.join()
        other.join()
