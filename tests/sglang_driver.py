"""Runs under ``.venv-sglang/bin/python``: drives ``gcache_client.engines.sglang`` with
SGLang's OWN classes (``HiCacheStorageConfig``, ``StorageBackendFactory``'s
dynamic loader, ``MHATokenToKVPoolHost`` / ``MLATokenToKVPoolHost`` host pools
on CPU, ``PoolTransfer`` / ``PoolHitPolicy``) against a running GCache deployment,
calling the backend as SGLang's cache controllers do, and writes what it saw to
OUT.json (one entry per case; the test asserts on it).

    python tests/sglang_driver.py SPEC.json OUT.json

SPEC: meta, meta_grpc (the deployment), server_pids (killed by the last case).
Every case is independent (its own keys); a case that raises records ``error``.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
from sglang.srt.mem_cache.device_pool_info import (
    KVBufferLayout,
    KVBuffers,
    MHABufferInfo,
    MLABufferInfo,
)
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

from gcache.cli.deploy import fetch_stats
from gcache.errors import ConfigError

PAGE = 4  # tokens per page
DEVICE_TOKENS = 64  # the device pool the host pool mirrors (host: 2x)
SPEC: dict[str, Any] = {}


def counters() -> dict[str, float]:
    return dict(fetch_stats(SPEC["meta_grpc"]).counters)


def storage_config(
    *, tp_rank: int = 0, tp_size: int = 1, mla: bool = False, page_first: bool = True, **extra: Any
) -> HiCacheStorageConfig:
    """What SGLang's cache controller builds (``_generate_storage_config``)."""
    return HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=mla,
        enable_storage_metrics=True,
        is_page_first_layout=page_first,
        model_name="test/tiny-model",
        extra_config={
            "backend_name": "gcache",
            "module_path": "gcache_client.sglang",
            "class_name": "GCacheHiCacheStorage",
            "interface_v1": 1,
            "meta": SPEC["meta"],
            "meta_grpc": SPEC["meta_grpc"],
            **extra,
        },
    )


def mha_pool(layout: str, layers: int = 2, heads: int = 2, dim: int = 8, label: str = "kv") -> Any:
    k = tuple(torch.zeros(DEVICE_TOKENS, heads, dim, dtype=torch.bfloat16) for _ in range(layers))
    v = tuple(torch.zeros(DEVICE_TOKENS, heads, dim, dtype=torch.bfloat16) for _ in range(layers))
    ptrs = [torch.tensor([t.data_ptr() for t in x], dtype=torch.uint64) for x in (k, v)]
    info = MHABufferInfo(
        buffers=KVBuffers(
            k=k, v=v, k_data_ptrs=ptrs[0], v_data_ptrs=ptrs[1], layout=KVBufferLayout.NHD
        ),
        page_size=PAGE,
        head_num=heads,
        head_dim=dim,
        v_head_dim=dim,
        dtype=torch.bfloat16,
        device=torch.device("cpu"),
    )
    return MHATokenToKVPoolHost(
        info,
        2.0,
        0,
        PAGE,
        layout,
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=DEVICE_TOKENS,
        start_layer=0,
        end_layer=layers,
        pool_label=label,
    )


def mla_pool(layout: str, layers: int = 2, width: int = 24) -> Any:
    bufs = tuple(torch.zeros(DEVICE_TOKENS, 1, width, dtype=torch.bfloat16) for _ in range(layers))
    info = MLABufferInfo(
        buffers=bufs,
        data_ptrs=None,
        layer_indices=tuple(range(layers)),
        device_layer_num=layers,
        page_size=PAGE,
        kv_lora_rank=width - 8,
        qk_rope_head_dim=8,
        kv_cache_dim=width,
        dtype=torch.bfloat16,
        device=torch.device("cpu"),
    )
    return MLATokenToKVPoolHost(
        info,
        2.0,
        0,
        PAGE,
        layout,
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=DEVICE_TOKENS,
        start_layer=0,
        end_layer=layers,
        target_layer_num=layers,
    )


def backend(pool: Any, cfg: HiCacheStorageConfig, extra_pools: dict[str, Any] | None = None) -> Any:
    """As ``CacheController.attach_storage_backend`` (and the hybrid controller) do."""
    b = StorageBackendFactory.create_backend("dynamic", cfg, pool)
    b.register_mem_pool_host(pool)
    for name, p in (extra_pools or {}).items():
        b.register_mem_host_pool_v2(p, name)
    b.on_host_pools_registered()
    return b


def fill(pool: Any, idx: torch.Tensor, seed: int) -> None:
    """Random bytes into the pages at ``idx`` (through SGLang's own page accessors)."""
    g = torch.Generator().manual_seed(seed)
    for start in idx[::PAGE].tolist():
        page = pool.get_data_page(start, flat=True)
        raw = torch.randint(0, 256, (page.numel() * page.element_size(),), generator=g)
        pool.set_from_flat_data_page(start, raw.to(torch.uint8).view(pool.dtype))


def pages(pool: Any, idx: torch.Tensor) -> list[bytes]:
    return [
        pool.get_data_page(s, flat=True).contiguous().view(torch.uint8).numpy().tobytes()
        for s in idx[::PAGE].tolist()
    ]


def keys(tag: str, n: int) -> list[str]:
    rnd = random.Random(tag)
    return [f"{tag}-{rnd.getrandbits(64):016x}-{i}" for i in range(n)]


# ---- cases --------------------------------------------------------------------------------


def case_factory() -> dict[str, Any]:
    pool = mha_pool("page_first")
    b = backend(pool, storage_config())
    out = {"class": type(b).__name__, "module": type(b).__module__}
    try:
        storage_config_bad = storage_config(bogus_setting=1)
        StorageBackendFactory.create_backend("dynamic", storage_config_bad, pool)
        out["unknown_key_error"] = ""
    except ConfigError as exc:
        out["unknown_key_error"] = str(exc)
    try:
        StorageBackendFactory.create_backend("dynamic", storage_config(timeout_s="5"), pool)
        out["bad_type_error"] = ""
    except ConfigError as exc:
        out["bad_type_error"] = str(exc)
    b.close()
    return out


def case_layouts() -> dict[str, Any]:
    """v1 zero copy for each layout: set, exists, get into other pages, bytes equal."""
    out: dict[str, Any] = {}
    for mla in (False, True):
        for layout in ("layer_first", "page_first", "page_first_direct"):
            pool = mla_pool(layout) if mla else mha_pool(layout)
            b = backend(pool, storage_config(mla=mla, page_first=layout == "page_first"))
            src, dst = pool.alloc(6 * PAGE), pool.alloc(6 * PAGE)
            fill(pool, src, seed=len(out))
            ks = keys(f"layout-{mla}-{layout}", 6)
            before = counters()["bytes_stored"]
            r: dict[str, Any] = {
                "set": b.batch_set_v1(ks, src),
                "stored_delta": counters()["bytes_stored"] - before,
                "page_bytes": len(pages(pool, src[:PAGE])[0]),
                "exists": b.batch_exists(ks, HiCacheStorageExtraInfo(prefix_keys=None)),
                "exists_more": b.batch_exists([*ks, "absent-key"]),
                "exists_first_absent": b.batch_exists(["absent-key", *ks]),
                "exists_one": b.exists(ks[0]),
                "set_again": b.batch_set_v1(ks, src),
                "stored_delta_again": counters()["bytes_stored"] - before,
                "get": b.batch_get_v1(ks, dst),
                "equal": pages(pool, src) == pages(pool, dst),
                "get_absent": b.batch_get_v1([ks[0], "absent-key"], pool.alloc(2 * PAGE)),
            }
            out[f"{'mla' if mla else 'mha'}.{layout}"] = r
            b.close()
    try:
        backend(mha_pool("page_unified"), storage_config(page_first=False))
        out["unsupported_error"] = ""
    except ConfigError as exc:
        out["unsupported_error"] = str(exc)
    return out


def case_flat() -> dict[str, Any]:
    """SGLang's generic (non zero copy) path: get_data_page -> batch_set, batch_get
    into dummy flat pages -> set_from_flat_data_page; single-key set/get/exists."""
    pool = mha_pool("layer_first")
    cfg = storage_config(page_first=False)
    cfg.extra_config.pop("interface_v1")
    b = backend(pool, cfg)
    src, dst = pool.alloc(3 * PAGE), pool.alloc(3 * PAGE)
    fill(pool, src, seed=99)
    ks = keys("flat", 3)
    data = [pool.get_data_page(s) for s in src[::PAGE].tolist()]
    out: dict[str, Any] = {"set": b.batch_set(ks, data), "exists": b.batch_exists(ks)}
    got = b.batch_get(ks, [pool.get_dummy_flat_data_page() for _ in ks])
    out["got"] = [g is not None for g in got]
    for s, g in zip(dst[::PAGE].tolist(), got, strict=True):
        pool.set_from_flat_data_page(s, g)
    out["equal"] = pages(pool, src) == pages(pool, dst)
    one = keys("flat-one", 1)[0]
    out["set_one"] = b.set(one, pool.get_data_page(int(src[0])))
    out["exists_one"] = b.exists(one)
    page = b.get(one, pool.get_dummy_flat_data_page())
    out["get_one_equal"] = (
        page is not None and bytes(page.view(torch.uint8).numpy()) == pages(pool, src[:PAGE])[0]
    )
    out["get_absent"] = b.get("absent-key", pool.get_dummy_flat_data_page()) is None
    # the zero-copy namespace never sees flat pages: other bytes, other keys
    zc = backend(pool, storage_config(page_first=False))
    out["v1_sees_flat"] = zc.batch_exists(ks)
    b.close()
    zc.close()
    return out


def case_tp() -> dict[str, Any]:
    """TP=2: each rank its own shard; a rank never reads the other's."""
    pools = [mha_pool("page_first"), mha_pool("page_first")]
    bs = [backend(p, storage_config(tp_rank=r, tp_size=2)) for r, p in enumerate(pools)]
    ks = keys("tp", 4)
    idx = [p.alloc(4 * PAGE) for p in pools]
    fill(pools[0], idx[0], seed=1)
    fill(pools[1], idx[1], seed=2)
    out: dict[str, Any] = {"set0": bs[0].batch_set_v1(ks, idx[0])}
    out["exists1_before"] = bs[1].batch_exists(ks)
    out["get1_before"] = bs[1].batch_get_v1(ks, pools[1].alloc(4 * PAGE))
    out["set1"] = bs[1].batch_set_v1(ks, idx[1])
    dst = [p.alloc(4 * PAGE) for p in pools]
    out["get0"] = bs[0].batch_get_v1(ks, dst[0])
    out["get1"] = bs[1].batch_get_v1(ks, dst[1])
    out["own0"] = pages(pools[0], dst[0]) == pages(pools[0], idx[0])
    out["own1"] = pages(pools[1], dst[1]) == pages(pools[1], idx[1])
    out["shards_differ"] = pages(pools[0], dst[0]) != pages(pools[1], dst[1])
    for b in bs:
        b.close()
    return out


def case_mla() -> dict[str, Any]:
    """MLA, TP=2: only rank 0 (the storage writer) stores; rank 1 reads that copy."""
    pools = [mla_pool("page_first"), mla_pool("page_first")]
    bs = [backend(p, storage_config(tp_rank=r, tp_size=2, mla=True)) for r, p in enumerate(pools)]
    ks = keys("mla", 4)
    idx = [p.alloc(4 * PAGE) for p in pools]
    fill(pools[0], idx[0], seed=3)
    fill(pools[1], idx[1], seed=4)
    before = counters()["bytes_stored"]
    out: dict[str, Any] = {"writer": [b.storage_config.is_storage_writer for b in bs]}
    out["set1"] = bs[1].batch_set_v1(ks, idx[1])
    out["stored_after_rank1"] = counters()["bytes_stored"] - before
    out["exists_after_rank1"] = bs[0].batch_exists(ks)
    out["set0"] = bs[0].batch_set_v1(ks, idx[0])
    out["stored_after_rank0"] = counters()["bytes_stored"] - before
    out["page_bytes"] = len(pages(pools[0], idx[0][:PAGE])[0])
    out["exists1"] = bs[1].batch_exists(ks)
    dst = pools[1].alloc(4 * PAGE)
    out["get1"] = bs[1].batch_get_v1(ks, dst)
    out["rank1_has_rank0_bytes"] = pages(pools[1], dst) == pages(pools[0], idx[0])
    for b in bs:
        b.close()
    return out


def case_hybrid() -> dict[str, Any]:
    """v2: a KV pool (full layers) and an SWA pool (sliding layers); an 8-page node
    written with every SWA page handed over; max_trailing_pages {"swa": 2}: only
    the trailing window goes in (strict O(W))."""
    kv = mha_pool("page_first", layers=2)
    swa = mha_pool("page_first", layers=3, heads=4, label="swa")
    b = backend(kv, storage_config(max_trailing_pages={"swa": 2}), {PoolName.SWA: swa})
    n = 8
    ks = keys("hybrid", n)
    kv_idx, swa_idx = kv.alloc(n * PAGE), swa.alloc(n * PAGE)
    fill(kv, kv_idx, seed=5)
    fill(swa, swa_idx, seed=6)
    out: dict[str, Any] = {
        "kv_page_bytes": len(pages(kv, kv_idx[:PAGE])[0]),
        "swa_page_bytes": len(pages(swa, swa_idx[:PAGE])[0]),
    }
    before = counters()
    out["set_kv"] = b.batch_set_v1(ks, kv_idx)
    out["set_v2"] = b.batch_set_v2(
        [
            PoolTransfer(
                name=PoolName.SWA,
                host_indices=swa_idx,
                keys=ks,
                hit_policy=PoolHitPolicy.TRAILING_PAGES,
            )
        ]
    )
    after = counters()
    out["stored_delta"] = after["bytes_stored"] - before["bytes_stored"]
    out["objects_delta"] = after["objects"] - before["objects"]

    def exists_v2(n_keys: int, trailing: int, policy: PoolHitPolicy) -> dict[str, Any]:
        t = PoolTransfer(name=PoolName.SWA, keys=["__placeholder__"] * trailing, hit_policy=policy)
        r: PoolTransferResult = b.batch_exists_v2(ks[:n_keys], [t])
        return {
            "kv_hit_pages": r.kv_hit_pages,
            "extra": {str(k): v for k, v in r.extra_pool_hit_pages.items()},
            "restorable": r.restorable_prefix_pages,
        }

    out["exists_full_window2"] = exists_v2(n, 2, PoolHitPolicy.TRAILING_PAGES)
    out["exists_cut_window2"] = exists_v2(n - 1, 2, PoolHitPolicy.TRAILING_PAGES)
    out["exists_all_pages"] = exists_v2(n, 2, PoolHitPolicy.ALL_PAGES)
    out["exists_no_pools"] = b.batch_exists_v2(ks, None).kv_hit_pages
    # load as the hybrid controller does: KV pages (v1), then the SWA window (v2)
    kv_dst, swa_dst = kv.alloc(n * PAGE), swa.alloc(2 * PAGE)
    out["get_kv"] = b.batch_get_v1(ks, kv_dst)
    got = b.batch_get_v2(
        [
            PoolTransfer(
                name=PoolName.SWA,
                host_indices=swa_dst,
                keys=ks[n - 2 :],
                hit_policy=PoolHitPolicy.TRAILING_PAGES,
            )
        ]
    )
    out["get_swa"] = {str(k): v for k, v in got.items()}
    out["kv_equal"] = pages(kv, kv_dst) == pages(kv, kv_idx)
    out["swa_equal"] = pages(swa, swa_dst) == pages(swa, swa_idx[(n - 2) * PAGE :])
    out["get_swa_outside_window"] = {
        str(k): v
        for k, v in b.batch_get_v2(
            [PoolTransfer(name=PoolName.SWA, host_indices=swa.alloc(PAGE), keys=ks[:1])]
        ).items()
    }
    b.close()
    return out


def case_stats_clear() -> dict[str, Any]:
    pool = mha_pool("page_first")
    b = backend(pool, storage_config())
    ks = keys("clear", 5)
    idx = pool.alloc(5 * PAGE)
    fill(pool, idx, seed=7)
    out: dict[str, Any] = {"set": b.batch_set_v1(ks, idx)}
    b.batch_get_v1(ks, pool.alloc(5 * PAGE))
    m = b.get_stats()
    out["metrics_type"] = type(m).__name__
    out["backup_pgs"] = list(m.backup_pgs)
    out["prefetch_pgs"] = list(m.prefetch_pgs)
    out["metrics_drained"] = list(b.get_stats().backup_pgs)
    out["stats"] = b.stats()
    out["exists_before_clear"] = b.batch_exists(ks)
    out["clear"] = b.clear()
    out["exists_after_clear"] = b.batch_exists(ks)
    b.close()
    out["after_close_exists"] = b.batch_exists(ks)
    return out


def case_store_down() -> dict[str, Any]:
    """Meta unreachable from the start: constructs, every call is a miss."""
    pool = mha_pool("page_first")
    cfg = storage_config(meta="127.0.0.1:9", meta_grpc="127.0.0.1:9", timeout_s=0.5)
    b = backend(pool, cfg)
    ks = keys("down", 3)
    idx = pool.alloc(3 * PAGE)
    t0 = time.monotonic()
    out = {
        "exists": b.batch_exists(ks),
        "set": b.batch_set_v1(ks, idx),
        "get": b.batch_get_v1(ks, idx),
        "secs": time.monotonic() - t0,
    }
    b.close()
    return out


def case_killed() -> dict[str, Any]:
    """Pages stored, then every server SIGKILLed: reads are misses, no exception,
    and no page reported read holds other bytes than were stored."""
    pool = mha_pool("page_first")
    b = backend(pool, storage_config(transport="tcp", timeout_s=2.0))
    ks = keys("killed", 4)
    src = pool.alloc(4 * PAGE)
    fill(pool, src, seed=8)
    out: dict[str, Any] = {"set": b.batch_set_v1(ks, src)}
    for pid in SPEC["server_pids"]:
        os.kill(pid, signal.SIGKILL)
    time.sleep(0.5)
    dst = pool.alloc(4 * PAGE)
    fill(pool, dst, seed=9)
    t0 = time.monotonic()
    got = b.batch_get_v1(ks, dst)
    out["get"] = got
    out["wrong_bytes"] = sum(
        1 for ok, a, c in zip(got, pages(pool, src), pages(pool, dst), strict=True) if ok and a != c
    )
    out["set_after"] = b.batch_set_v1(keys("killed-new", 2), src[: 2 * PAGE])
    out["exists_after"] = b.batch_exists(ks)
    out["secs"] = time.monotonic() - t0
    out["stats"] = b.stats()
    b.close()
    return out


CASES: dict[str, Callable[[], dict[str, Any]]] = {
    "factory": case_factory,
    "layouts": case_layouts,
    "flat": case_flat,
    "tp": case_tp,
    "mla": case_mla,
    "hybrid": case_hybrid,
    "stats_clear": case_stats_clear,
    "store_down": case_store_down,
    "killed": case_killed,  # last: it kills the deployment's servers
}


def main() -> None:
    spec_path, out_path = sys.argv[1], sys.argv[2]
    with open(spec_path) as fh:
        SPEC.update(json.load(fh))
    result: dict[str, Any] = {}
    for name, fn in CASES.items():
        t0 = time.monotonic()
        try:
            result[name] = fn()
        except Exception:
            result[name] = {"error": traceback.format_exc()}
        result[name]["case_secs"] = round(time.monotonic() - t0, 2)
        print(f"case {name}: {result[name]['case_secs']} s", flush=True)
        with open(out_path + ".tmp", "w") as fh:
            json.dump(result, fh, default=str)
        os.replace(out_path + ".tmp", out_path)
    os._exit(0)  # skip the interpreter's teardown of torch and SGLang


if __name__ == "__main__":
    main()
