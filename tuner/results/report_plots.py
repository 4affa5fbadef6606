"""The HTML report's own plots (report.md's plots are tuner/results/report_md.py's): memory plan, TTFT
against decode speed, the probe's disk curve, and measured speed against the bound.

Each takes plain data read from the run directory's files and writes one PNG (atomically, via
report.save_figure); it returns None when the run holds nothing to draw, and the page says so.
"""

from __future__ import annotations

import math
from pathlib import Path

from engine.api import format_size
from tuner.results.report_md import save_figure

PLAN_PARTS = (("dense_bytes", "dense (resident)", "#4c72b0"), ("kv_bytes", "KV cache", "#dd8452"),
              ("buffer_bytes", "read slots", "#55a868"), ("cache_bytes", "expert cache", "#8172b3"),
              ("overhead_bytes", "runtime overhead", "#937860"), ("prefix_cache_bytes", "prefix cache", "#da8bc3"),
              ("draft_bytes", "drafting", "#8c8c8c"))


def plot_memory_plan(plans: dict[str, dict], path: Path) -> Path | None:
    """One stacked horizontal bar per config (label → the engine's MemoryPlan dict), budget marked."""
    import matplotlib.pyplot as plt
    plans = {k: v for k, v in plans.items() if v}
    if not plans:
        return None
    labels = list(plans)[::-1]
    fig, ax = plt.subplots(figsize=(8, 1.1 * len(labels) + 1.6))
    gib = float(1 << 30)
    segment_labels = []  # (text artist, bar patch): kept only where the text fits inside its segment
    for y, label in enumerate(labels):
        left = 0.0
        for key, name, color in PLAN_PARTS:
            width = (plans[label].get(key) or 0) / gib
            bars = ax.barh(y, width, left=left, color=color, label=name if y == 0 else None, edgecolor="white")
            if width > 0:
                text = ax.text(left + width / 2, y, format_size(plans[label].get(key)), ha="center",
                               va="center", fontsize=7, color="white")
                segment_labels.append((text, bars[0]))
            left += width
    budgets = {p.get("budget") for p in plans.values() if p.get("budget")}
    for b in budgets:
        ax.axvline(b / gib, color="black", linestyle="--", linewidth=1.2)
        ax.text(b / gib, len(labels) - 0.45, f" budget {format_size(b)}", fontsize=8, va="bottom")
    ax.set_yticks(range(len(labels)))
    ax.set_yticklabels(labels)
    ax.set_xlabel("GiB")
    ax.set_ylim(-0.6, len(labels) - 0.1)
    ax.set_title("Memory plan against the budget")
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    _drop_overflowing(fig, segment_labels)
    return save_figure(fig, path)


def _drop_overflowing(fig, labelled: list) -> None:
    """Remove each segment label wider than its segment. Measured in display pixels after the
    layout is final, since whether "72.0 MiB" fits depends on the font and the figure's width,
    not on the segment's share of the budget."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for text, patch in labelled:
        if text.get_window_extent(renderer).width + 4 > patch.get_window_extent(renderer).width:
            text.remove()


def plot_ttft_decode(points: list[dict], path: Path) -> Path | None:
    """Feasible trials: TTFT (x) against decode tok/s (y), colour = ctx_size; the winner ringed."""
    import matplotlib.pyplot as plt
    pts = [p for p in points if p.get("ttft_s") is not None and p.get("decode_tok_s") is not None]
    if not pts:
        return None
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    ctxs = sorted({p.get("ctx_size") for p in pts if p.get("ctx_size") is not None})
    cmap = plt.get_cmap("viridis", max(len(ctxs), 1))
    for i, ctx in enumerate(ctxs or [None]):
        sel = [p for p in pts if p.get("ctx_size") == ctx]
        ax.scatter([p["ttft_s"] for p in sel], [p["decode_tok_s"] for p in sel], s=26, color=cmap(i),
                   label=f"ctx {ctx}" if ctx is not None else "trials", zorder=3)
    _ring_recommended(ax, pts, "ttft_s")
    return _finish(fig, ax, "TTFT (s)", "decode tok/s", "Time to first token against decode speed", path)


def plot_disk_curve(points: list[dict], chosen: dict | None, path: Path) -> Path | None:
    """Probe's direct random-read curve: bandwidth against request size, one line per QD.

    points: {request_bytes, queue_depth, bandwidth (B/s)}; chosen: {chunk_size, io_threads,
    bandwidth} of the recommended config (its read size is marked; io_threads is its QD).
    """
    import matplotlib.pyplot as plt
    if not points:
        return None
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for qd in sorted({p["queue_depth"] for p in points}):
        sel = sorted((p for p in points if p["queue_depth"] == qd), key=lambda p: p["request_bytes"])
        ax.plot([p["request_bytes"] for p in sel], [p["bandwidth"] / 1e9 for p in sel], marker="o",
                label=f"QD {qd}")
    if chosen and chosen.get("chunk_size"):
        ax.axvline(chosen["chunk_size"], color="red", linestyle="--", linewidth=1.2,
                   label=f"chosen read size {format_size(chosen['chunk_size'])}")
        if chosen.get("bandwidth") is not None:
            ax.scatter([chosen["chunk_size"]], [chosen["bandwidth"] / 1e9], marker="*", s=160, color="red",
                       zorder=5, label=f"at io_threads {chosen.get('io_threads')} (interpolated)")
    ax.set_xscale("log", base=2)
    sizes = sorted({p["request_bytes"] for p in points} | ({chosen["chunk_size"]} if chosen else set()))
    ax.set_xticks(sizes)
    ax.set_xticklabels([format_size(s) for s in sizes], fontsize=8)
    return _finish(fig, ax, "request size", "GB/s (direct random reads)",
                   "Disk: bandwidth against request size (probe)", path)


def plot_bound(points: list[dict], path: Path) -> Path | None:
    """Measured decode tok/s against the roofline bound of the same trial; y = x is the bound."""
    import matplotlib.pyplot as plt
    pts = [p for p in points if p.get("bound_tok_s") and p.get("decode_tok_s") is not None
           and math.isfinite(p["bound_tok_s"])]
    if not pts:
        return None
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    colors = {"disk": "tab:orange", "memory": "tab:blue"}
    for limit, color in colors.items():
        sel = [p for p in pts if p.get("limit") == limit]
        if sel:
            ax.scatter([p["bound_tok_s"] for p in sel], [p["decode_tok_s"] for p in sel], s=24, color=color,
                       label=f"trials bounded by {limit}", zorder=3)
    _ring_recommended(ax, pts, "bound_tok_s")
    # Log-log: on a small model the bound can be 100x the measured speed (compute dominates).
    vals = [p["bound_tok_s"] for p in pts] + [p["decode_tok_s"] for p in pts if p["decode_tok_s"] > 0]
    lo, hi = min(vals) / 1.5, max(vals) * 1.5
    ax.plot([lo, hi], [lo, hi], color="gray", linestyle="--", label="measured = bound")
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    for axis in (ax.xaxis, ax.yaxis):  # plain numbers (0.5, 2, 1000), no crowded minor labels
        axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        axis.set_minor_formatter(NullFormatter())
    return _finish(fig, ax, "bound tok/s: 1 / max(disk time, memory time) per token", "measured decode tok/s",
                   "Measured speed against the bound", path)


def plot_bars(labels: list[str], values: list, lows: list | None, highs: list | None, title: str,
              path: Path) -> Path | None:
    """One bar per input (compare), min..max as error bars where given; None when all are absent."""
    import matplotlib.pyplot as plt
    if all(v is None for v in values):
        return None
    vals = [0.0 if v is None else v for v in values]
    yerr = None
    if lows and highs:
        yerr = [[max(v - (lo if lo is not None else v), 0) for v, lo in zip(vals, lows)],
                [max((hi if hi is not None else v) - v, 0) for v, hi in zip(vals, highs)]]
    fig, ax = plt.subplots(figsize=(max(4.5, 1.4 * len(labels) + 1.5), 3.6))
    bars = ax.bar(range(len(labels)), vals, yerr=yerr, capsize=4, color="tab:blue")
    for bar, v in zip(bars, values):
        if v is None:
            bar.set_hatch("//")
            bar.set_facecolor("white")
            ax.text(bar.get_x() + bar.get_width() / 2, 0, "n/a", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, rotation=20 if max(map(len, labels)) > 12 else 0, ha="right"
                       if max(map(len, labels)) > 12 else "center", fontsize=8)
    ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)
    return save_figure(fig, path)


def pareto_front(points: list[tuple[str, float, float]]) -> list[str]:
    """Labels of the (label, KL, speed) points no other point beats on both (lower KL, higher
    speed, at least as good on the other), by rising KL."""
    front = [p for p in points if not any(q[1] <= p[1] and q[2] >= p[2] and (q[1] < p[1] or q[2] > p[2])
                                          for q in points)]
    return [p[0] for p in sorted(front, key=lambda p: (p[1], -p[2]))]


def plot_speed_quality(points: list[tuple], path: Path) -> Path | None:
    """The speed/quality Pareto plot of quant levels: decode tok/s (min..max as error bars where
    given) against KL to the reference (lower is better), the Pareto front joined. Points are
    (label, KL, speed) or (label, KL, speed, low, high); inputs without a KL figure are left out.
    KL spans decades between int8 and int4 and is 0 for the reference itself, so the axis is
    symmetric-log, linear below the smallest non-zero KL."""
    import matplotlib.pyplot as plt
    pts = [tuple(p) + (None,) * (5 - len(p)) for p in points if p[1] is not None and p[2] is not None]
    if not pts:
        return None
    front = pareto_front([p[:3] for p in pts])
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for label, kl, speed, lo, hi in pts:
        on = label in front
        yerr = [[max(speed - lo, 0)], [max(hi - speed, 0)]] if lo is not None and hi is not None else None
        ax.errorbar([kl], [speed], yerr=yerr, fmt="o", capsize=4, color="tab:red" if on else "tab:gray",
                    markersize=7, zorder=3)
        ax.annotate(label, (kl, speed), textcoords="offset points", xytext=(6, 6), fontsize=8)
    by_label = {p[0]: p for p in pts}
    ax.plot([by_label[l][1] for l in front], [by_label[l][2] for l in front], "-", color="tab:red", alpha=0.6,
            label="Pareto front (faster, or closer to the reference)", zorder=2)
    nonzero = [p[1] for p in pts if p[1] > 0]
    if nonzero:
        ax.set_xscale("symlog", linthresh=min(nonzero) / 2)
    ax.margins(x=0.2, y=0.2)  # room for the labels of the extreme points
    ax.set_ylim(bottom=0)
    return _finish(fig, ax, "KL divergence to the reference (mean; lower is better)", "decode tok/s",
                   "Speed against quality: the Pareto front", path)


def _ring_recommended(ax, pts: list[dict], x_key: str) -> None:
    for p in pts:
        if p.get("recommended"):
            ax.scatter([p[x_key]], [p["decode_tok_s"]], s=140, facecolors="none", edgecolors="red",
                       linewidths=1.5, label="recommended (search trial)", zorder=4)


def _finish(fig, ax, xlabel: str, ylabel: str, title: str, path: Path, legend: bool = True) -> Path:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if legend:
        ax.legend(fontsize=8)
    return save_figure(fig, path)
