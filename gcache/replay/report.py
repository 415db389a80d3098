"""The replay's table, JSON and chart."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from gcache.errors import GCacheError


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if abs(n) < 1000 or unit == "PB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1000
    return f"{n:.3g} PB"


def _tiers(r: dict[str, Any]) -> tuple[int, int]:
    return r["capacity_bytes"], r.get("nvme_capacity_bytes", 0)


def where(r: dict[str, Any]) -> str:
    """``250 GB`` or ``250 GB + 4 TB`` (DRAM + NVMe)."""
    nvme = r.get("nvme_capacity_bytes", 0)
    dram = fmt_bytes(r["capacity_bytes"])
    return f"{dram} + {fmt_bytes(nvme)}" if nvme else dram


def annotate(rows: Sequence[dict[str, Any]]) -> None:
    """Add the ratios the report compares: FLOPs saved relative to ``naive`` and to
    ``belady`` with the same tiers (None where that reference did not run)."""
    by_cap: dict[tuple[int, int], dict[str, dict[str, Any]]] = {}
    for r in rows:
        by_cap.setdefault(_tiers(r), {})[r["policy"]] = r
    for r in rows:
        refs = by_cap[_tiers(r)]
        for ref in ("naive", "belady", "lru"):
            base = refs.get(ref)
            ok = base is not None and base["flops_saved"] > 0
            r[f"vs_{ref}"] = r["flops_saved"] / base["flops_saved"] if ok else None  # type: ignore[index]
        # The same policy and DRAM without the NVMe tier, on the net figure.
        dram = by_cap.get((r["capacity_bytes"], 0), {}).get(r["policy"])
        ok = dram is not None and dram["flops_saved_net"] > 0
        r["vs_dram_only"] = r["flops_saved_net"] / dram["flops_saved_net"] if ok else None  # type: ignore[index]


def _ratio(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


COLUMNS = (
    ("capacity", lambda r: fmt_bytes(r["capacity_bytes"])),
    ("policy", lambda r: r["policy"]),
    ("token hit", lambda r: f"{r['token_hit_rate']:.1%}"),
    ("FLOPs saved", lambda r: f"{r['flops_saved']:.1%}"),
    ("vs naive", lambda r: _ratio(r.get("vs_naive"))),
    ("vs lru", lambda r: _ratio(r.get("vs_lru"))),
    ("of belady", lambda r: _ratio(r.get("vs_belady"))),
    ("net of fetch", lambda r: f"{r['flops_saved_net']:.1%}"),
    ("bytes stored", lambda r: fmt_bytes(r["bytes_stored"])),
    ("SWA stored", lambda r: fmt_bytes(r["swa_bytes_stored"])),
    ("SWA/req", lambda r: "-" if r["swa_vs_required"] is None else f"{r['swa_vs_required']:.3f}"),
    ("ckpts", lambda r: str(r["checkpoints_saved"])),
    ("evicted", lambda r: str(r["objects_evicted"])),
    ("blocks/s", lambda r: f"{r['blocks_per_s']:,.0f}"),
)


Column = tuple[str, Callable[[dict[str, Any]], str]]


def _opt_bytes(n: int) -> str:
    return fmt_bytes(n) if n else "-"


# With an NVMe tier in any row: the tier, hits per tier (tokens of matched blocks
# whose full object is in DRAM / on NVMe), what the demotions moved and deleted.
TIER_COLUMNS: tuple[Column, ...] = (
    ("NVMe", lambda r: _opt_bytes(r.get("nvme_capacity_bytes", 0))),
    ("DRAM hit", lambda r: f"{r['dram_hit_rate']:.1%}"),
    ("NVMe hit", lambda r: f"{r['nvme_hit_rate']:.1%}"),
    ("from NVMe", lambda r: f"{r['flops_saved_nvme']:.1%}"),
    ("vs DRAM only", lambda r: _ratio(r.get("vs_dram_only"))),
    ("demoted", lambda r: _opt_bytes(r["demoted_bytes"])),
    ("NVMe evicted", lambda r: str(r["nvme_evictions"])),
)


def columns(rows: Sequence[dict[str, Any]]) -> list[Column]:
    cols: list[Column] = list(COLUMNS)
    if any(r.get("nvme_capacity_bytes", 0) for r in rows):
        cols[1:1] = TIER_COLUMNS[:1]
        cols[4:4] = TIER_COLUMNS[1:3]
        at = next(i for i, (name, _) in enumerate(cols) if name == "net of fetch") + 1
        cols[at:at] = TIER_COLUMNS[3:5]
        cols[-1:-1] = TIER_COLUMNS[5:]
    return cols


def table(rows: Sequence[dict[str, Any]]) -> str:
    """A plain-text table (Markdown-compatible), one row per (capacity, policy)."""
    cols = columns(rows)
    cells = [[name for name, _ in cols]]
    cells += [[fn(r) for _, fn in cols] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(cols))]
    labels = 1 + next(i for i, (name, _) in enumerate(cols) if name == "policy")
    lines = []
    for n, row in enumerate(cells):
        pairs = enumerate(zip(row, widths, strict=True))
        parts = [c.ljust(w) if i < labels else c.rjust(w) for i, (c, w) in pairs]
        lines.append("| " + " | ".join(parts) + " |")
        if n == 0:
            lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def write_json(rows: Sequence[dict[str, Any]], path: str) -> None:
    with open(path, "w") as fh:
        json.dump(list(rows), fh, indent=2)
        fh.write("\n")


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise GCacheError(f"--plot needs matplotlib ({exc}); pip install matplotlib") from None
    return plt


def plot(rows: Sequence[dict[str, Any]], path: str, title: str) -> None:
    """FLOPs saved against capacity, one line per policy (log-scale capacity); with
    NVMe tiers, :func:`plot_tiers`."""
    if any(r.get("nvme_capacity_bytes", 0) for r in rows):
        plot_tiers(rows, path, title)
        return
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=120)
    styles = {"naive": ":", "strict": "--", "belady": "-."}
    for policy in dict.fromkeys(r["policy"] for r in rows):
        pts = sorted((r["capacity_bytes"], r["flops_saved"]) for r in rows if r["policy"] == policy)
        ax.plot(
            [c / 1e12 for c, _ in pts],
            [100 * f for _, f in pts],
            styles.get(policy, "-"),
            marker="o",
            markersize=3,
            label=policy,
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("capacity (TB)")
    ax.set_ylabel("prefill FLOPs saved (%)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_tiers(rows: Sequence[dict[str, Any]], path: str, title: str) -> None:
    """One bar per (DRAM, NVMe, policy): the FLOPs saved by what the client loaded,
    split by the tier its blocks came from (DRAM below, NVMe on top), with the
    figure net of the fetch time marked on it."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(rows) + 2), 4.5), dpi=120)
    xs = range(len(rows))
    dram = [100 * r["flops_saved_dram"] for r in rows]
    nvme = [100 * r["flops_saved_nvme"] for r in rows]
    ax.bar(xs, dram, color="#4c72b0", label="loaded from DRAM")
    ax.bar(xs, nvme, bottom=dram, color="#dd8452", label="loaded from NVMe")
    ax.scatter(
        xs, [100 * r["flops_saved_net"] for r in rows], marker="_", s=400, color="black",
        zorder=3, label="net of fetch time",
    )  # fmt: skip
    for x, r in zip(xs, rows, strict=True):
        ax.annotate(
            f"{r['flops_saved_net']:.1%}", (x, 100 * r["flops_saved_loaded"]),
            textcoords="offset points", xytext=(0, 3), ha="center", fontsize=7,
        )  # fmt: skip
    ax.set_xticks(list(xs), [f"{r['policy']}\n{where(r)}" for r in rows], fontsize=7)
    ax.set_ylabel("prefill FLOPs saved (%)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
