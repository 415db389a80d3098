"""``gcache replay`` with tiers: the meta's demotion code driven in process (an NVMe
tier keeps what DRAM drops; the worth-a-disk-write rule; NVMe watermarks delete),
hits per tier, and the client's load-or-recompute rule with the FLOPs saved net of
the fetch time."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gcache import wire
from gcache.cli.main import main
from gcache.config import MetaConfig
from gcache.errors import ConfigError
from gcache.layout import preset
from gcache.meta.core import MetaCore
from gcache.replay.runner import Options, replay, sweep
from gcache.replay.tiers import ServerSim
from gcache.replay.trace import Trace, load

GB = 10**9
MB = 10**6
DRAM = 1 * GB  # more than one put, less than a round of the trace below


def rec(ts: int, length: int, ids: list[int]) -> dict[str, object]:
    return {"timestamp": ts, "input_length": length, "output_length": 10, "hash_ids": ids}


def rounds(convs: int = 10, turns: int = 3) -> list[dict[str, object]]:
    """``convs`` conversations, their turns interleaved round by round: a turn comes
    back after every other conversation's turn, so a store that holds fewer than
    ``convs`` prompts reuses nothing."""
    out = []
    for turn in range(turns):
        for c in range(convs):
            base = 10_000 * c
            full = [base + i for i in range(3 * turn + 2)]
            ts = 1000 * (turn * convs + c)
            out.append(rec(ts, 512 * len(full) + 200, [*full, base + 5000 + turn]))
    return out


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Trace:
    p = tmp_path_factory.mktemp("tr") / "rounds.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rounds()))
    return load(p, 64)


def test_nvme_tier_keeps_what_dram_drops(trace: Trace) -> None:
    dram = replay(trace, "lru", DRAM, Options())
    both = replay(trace, "lru", DRAM, Options(), nvme_capacity=20 * GB)
    # DRAM alone holds less than one round: every later turn misses.
    assert dram["token_hit_rate"] == 0 and dram["nvme_hit_rate"] == 0
    assert dram["demoted_bytes"] == 0 and dram["objects_evicted"] > 0
    # With NVMe, what left DRAM was demoted by the meta's rule and hits from there:
    # every later turn (20 of 30) reads from NVMe (at least the window it ends on).
    assert both["objects_demoted"] > 0 and both["demoted_bytes"] > 0
    assert both["matches_reading_nvme"] == 20
    assert both["nvme_hit_rate"] > 0.05 and both["token_hit_rate"] > 0.4
    assert both["token_hit_rate"] == pytest.approx(both["dram_hit_rate"] + both["nvme_hit_rate"])
    assert both["flops_saved"] > 0.4
    assert both["flops_saved_nvme"] > 0
    assert both["flops_saved_loaded"] == pytest.approx(
        both["flops_saved_dram"] + both["flops_saved_nvme"]
    )
    assert both["nvme_resident_bytes"] > 0 and both["nvme_evictions"] == 0


def test_nothing_is_demoted_that_is_not_worth_a_disk_write_once_the_tier_is_short(
    trace: Trace,
) -> None:
    # At 1 MB/s a block reads back far slower than it recomputes. While the tier has
    # room (20 GB) that does not matter: what leaves DRAM is demoted, nothing is
    # dropped (it used to drop everything here).
    roomy = replay(trace, "lru", DRAM, Options(nvme_gbps=0.001), nvme_capacity=20 * GB)
    assert roomy["demoted_bytes"] > 0 and roomy["dropped_not_demoted"] == 0
    assert roomy["nvme_hit_rate"] > 0
    # A 300 MB tier is soon at its low watermark: from there the meta drops them,
    # and never deletes NVMe objects to make room for them...
    cap = 300 * MB
    slow = replay(trace, "lru", DRAM, Options(nvme_gbps=0.001), nvme_capacity=cap)
    assert slow["dropped_not_demoted"] > 0 and slow["nvme_evictions"] == 0
    assert slow["demoted_bytes"] <= MetaConfig.nvme_high_watermark * cap
    # ...while at 5 GB/s they are worth it, and newer ones push older ones out.
    fast = replay(trace, "lru", DRAM, Options(nvme_gbps=5.0), nvme_capacity=cap)
    assert fast["nvme_evictions"] > 0 and fast["demoted_bytes"] > cap


def test_nvme_watermarks_delete(trace: Trace) -> None:
    cap = 300 * MB
    small = replay(trace, "lru", DRAM, Options(), nvme_capacity=cap)
    assert small["nvme_evictions"] > 0
    assert small["nvme_resident_bytes"] <= MetaConfig.nvme_high_watermark * cap
    big = replay(trace, "lru", DRAM, Options(), nvme_capacity=20 * GB)
    assert small["nvme_hit_rate"] < big["nvme_hit_rate"]


def test_load_or_recompute_cuts_what_is_slower_to_fetch(trace: Trace) -> None:
    # At 0.05 GB/s a 64-token block of MiMo (1.5 MB full + 12.8 MB per windowed
    # block) takes longer to read than to recompute at 400 TFLOP/s.
    slow = Options(dram_gbps=0.05, nvme_gbps=0.05)
    whole = replay(trace, "lru", 20 * GB, Options(dram_gbps=0.05, load_or_recompute=False))
    cut = replay(trace, "lru", 20 * GB, slow)
    assert whole["matches_cut"] == 0 and whole["loaded_token_rate"] == whole["token_hit_rate"]
    assert whole["flops_saved_net"] < 0  # loading it all costs more than it saves
    assert cut["matches_cut"] > 0 and cut["loaded_token_rate"] < cut["token_hit_rate"]
    assert cut["flops_saved_net"] >= 0 > whole["flops_saved_net"]
    # Free reads: nothing cut, net = gross.
    free = replay(trace, "lru", 20 * GB, Options(dram_gbps=0.0))
    assert free["matches_cut"] == 0
    assert free["flops_saved_net"] == pytest.approx(free["flops_saved"])


def test_net_is_loaded_minus_fetch_time(trace: Trace) -> None:
    opts = Options(dram_gbps=25.0, nvme_gbps=2.0, compute_tflops=400.0)
    r = replay(trace, "cost", DRAM, opts, nvme_capacity=20 * GB)
    assert r["fetch_seconds_dram"] == pytest.approx(r["read_bytes_dram"] / 25e9)
    assert r["fetch_seconds_nvme"] == pytest.approx(r["read_bytes_nvme"] / 2e9)
    fetch = (r["fetch_seconds_dram"] + r["fetch_seconds_nvme"]) * 400e12
    net = r["flops_saved_loaded"] - fetch / r["flops_total"]
    assert r["flops_saved_net"] == pytest.approx(net)
    assert 0 < r["flops_saved_net"] < r["flops_saved_loaded"] <= r["flops_saved"]


def test_server_sim_completes_every_demotion() -> None:
    """Through the meta's heartbeat: the demotions a commit issued are done, the
    index points at NVMe copies, DRAM is back under its low watermark and nothing is
    left in flight or in an outbox."""
    cfg = MetaConfig(max_keys_per_request=1 << 20, max_demotions_in_flight=1 << 20)
    core = MetaCore(cfg)
    addr = wire.ServerAddr("s", "127.0.0.1", 1, "s", "", 1, 25.0, 5.0)
    srv = core.register_server(addr, bytes(16), 1, 200 * MB, 0.0, nvme_capacity=GB,
                               nvme_read_gbps=5.0)  # fmt: skip
    ns = core.register_namespace({"model": "m"}, preset("mimo-v2-flash", 64))
    sim = ServerSim(core, srv)
    for p in range(12):
        keys = [(p << 32 | i).to_bytes(16, "little") for i in range(12)]
        plan = core.place(ns, keys, ns.layout.groups_to_store(12), float(p), 0)
        core.commit(ns, keys, plan.placements, None, float(p))
        sim.drain(float(p))
        assert not (srv.demoting or srv.demote_out or srv.adopt_out or srv.drop_out)
        assert srv.reclaimable_used <= cfg.high_watermark * srv.allocator.capacity
    s = core.stats()
    assert s["demotions_done"] == s["demotions_issued"] == sim.demotions > 0
    assert s["demotions_in_flight"] == 0
    on_nvme = [core.index.obj(oid) for oid in core.index.server_objects(srv).tolist()]
    on_nvme = [o for o in on_nvme if o.tier == 1]
    assert on_nvme and len(on_nvme) == srv.nvme_count
    assert len({o.offset for o in on_nvme}) == len(on_nvme)  # distinct NVMe addresses


def test_cli_replay_with_nvme(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = tmp_path / "r.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rounds(10, 3)))
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    args = ["replay", "--trace", str(p), "--capacity", "1GB", "--nvme-capacity", "0,20GB"]
    args += ["--policy", "lru,cost", "--jobs", "1", "--nvme-gbps", "4", "--dram-gbps", "20"]
    with pytest.raises(SystemExit) as e:
        main([*args, "--json", str(out_json), "--plot", str(out_png)])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert "| NVMe " in text and "| 1 GB     | 20 GB " in text and "net of fetch" in text
    rows = json.loads(out_json.read_text())
    assert sorted((r["nvme_capacity_bytes"], r["policy"]) for r in rows) == [
        (0, "cost"), (0, "lru"), (20 * GB, "cost"), (20 * GB, "lru"),
    ]  # fmt: skip
    for r in rows:
        assert r["nvme_gbps"] == 4.0 and r["dram_gbps"] == 20.0
        if r["nvme_capacity_bytes"]:
            dram = next(
                d for d in rows if d["policy"] == r["policy"] and not d["nvme_capacity_bytes"]
            )
            assert r["nvme_hit_rate"] > 0 and r["flops_saved_net"] > dram["flops_saved_net"]
            # None where DRAM alone saved nothing to compare with
            assert r["vs_dram_only"] is None or r["vs_dram_only"] > 1
        else:
            assert r["nvme_hit_rate"] == 0
    assert out_png.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(SystemExit) as e:
        main([*args[:5], "--nvme-capacity", "1000", "--jobs", "1"])
    assert e.value.code == 2
    assert "NVMe capacities" in capsys.readouterr().err


def test_sweep_crosses_dram_and_nvme(trace: Trace) -> None:
    rows = sweep(trace, ["lru"], [DRAM, 20 * GB], Options(), 1, None, [0, 20 * GB])
    assert [(r["capacity_bytes"], r["nvme_capacity_bytes"]) for r in rows] == [
        (DRAM, 0), (DRAM, 20 * GB), (20 * GB, 0), (20 * GB, 20 * GB),
    ]  # fmt: skip


def test_promotion_brings_repeated_hits_back_to_dram(trace: Trace) -> None:
    off = replay(trace, "lru", DRAM, Options(), nvme_capacity=20 * GB)
    on = replay(trace, "lru", DRAM, Options(promotion="hits:1"), nvme_capacity=20 * GB)
    assert off["objects_promoted"] == 0 and off["promotion"] == "off"
    assert on["objects_promoted"] > 0 and on["promotion"] == "hits:1"
    # The meta's promotion code ran through the simulated server's heartbeats; the
    # replay measures what it does to hits (it does not assume it helps).
    assert on["token_hit_rate"] > 0
    with pytest.raises(ConfigError, match="promotion"):
        replay(trace, "lru", DRAM, Options(promotion="sometimes"), nvme_capacity=GB)
