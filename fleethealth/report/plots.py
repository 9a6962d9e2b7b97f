"""The report's figures, drawn with matplotlib's Agg backend and returned as SVG text.

One function per section; each takes :class:`~fleethealth.report.data.ReportData` and returns an
``<svg>`` element ready to inline in the page (no file, no network). Colours are matplotlib's
defaults plus one fixed map per meaning (finding kinds, guards), so two reports read alike.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from fleethealth.report.data import check_summary, stragglers  # noqa: E402
from fleethealth.schema import Action, ClockReason  # noqa: E402

if TYPE_CHECKING:
    from fleethealth.report.data import ReportData
    from fleethealth.report.scorecard import Scorecard

__all__ = ["svg", "heatmap", "temperature", "timeline", "sdc", "waterfall", "scorecard", "closed_loop"]

plt.rcParams.update({"svg.fonttype": "none", "font.size": 9, "figure.dpi": 100})

KIND_COLOURS = {"straggler": "#d62728", "hang": "#9467bd", "sdc": "#e377c2", "failure_risk": "#ff7f0e",
                "xid": "#8c564b", "ecc": "#bcbd22", "thermal": "#ff9896", "link": "#17becf"}
GUARD_COLOURS = {"allowed": "#2ca02c", "rate_limited": "#ff7f0e", "needs_human": "#d62728"}


def svg(fig: Figure) -> str:
    """The figure as inline SVG text (the XML prolog dropped); the figure is closed."""
    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight")
    plt.close(fig)
    text = buf.getvalue()
    return text[text.find("<svg"):]


def _groups(labels: list[str]) -> list[tuple[str, int, int]]:
    """Runs of equal labels as ``(label, first index, end index)``."""
    out: list[tuple[str, int, int]] = []
    for i, lab in enumerate(labels):
        if out and out[-1][0] == lab:
            out[-1] = (lab, out[-1][1], i + 1)
        else:
            out.append((lab, i, i + 1))
    return out


def heatmap(data: ReportData) -> str:
    """Per-rank compute time over steps, ranks grouped by rack and node; stragglers marked."""
    n_ranks = len(data.ranks)
    fig, ax = plt.subplots(figsize=(11, max(3.0, min(9.0, 2 + n_ranks / 40))))
    ratio = data.compute / np.nanmedian(data.compute, axis=0, keepdims=True)
    lo_step = (data.first_step // data.step_bin) * data.step_bin
    extent = (lo_step, lo_step + data.compute.shape[1] * data.step_bin, n_ranks, 0)
    im = ax.imshow(ratio, aspect="auto", interpolation="nearest", cmap="magma", extent=extent,
                   vmin=0.95, vmax=max(1.1, float(np.nanpercentile(ratio, 99.9))))
    fig.colorbar(im, ax=ax, label="compute time / step median", pad=0.01)
    racks = [data.node_racks.get(n, "?") for n in data.rank_nodes]
    for _, a, _b in _groups(data.rank_nodes)[1:]:
        ax.axhline(a, color="white", lw=0.3, alpha=0.5)
    ticks, names = [], []
    for rack, a, b in _groups(racks):
        if a:
            ax.axhline(a, color="cyan", lw=1.2)
        ticks.append((a + b) / 2)
        names.append(rack)
    ax.set_yticks(ticks, names)
    row = {int(r): i for i, r in enumerate(data.ranks)}
    node_rows = {n: [i for i, m in enumerate(data.rank_nodes) if m == n] for n in set(data.rank_nodes)}
    labelled: set[tuple[str, str]] = set()
    for f in stragglers(data):
        step = f.step if f.step is not None else data.step_at(f.ts)
        if f.rank is not None and f.rank in row:
            r = row[f.rank]
        elif node_rows.get(f.node):
            r = node_rows[f.node][len(node_rows[f.node]) // 2]
        else:
            continue
        ax.plot([step], [r + 0.5], marker="v", ms=8, color="#00e0ff", mec="black", mew=0.6)
        diag = f.diagnosis.value if f.diagnosis else ""
        if (f.node, diag) not in labelled:  # one label per node and cause; later findings only marked
            labelled.add((f.node, diag))
            ax.annotate(f"{f.node} {diag}", (step, r + 0.5), xytext=(6, -6), textcoords="offset points",
                        color="#00e0ff", fontsize=8)
    ax.set_xlabel("step" + ("" if data.step_bin == 1 else f" (cells of {data.step_bin} steps)"))
    ax.set_ylabel(f"{n_ranks} ranks by rack / node")
    ax.set_title(f"{data.job}: per-rank compute time (▼ straggler findings)")
    return svg(fig)


def _reason_names(bits: int) -> str:
    names = [r.name.lower() for r in ClockReason if r.name and bits & r.value and r is not ClockReason.GPU_IDLE]
    return ", ".join(names)


def _ffill(a: np.ndarray) -> np.ndarray:
    """Each row's NaN cells filled from the cell before (time bins shorter than the sample period)."""
    out = a.copy()
    for row in out:
        idx = np.where(np.isfinite(row), np.arange(row.size), 0)
        np.maximum.accumulate(idx, out=idx)
        row[:] = row[idx]
    return out


def temperature(data: ReportData) -> str:
    """Rack × time maximum GPU temperature, throttle reasons beside it, hot-aisle episodes shaded."""
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(11, 2.2 + 0.45 * max(len(data.racks), 1) * 2),
                                  sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    mins = (data.temp_max.shape[1] * data.time_bin_s) / 60.0
    extent = (0.0, mins, len(data.racks), 0)
    temp = _ffill(data.temp_max)
    im = ax.imshow(temp, aspect="auto", interpolation="nearest", cmap="inferno", extent=extent)
    fig.colorbar(im, ax=[ax, ax2], label="max GPU temperature, °C", pad=0.01)
    ax.set_yticks(np.arange(len(data.racks)) + 0.5, data.racks)
    ax.set_title(f"{data.job}: rack temperature (hatched: hot-aisle episodes)")
    thermal = int(ClockReason.thermal())
    power = int(ClockReason.power())
    for i, row in enumerate(data.reasons):
        x = (np.arange(row.size) + 0.5) * data.time_bin_s / 60.0
        for bit, colour, off, label in ((thermal, "#d62728", 0.15, "thermal"), (power, "#1f77b4", -0.15, "power"),
                                        (int(ClockReason.HW_SLOWDOWN), "#9467bd", 0.0, "hw slowdown")):
            hit = (row & bit) != 0
            if hit.any():
                ax2.scatter(x[hit], np.full(hit.sum(), i + off), s=6, color=colour, marker="s",
                            label=label if i == 0 or label not in ax2.get_legend_handles_labels()[1] else None)
    for f in data.hot_aisles:
        rack = str(f.evidence.get("rack") or data.node_racks.get(f.node, ""))
        start = (f.ts - data.t0) / 60.0
        if rack in data.racks:
            i = data.racks.index(rack)
            ax.add_patch(plt.Rectangle((start, i), mins - start, 1, fill=False, hatch="///", ec="cyan", lw=1.2))
        ax2.axvspan(start, mins, color="orange", alpha=0.15)
        ax.annotate(f"hot aisle {rack}", (start, (data.racks.index(rack) if rack in data.racks else 0) + 0.5),
                    color="cyan", xytext=(4, 0), textcoords="offset points")
    ax2.set_yticks(np.arange(len(data.racks)), data.racks)
    ax2.set_ylim(-0.6, len(data.racks) - 0.4)
    ax2.invert_yaxis()
    ax2.set_ylabel("throttle reasons")
    handles, labels = ax2.get_legend_handles_labels()
    if data.hot_aisles:
        handles.append(Patch(color="orange", alpha=0.3))
        labels.append("hot-aisle episode")
    if handles:
        ax2.legend(handles, labels, loc="upper left", fontsize=7, ncols=4)
    ax2.set_xlabel("minutes since the job's first step")
    return svg(fig)


def timeline(data: ReportData) -> str:
    """Findings and recommendations over time, each recommendation's guard, the breaker as a band."""
    fig, ax = plt.subplots(figsize=(11, 3.8))
    span_s = max(data.t1 - data.t0, 1.0)

    def x(ts: float) -> float:
        return (ts - data.t0) / 60.0

    kinds = sorted({f.kind.value for f in data.findings})
    actions = sorted({r.action.value for r in data.recommendations if r.action is not Action.NONE})
    lanes = [f"finding: {k}" for k in kinds] + [f"rec: {a}" for a in actions]
    lane = {name: i for i, name in enumerate(lanes)}
    for f in data.findings:
        ax.scatter([x(f.ts)], [lane[f"finding: {f.kind.value}"]], s=40, color=KIND_COLOURS.get(f.kind.value, "grey"),
                   edgecolor="black", lw=0.5, zorder=3)
        ax.annotate(f.node, (x(f.ts), lane[f"finding: {f.kind.value}"]), xytext=(3, 4), textcoords="offset points",
                    fontsize=7)
    for r in data.recommendations:
        if r.action is Action.NONE:
            continue
        y = lane[f"rec: {r.action.value}"]
        ax.scatter([x(r.ts)], [y], s=60, marker="D", color=GUARD_COLOURS.get(r.guard.value, "grey"),
                   edgecolor="black", lw=0.5, zorder=3)
        ax.annotate(f"{r.node} [{r.guard.value}]", (x(r.ts), y), xytext=(3, 4), textcoords="offset points",
                    fontsize=7)
    # the breaker: closed (green) unless a stored version says open from tripped_ts to reset_ts
    band_y = len(lanes)
    ax.axhspan(band_y - 0.3, band_y + 0.3, color=GUARD_COLOURS["allowed"], alpha=0.25)
    opened = False
    for v in data.breaker:
        if v.get("open") and v.get("tripped_ts") is not None:
            end = v.get("reset_ts") or data.t1
            ax.fill_between([x(v["tripped_ts"]), x(max(end, v["tripped_ts"]))], band_y - 0.3, band_y + 0.3,
                            color=GUARD_COLOURS["needs_human"], alpha=0.6)
            opened = True
    ax.text(x(data.t0) + 0.2, band_y, "breaker " + ("opened (red)" if opened else "closed throughout"),
            va="center", fontsize=8)
    ax.set_yticks(range(len(lanes) + 1), [*lanes, "breaker"])
    ax.set_ylim(-0.7, len(lanes) + 0.7)
    ax.set_xlim(-span_s / 60 * 0.02, span_s / 60 * 1.12)
    ax.invert_yaxis()
    ax.set_xlabel("minutes since the job's first step")
    ax.set_title(f"{data.job}: findings, recommendations (◆ colour = guard) and the breaker")
    ax.legend([Patch(color=c) for c in GUARD_COLOURS.values()], list(GUARD_COLOURS), title="guard",
              loc="lower right", fontsize=7)
    ax.grid(axis="x", alpha=0.3)
    return svg(fig)


def sdc(data: ReportData) -> str:
    """Self-check and replay results per check step, checkpoints with their two verification
    marks, and each rollback's target."""
    fig, ax = plt.subplots(figsize=(11, 3.4))
    summary = check_summary(data.checks)
    rows = {"selfcheck": 3, "replay": 2}
    for (step, check), (n, failed) in summary.items():
        y = rows.get(check, 3)
        colour = "#d62728" if failed else "#2ca02c"
        ax.scatter([step], [y], s=50 if failed else 25, color=colour, marker="X" if failed else "o", zorder=3)
        if failed:
            ax.annotate(f"{failed}/{n} failed", (step, y), xytext=(3, 5), textcoords="offset points", fontsize=7,
                        color=colour)
    for e in data.checkpoints:
        step = int(e.data.get("step", e.step or 0))
        verified, replayed = e.data.get("last_verified_step"), e.data.get("last_replay_step")
        marker = "s" if replayed is not None and replayed >= step else ("D" if verified is not None and
                                                                        verified >= step else "|")
        colour = "#1f77b4" if marker != "|" else "grey"
        ax.scatter([step], [1], marker=marker, s=30, color=colour, zorder=3)
        if verified is not None:
            ax.plot([verified, step], [0.78, 0.78], color="#2ca02c", lw=1, alpha=0.5)
        if replayed is not None:
            ax.plot([replayed, step], [0.62, 0.62], color="#1f77b4", lw=1, alpha=0.5)
    for r in data.rollbacks:
        target = r.evidence.get("target_step")
        if target is not None:
            ax.axvline(float(target), color="#d62728", ls="--", lw=1.2)
            ax.annotate(f"rollback target {target}\n({r.node}, {r.guard.value})", (float(target), 0.2),
                        xytext=(4, 0), textcoords="offset points", fontsize=7, color="#d62728")
    ax.set_yticks([3, 2, 1, 0.7], ["self-check", "replay", "checkpoint", "verified / replay mark"])
    ax.set_ylim(0, 3.6)
    ax.set_xlim(data.first_step - 1, data.last_step + 1)
    ax.set_xlabel("step")
    ax.legend([plt.Line2D([], [], marker=m, ls="", color=c) for m, c in
               (("o", "#2ca02c"), ("X", "#d62728"), ("s", "#1f77b4"), ("D", "#1f77b4"), ("|", "grey"))],
              ["check passed", "check failed", "checkpoint replay-verified", "checkpoint self-check verified",
               "checkpoint unverified"], fontsize=7, loc="upper left", ncols=5)
    ax.set_title(f"{data.job}: silent data corruption: checks, checkpoints and rollback targets")
    return svg(fig)


def waterfall(data: ReportData) -> str:
    """Productive time and seed 002's badput buckets as a waterfall, ETTR in the title."""
    g = data.goodput
    fig, ax = plt.subplots(figsize=(9, 3.6))
    names = ["available", *g.buckets, "productive"]
    hours = g.available_s >= 7200
    unit, scale = ("h", 3600.0) if hours else ("min", 60.0)
    total = g.available_s / scale
    bottom, heights, colours = [0.0], [total], ["#7f7f7f"]
    level = total
    for v in g.buckets.values():
        h = v / scale
        level -= h
        bottom.append(level)
        heights.append(h)
        colours.append("#d62728")
    bottom.append(0.0)
    heights.append(g.productive_s / scale)
    colours.append("#2ca02c")
    bars = ax.bar(names, heights, bottom=bottom, color=colours)
    for bar, h in zip(bars, heights, strict=True):
        ax.annotate(f"{h:.2f} {unit}", (bar.get_x() + bar.get_width() / 2, bar.get_y() + bar.get_height()),
                    xytext=(0, 2), textcoords="offset points", ha="center", va="bottom", fontsize=7)
    ax.set_ylim(0, max(total, 1e-9) * 1.12)
    ax.set_ylabel(f"job wallclock, {unit}")
    ettr = "n/a" if math.isnan(g.ettr) else f"{g.ettr:.3f}"
    ax.set_title(f"{data.job}: goodput waterfall, ETTR = {ettr} (ideal step {g.ideal_step_s:.3f} s, {g.steps} steps)")
    return svg(fig)


def checkpoint_interval(data: ReportData) -> str:
    """The recommended checkpoint interval over the job's span against the interval it used, with the
    MTBF it follows; interruptions as vertical lines."""
    fig, (ax, bx) = plt.subplots(2, 1, figsize=(9, 4.2), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    series = data.interval
    x = [(a.at - data.t0) / 60.0 for a in series]
    ax.step(x, [a.interval_s_recommended / 60.0 for a in series], where="post", color="#1f77b4",
            label="recommended")
    now = [(xi, a.interval_s_now / 60.0) for xi, a in zip(x, series, strict=True) if a.interval_s_now is not None]
    if now:
        ax.step([p[0] for p in now], [p[1] for p in now], where="post", color="#7f7f7f", ls="--", label="used")
    bx.step(x, [a.mtbf_s / 3600.0 for a in series], where="post", color="#d62728")
    for i in data.interruptions:
        for axis in (ax, bx):
            axis.axvline((i.ts - data.t0) / 60.0, color="#ff7f0e", lw=0.8, alpha=0.7)
    ax.set_ylabel("interval, min")
    ax.legend(loc="upper right", fontsize=7)
    bx.set_ylabel("MTBF, h")
    if series:  # a young job's estimate starts at the fleet's prior: log scales keep its fall readable
        ax.set_yscale("log")
        bx.set_yscale("log")
    bx.set_xlabel("minutes since the job's first step (orange: interruptions)")
    if series:
        last = series[-1]
        used = "unknown" if last.interval_s_now is None else f"{last.interval_s_now / 60:.1f} min"
        ax.set_title(f"{data.job}: checkpoint every {last.interval_s_recommended / 60:.1f} min (used: {used}); "
                     f"MTBF {last.mtbf_s / 3600:.2f} h, C {last.c_s:.3g} s, R {last.r_s:.3g} s", fontsize=9)
    return svg(fig)


def scorecard(card: Scorecard) -> str:
    """Each injected fault's detection latency in steps, coloured by outcome."""
    fig, ax = plt.subplots(figsize=(9, 0.8 + 0.35 * max(len(card.faults), 1)))
    labels = [f"{f.fault} {f.where}" for f in card.faults]
    values = [f.latency_steps if f.latency_steps is not None else 0 for f in card.faults]
    colours = ["#2ca02c" if f.correct else "#ff7f0e" if f.found else "#d62728" for f in card.faults]
    ax.barh(labels, values, color=colours)
    for i, f in enumerate(card.faults):
        text = "missed" if not f.found else f"{f.latency_steps} steps -> {f.action or 'no action'}" + (
            f" [{f.guard}]" if f.guard else "")
        ax.annotate(text, (max(values[i], 0), i), xytext=(3, 0), textcoords="offset points", va="center", fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("detection latency, steps after the fault began")
    ax.set_title(f"scorecard: {card.found}/{len(card.faults)} found, {card.correct} correct, "
                 f"{len(card.healthy_flagged)} healthy nodes flagged")
    ax.legend([Patch(color=c) for c in ("#2ca02c", "#ff7f0e", "#d62728")], ["correct", "wrong kind/diagnosis",
                                                                          "missed"], fontsize=7, loc="lower right")
    return svg(fig)


def closed_loop(results: Sequence[Any]) -> str:
    """The closed-loop runs side by side: goodput, ETTR and correct work per accelerator-hour."""
    fig, axes = plt.subplots(1, 3, figsize=(11, 2.8))
    names = [r.policy for r in results]
    colours = ["#2ca02c", "#1f77b4", "#7f7f7f"][:len(results)]
    for ax, (label, values) in zip(axes, (
            ("goodput", [r.goodput for r in results]), ("ETTR", [r.ettr for r in results]),
            ("correct steps per accelerator-hour", [r.correct_per_accel_hour for r in results])), strict=True):
        bars = ax.bar(names, values, color=colours)
        for bar, v in zip(bars, values, strict=True):
            ax.annotate(f"{v:.3f}" if v < 10 else f"{v:.1f}", (bar.get_x() + bar.get_width() / 2, v),
                        xytext=(0, 2), textcoords="offset points", ha="center", fontsize=7)
        ax.set_title(label)
        ax.tick_params(axis="x", labelsize=7)
        ax.set_ylim(0, max(values) * 1.15 if values and max(values) > 0 else 1)
    fig.suptitle("closed loop: " + ", ".join(f"{r.policy} {r.evictions} evictions" for r in results),
                 fontsize=9, y=1.06)
    return svg(fig)
