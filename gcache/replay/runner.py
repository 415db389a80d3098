"""Replay one trace through one policy at one capacity, and sweeps of them.

Each request does what a client does: look up the prompt's keys (leaving at least
one token to compute, as an engine must, so ``(input_length - 1) // block_size``
keys), read the match (a leased lookup touches what it returns; the lease ends
before the put), then put every full block of the prompt with the strict O(W)
masks and ``checkpoint_from`` = the first block whose sliding rows it holds (the
window it loaded, ``match - tail``), so the meta's checkpoint rule runs exactly as
for the real client. All of it is :class:`~gcache.meta.core.MetaCore` code:
``match``/``pick`` are ``lookup`` without the grants, ``place``/``commit`` are
``put_begin``/``put_commit`` without the grants and the network.

Tiers (:mod:`gcache.replay.tiers`): with ``nvme_capacity`` the server has an NVMe
tier and the meta's own demotion code moves what leaves DRAM there (every demotion
completes before the next request); every match goes through the client's
load-or-recompute rule at the tiers' read bandwidths, and the row reports hits per
tier and the FLOPs saved net of the fetch time.

Policies: ``lru`` and ``cost`` (GCache, checkpoints on), ``strict`` (lru, strict
O(W) without checkpoints), ``belady`` (the offline reference, checkpoints on) and
``naive`` (every layer of every block in one object, lru: a store that does not
know about sliding windows).
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from gcache import wire
from gcache.config import ClientConfig, MetaConfig
from gcache.layout import LayerSpec, Layout, LayoutSpec, preset
from gcache.meta.core import MetaCore
from gcache.meta.eviction import ModelCompute, compute_for_layout
from gcache.replay.belady import BeladyPolicy, Oracle
from gcache.replay.tiers import ServerSim, load_plan, nvme_positions
from gcache.replay.trace import Trace

POLICIES = ("naive", "strict", "lru", "cost", "belady")
DEFAULT_POLICIES = POLICIES


@dataclass(frozen=True)
class Options:
    layout: str = "mimo-v2-flash"
    block_size: int = 64
    checkpoint_interval: int = MetaConfig.checkpoint_interval
    high_watermark: float = MetaConfig.high_watermark
    low_watermark: float = MetaConfig.low_watermark
    # Tiers and the load-or-recompute rule (see gcache.replay.tiers).
    dram_gbps: float = 25.0  # read bandwidth from a server's DRAM into the engine
    nvme_gbps: float = 5.0  # read bandwidth from a server's NVMe tier into the engine
    compute_tflops: float = MetaConfig.compute_tflops  # the fleet's prefill rate (GPU engines)
    load_or_recompute: bool = ClientConfig.load_or_recompute
    promotion: str = MetaConfig.promotion  # "off" or "hits:N"


def naive_spec(spec: LayoutSpec) -> LayoutSpec:
    """The same layers with no window: one object per block holds all of them."""
    layers = tuple(
        LayerSpec("full", layer.kv_heads, layer.k_head_dim, layer.v_head_dim)
        for layer in spec.layers
    )
    return LayoutSpec(spec.block_size, spec.dtype, layers)


def replay(
    trace: Trace,
    policy: str,
    capacity: int,
    opts: Options,
    oracle: Oracle | None = None,
    progress: Callable[[int], None] | None = None,
    nvme_capacity: int = 0,
) -> dict[str, Any]:
    """Replay ``trace`` and return the figures of one row of the report: DRAM of
    ``capacity`` bytes, and an NVMe tier of ``nvme_capacity`` (0: none)."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; known: {', '.join(POLICIES)}")
    spec = preset(opts.layout, opts.block_size)
    compute: ModelCompute = compute_for_layout(Layout(spec))
    hybrid = Layout(spec)
    if policy == "naive":
        spec = naive_spec(spec)
    checkpoints = policy in ("lru", "cost", "belady")
    cfg = MetaConfig(
        eviction_policy="cost" if policy == "cost" else "lru",
        checkpoint_interval=opts.checkpoint_interval if checkpoints else 0,
        high_watermark=opts.high_watermark,
        low_watermark=opts.low_watermark,
        max_keys_per_request=1 << 30,
        compute_tflops=opts.compute_tflops,
        # Every demotion completes before the next request (ServerSim): none waits.
        max_demotions_in_flight=1 << 30,
        promotion=opts.promotion,
    )
    cfg.check()
    core = MetaCore(cfg)
    belady: BeladyPolicy | None = None
    addr = wire.ServerAddr(
        "replay", "127.0.0.1", 1, "replay", "", 1, opts.dram_gbps, opts.nvme_gbps
    )
    srv = core.register_server(
        addr, bytes(16), 1, capacity, 0.0,
        nvme_capacity=nvme_capacity, nvme_read_gbps=opts.nvme_gbps,
    )  # fmt: skip
    server = ServerSim(core, srv)
    servers = [addr]
    ns = core.register_namespace({"model": f"replay-{policy}"}, spec)
    layout = ns.layout
    tail = ns.max_tail
    if policy == "belady":
        belady = BeladyPolicy(oracle or Oracle(trace, tail))
        core.policy = belady
    bs = layout.block_size
    fg = ns.full_group
    # SWA bytes of one naive object: the windowed layers' share of all its layers.
    swa_layers = [i for i, g in enumerate(hybrid.layer_group) if hybrid.group_windows[g]]
    naive_swa = sum(hybrid.layer_k_bytes[i] + hybrid.layer_v_bytes[i] for i in swa_layers)
    window_bytes = sum(t * layout.group_object_bytes[g] for g, t in ns.windowed)
    masks_of: dict[int, list[int]] = {}
    prefix = compute.prefix
    entries = ns.entries
    match, pick, place, commit = core.match, core.pick, core.place, core.commit
    rate = opts.compute_tflops * 1e12
    cut = opts.load_or_recompute
    hit_tokens = nvme_hit_blocks = nvme_matches = 0
    saved = total = 0.0
    loaded_tokens = matches_cut = blocks_cut = 0
    loaded_saved = nvme_saved = 0.0
    fetch_dram = fetch_nvme = 0.0
    read_dram = read_nvme = 0
    full_bytes = swa_bytes = 0
    ckpts = end_windows = 0
    blocks = 0
    # The index drops what it evicts by reference counting; the cyclic collector
    # would only rescan millions of live records again and again.
    gc_was = gc.isenabled()
    gc.disable()
    t0 = time.perf_counter()
    c0 = time.process_time()
    for r, keys in enumerate(trace.keys):
        now = trace.times[r]
        length = trace.lengths[r]
        n = len(keys)
        blocks += n
        total += prefix(length)
        if belady is not None:
            belady.clock = r
        p = match(ns, keys, min(n, (length - 1) // bs))
        q = 0
        if p:
            picked = pick(ns, keys, p, now)
            hit_tokens += p * bs
            saved += prefix(p * bs)
            if nvme_capacity:
                on_nvme = len(nvme_positions(picked))
                nvme_hit_blocks += on_nvme
                nvme_matches += on_nvme > 0
            got = load_plan(core, ns, keys, p, picked, compute, servers, opts.compute_tflops,
                            now, cut)  # fmt: skip
            q = got.blocks
            if q < p:
                matches_cut += 1
                blocks_cut += p - q
            if q:
                gain = prefix(q * bs)
                loaded_tokens += q * bs
                loaded_saved += gain
                nvme_saved += got.nvme_flops
                fetch_dram += got.fetch_s[0]
                fetch_nvme += got.fetch_s[1]
                for o in got.objects:
                    if o.tier:
                        read_nvme += o.length
                    else:
                        read_dram += o.length
        if belady is not None:
            b = belady.oracle.shared[r]
            if p < b:  # predicted uses that did not happen: re-key them
                for k in keys[max(0, min(p, b - tail)) : b]:
                    e = entries.get(k)
                    if e is not None:
                        belady.refresh(e, ns)
        if not n:
            continue
        masks = masks_of.get(n)
        if masks is None:
            masks = masks_of[n] = layout.groups_to_store(n)
        plan = place(ns, keys, masks, now, max(0, q - tail) if checkpoints else -1)
        placed, cps = plan.placements, plan.checkpoints
        if placed:
            commit(ns, keys, placed, None, now)
        server.drain(now)  # the heartbeat: demotions done, outboxes empty
        if not placed:
            continue
        end = False
        for block, g, _, _, size in placed:
            if g == fg:
                full_bytes += size
            else:
                swa_bytes += size
                if block >= n - tail:
                    end = True
        end_windows += end
        if cps:
            have = {pl[0] for pl in placed if pl[1] != fg}
            ckpts += sum(1 for c in cps if any(j in have for j in range(c - tail, c)))
        if progress is not None and r % 500 == 0:
            progress(r)
    wall = time.perf_counter() - t0
    cpu = time.process_time() - c0
    if gc_was:
        gc.enable()
    if policy == "naive":
        objs = full_bytes // layout.group_object_bytes[0]
        swa_bytes = objs * naive_swa
        full_bytes -= swa_bytes
    bound = (end_windows + ckpts) * window_bytes
    stats = core.stats()
    pol: Any = core.policy
    fetch_flops = (fetch_dram + fetch_nvme) * rate
    span_s = trace.times[-1] - trace.times[0] if trace.requests > 1 else 0.0
    demoted = int(stats["demoted_bytes"])
    return {
        "policy": policy,
        "capacity_bytes": capacity,
        "nvme_capacity_bytes": nvme_capacity,
        "requests": trace.requests,
        "blocks": blocks,
        "token_hit_rate": hit_tokens / trace.tokens,
        "dram_hit_rate": (hit_tokens - nvme_hit_blocks * bs) / trace.tokens,
        "nvme_hit_rate": nvme_hit_blocks * bs / trace.tokens,
        "matches_reading_nvme": nvme_matches,
        "flops_saved": saved / total if total else 0.0,
        "flops_saved_abs": saved,
        "flops_total": total,
        # What the client loads after the load-or-recompute rule, and net of fetching it.
        "loaded_token_rate": loaded_tokens / trace.tokens,
        "flops_saved_loaded": loaded_saved / total if total else 0.0,
        "flops_saved_dram": (loaded_saved - nvme_saved) / total if total else 0.0,
        "flops_saved_nvme": nvme_saved / total if total else 0.0,
        "flops_saved_net": (loaded_saved - fetch_flops) / total if total else 0.0,
        "fetch_seconds_dram": fetch_dram,
        "fetch_seconds_nvme": fetch_nvme,
        "read_bytes_dram": read_dram,
        "read_bytes_nvme": read_nvme,
        "matches_cut": matches_cut,
        "blocks_cut": blocks_cut,
        "dram_gbps": opts.dram_gbps,
        "nvme_gbps": opts.nvme_gbps,
        "compute_tflops": opts.compute_tflops,
        "load_or_recompute": cut,
        "bytes_stored": full_bytes + swa_bytes,
        "swa_bytes_stored": swa_bytes,
        "resident_bytes": int(stats["bytes_stored"]),
        "nvme_resident_bytes": int(stats["nvme_used"]),
        "checkpoints_saved": ckpts,
        "end_windows_saved": end_windows,
        "swa_vs_required": swa_bytes / bound if bound else None,
        "objects_evicted": int(stats["evictions"]),
        "objects_demoted": int(stats["demotions_done"]),
        "objects_promoted": int(stats["promotions_done"]),
        "promotion": opts.promotion,
        "demoted_bytes": demoted,
        "dropped_not_demoted": int(stats["dropped_not_demoted"]),
        "nvme_evictions": int(stats["nvme_evictions"]),
        # Mean NVMe write rate the demotions need over the trace's span.
        "demote_gbps": demoted / span_s / 1e9 if span_s > 0 else 0.0,
        "seconds": wall,
        "cpu_seconds": cpu,
        "blocks_per_s": blocks / cpu if cpu > 0 else 0.0,
        "policy_stats": pol.stats(),
    }


# ---- sweeps ----------------------------------------------------------------------------

_TRACE: Trace | None = None
_ORACLE: Oracle | None = None
_OPTS = Options()


def _job(args: tuple[str, int, int]) -> dict[str, Any]:
    assert _TRACE is not None
    policy, capacity, nvme = args
    oracle = _ORACLE if policy == "belady" else None
    return replay(_TRACE, policy, capacity, _OPTS, oracle, nvme_capacity=nvme)


def sweep(
    trace: Trace,
    policies: Sequence[str],
    capacities: Sequence[int],
    opts: Options,
    jobs: int = 0,
    done: Callable[[dict[str, Any]], None] | None = None,
    nvme_capacities: Sequence[int] = (0,),
) -> list[dict[str, Any]]:
    """Every (policy, DRAM capacity, NVMe capacity), ``jobs`` processes at a time
    (default: one per core). Each job replays on one core; the trace is shared by
    fork."""
    global _TRACE, _ORACLE, _OPTS
    _TRACE, _OPTS = trace, opts
    tail = Layout(preset(opts.layout, opts.block_size)).group_tail_blocks
    if "belady" in policies:
        _ORACLE = Oracle(trace, max((t for t in tail if t is not None), default=0))
    work = [(p, c, n) for c in capacities for n in nvme_capacities for p in policies]
    # Longest first (belady, then cost), so the pool drains evenly.
    order = {"belady": 0, "cost": 1, "lru": 2, "strict": 3, "naive": 4}
    work.sort(key=lambda w: (order.get(w[0], 5), -w[1], -w[2]))
    jobs = jobs or os.cpu_count() or 1
    rows: list[dict[str, Any]] = []
    if jobs == 1 or len(work) == 1:
        for w in work:
            rows.append(_job(w))
            if done is not None:
                done(rows[-1])
    else:
        ctx = multiprocessing.get_context("fork")
        with ctx.Pool(min(jobs, len(work))) as pool:
            for row in pool.imap_unordered(_job, work):
                rows.append(row)
                if done is not None:
                    done(row)
    rows.sort(
        key=lambda r: (r["capacity_bytes"], r["nvme_capacity_bytes"], POLICIES.index(r["policy"]))
    )
    return rows
