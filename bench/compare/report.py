"""Table, ratios and chart for ``python -m bench.compare`` (pure functions, no I/O but print)."""

from __future__ import annotations

from typing import Any

from bench.compare.peers.limits import IPERF_MAX_LEN  # iperf3 caps -l at 1 MiB for TCP

Row = dict[str, Any]

MEMCPY_TARGET = 0.6  # applies only where Mooncake did not run

# (gcache system, peer system, {op: target ratio at 1 MiB or None}): the targets.
# Anchors with several rows for one size (iperf3 plain and per-size, memcpy with 1 and N
# threads) are compared against their best figure: the conservative choice.
# Like for like: the batched GCache shape (one operation of N objects at a time) is
# what Mooncake's batch calls do; the other (N single-object operations in flight)
# is what N redis-py client processes do.
PAIRS: list[tuple[str, str, dict[str, float | None]]] = [
    ("gcache (TCP)", "iperf3 loopback TCP", {"write": 0.8, "read": 0.8}),
    ("gcache (TCP, batched)", "mooncake (TCP)", {"write": 1.0, "read": 1.0}),
    ("gcache (TCP)", "redis (redis-py)", {"write": 2.0, "read": 2.0}),
    ("gcache (TCP)", "redis-benchmark", {"write": None, "read": None}),
    # Shared memory: read 1 MiB (4 in flight, the batched shape) >= 1.0x Mooncake's memcpy.
    ("gcache (SHM, batched)", "mooncake (local memcpy)", {"write": None, "read": 1.0}),
    ("gcache (SHM)", "memcpy (numpy)", {"write": None, "read": MEMCPY_TARGET}),
    ("gcache (SHM)", "redis (redis-py)", {"write": None, "read": None}),
    # The NVMe tier against the raw direct I/O of its directory, every size.
    ("gcache (NVMe)", "raw disk (dd direct)", {"write": 0.7, "read": 0.7}),
    ("gcache (NVMe, shm staging)", "raw disk (dd direct)", {"write": None, "read": 0.7}),
]
TARGET_SIZE = 1 << 20
ALL_SIZES = {"raw disk (dd direct)"}  # peers whose target holds at every size
# Targets at other sizes than TARGET_SIZE, per (peer, size), for every op of the pair.
# TCP 16 MiB >= 0.9x iperf3 (1 MiB >= 0.8x is the pair's own target).
SIZE_TARGETS: dict[tuple[str, int], float] = {("iperf3 loopback TCP", 16 << 20): 0.9}
IPERF = "iperf3 loopback TCP"


def _fmt(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def human(n: int) -> str:
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


def print_table(rows: list[Row]) -> None:
    print(
        f"{'system':<26} {'op':<6} {'bytes':>7} {'conc':>4} {'#iters':>7} "
        f"{'BW avg[GB/s]':>12} {'lat p50[us]':>11} {'p99[us]':>9}"
    )
    for r in sorted(rows, key=lambda r: (r["system"], r["op"], r["bytes"], r["concurrency"])):
        print(
            f"{r['system']:<26} {r['op']:<6} {human(r['bytes']) if r['bytes'] else 'plain':>7} "
            f"{r['concurrency']:>4} {r['iterations']:>7} {r['bw_avg_gbps']:>12.3f} "
            f"{_fmt(r.get('lat_p50_us'), '.1f'):>11} {_fmt(r.get('lat_p99_us'), '.1f'):>9}"
        )


def _size_ok(system: str, have: int, size: int) -> bool:
    """Does a row of ``have`` bytes stand for ``size``? Exact sizes, and for iperf3 its
    plain run (bytes 0) always; above iperf3's block size cap also every per-size run
    (it cannot run the size itself: the best block size it can is the anchor)."""
    if have == size:
        return True
    if system != IPERF:
        return False
    return have == 0 or (size > IPERF_MAX_LEN and have <= IPERF_MAX_LEN)


def _best(rows: list[Row], system: str, op: str, size: int) -> float | None:
    """Best figure of ``system`` for (op, size). Op "bw" anchors match any op; iperf3's
    plain run (bytes 0) stands for sizes it has no per-size run for, and above its
    1 MiB block cap its best run of any block size does."""
    cands = [
        r["bw_avg_gbps"]
        for r in rows
        if r["system"] == system
        and r["op"] in (op, "bw")
        and _size_ok(system, r["bytes"], size)
        and r["bw_avg_gbps"] > 0
    ]
    return max(cands) if cands else None


def ratios(rows: list[Row], sizes: list[int]) -> list[Row]:
    out: list[Row] = []
    have_mooncake = any(r["system"] == "mooncake (local memcpy)" for r in rows)
    for g_sys, peer, targets in PAIRS:
        for op, target in targets.items():
            for size in sizes:
                g = _best(rows, g_sys, op, size)
                p = _best(rows, peer, op, size)
                if g is None or p is None:
                    continue
                t = target if size == TARGET_SIZE or peer in ALL_SIZES else None
                if target is not None and (peer, size) in SIZE_TARGETS:
                    t = SIZE_TARGETS[(peer, size)]
                if target == MEMCPY_TARGET and peer == "memcpy (numpy)" and have_mooncake:
                    t = None
                ratio = g / p
                out.append(
                    {
                        "gcache": g_sys,
                        "peer": peer,
                        "op": op,
                        "bytes": size,
                        "gcache_gbps": round(g, 3),
                        "peer_gbps": round(p, 3),
                        "ratio": round(ratio, 3),
                        "target": t,
                        "met": None if t is None else ratio >= t,
                    }
                )
    return out


def print_ratios(rat: list[Row]) -> None:
    print(
        f"{'GCache':<22} {'vs peer':<24} {'op':<6} {'bytes':>6} {'GCache':>7} {'peer':>7} "
        f"{'ratio':>6} {'target':>6}"
    )
    for r in rat:
        tgt = (
            ""
            if r["target"] is None
            else f">={r['target']:.1f} " + ("met" if r["met"] else "MISSED")
        )
        print(
            f"{r['gcache']:<22} {r['peer']:<24} {r['op']:<6} {human(r['bytes']):>6} "
            f"{r['gcache_gbps']:>7.3f} {r['peer_gbps']:>7.3f} {r['ratio']:>6.2f}x {tgt}"
        )


def chart(rows: list[Row], path: str) -> str:
    """PNG: bandwidth by size, one line per system and op. Returns '' or why not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        return f"matplotlib not importable ({exc}); no chart"
    series: dict[str, list[tuple[int, float]]] = {}
    for r in rows:
        if r["bytes"] <= 0:
            continue
        label = r["system"] if r["op"] == "bw" else f"{r['system']} {r['op']}"
        if r["op"] == "bw":
            label += f" x{r['concurrency']}"
        series.setdefault(label, []).append((r["bytes"], r["bw_avg_gbps"]))
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for label, pts in sorted(series.items()):
        pts.sort()
        style = "-" if label.startswith("gcache") else "--"
        ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    sizes = sorted({r["bytes"] for r in rows if r["bytes"] > 0})
    ax.set_xticks(sizes, [human(s) for s in sizes])
    ax.set_xlabel("value size")
    ax.set_ylabel("bandwidth [GB/s]")
    ax.set_title("GCache vs peers, one machine, one run")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return ""
