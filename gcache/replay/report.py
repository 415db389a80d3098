"""The replay's table, JSON and chart."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from gcache.errors import GCacheError


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if abs(n) < 1000 or unit == "PB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1000
    return f"{n:.3g} PB"


def annotate(rows: Sequence[dict[str, Any]]) -> None:
    """Add the ratios the report compares: FLOPs saved relative to ``naive`` and to
    ``belady`` at the same capacity (None where that reference did not run)."""
    by_cap: dict[int, dict[str, dict[str, Any]]] = {}
    for r in rows:
        by_cap.setdefault(r["capacity_bytes"], {})[r["policy"]] = r
    for r in rows:
        refs = by_cap[r["capacity_bytes"]]
        for ref in ("naive", "belady", "lru"):
            base = refs.get(ref)
            ok = base is not None and base["flops_saved"] > 0
            r[f"vs_{ref}"] = r["flops_saved"] / base["flops_saved"] if ok else None  # type: ignore[index]


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
    ("bytes stored", lambda r: fmt_bytes(r["bytes_stored"])),
    ("SWA stored", lambda r: fmt_bytes(r["swa_bytes_stored"])),
    ("SWA/req", lambda r: "-" if r["swa_vs_required"] is None else f"{r['swa_vs_required']:.3f}"),
    ("ckpts", lambda r: str(r["checkpoints_saved"])),
    ("evicted", lambda r: str(r["objects_evicted"])),
    ("blocks/s", lambda r: f"{r['blocks_per_s']:,.0f}"),
)


def table(rows: Sequence[dict[str, Any]]) -> str:
    """A plain-text table (Markdown-compatible), one row per (capacity, policy)."""
    cells = [[name for name, _ in COLUMNS]]
    cells += [[fn(r) for _, fn in COLUMNS] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS))]
    lines = []
    for n, row in enumerate(cells):
        pairs = enumerate(zip(row, widths, strict=True))
        parts = [c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in pairs]
        lines.append("| " + " | ".join(parts) + " |")
        if n == 0:
            lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def write_json(rows: Sequence[dict[str, Any]], path: str) -> None:
    with open(path, "w") as fh:
        json.dump(list(rows), fh, indent=2)
        fh.write("\n")


def plot(rows: Sequence[dict[str, Any]], path: str, title: str) -> None:
    """FLOPs saved against capacity, one line per policy (log-scale capacity)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise GCacheError(f"--plot needs matplotlib ({exc}); pip install matplotlib") from None
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
