"""Benchmark figures (PNG) from summaries, acceptance curves and batched throughput: data in,
files out (what is worth drawing is the caller's choice).

Drawn with matplotlib's Agg canvas set explicitly on each Figure (no pyplot): headless, no global
backend switch in the caller's process, no figure registry to leak. Colours are the Okabe-Ito
palette (colour-blind safe); each label keeps its colour across figures.
"""

from __future__ import annotations

from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FixedLocator, MaxNLocator, PercentFormatter

from verispec.bench.records import AR, HF, OVERALL, MethodSummary, display_label, tasks_in_order

DPI = 120
MIN_REACHED = 10  # acceptance at a position reached fewer times is drawn dotted (noisy)
# Okabe & Ito (2008) for speculative methods, yellow last (faint on white); greys for baselines.
PALETTE = ["#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#000000", "#F0E442"]
GREYS = ["#7F7F7F", "#B0B0B0", "#4D4D4D", "#D0D0D0"]
HATCHES = ["", "//", "..", "xx", "\\\\", "++"]  # variants (Ks) of one method
LINESTYLES = ["-", "--", "-.", ":"]
MARKERS = ["o", "s", "^", "D", "v", "P", "X", "*"]


def label_styles(summaries: list[MethodSummary]) -> dict[str, dict]:
    """A style per label: the colour names the method, the hatch / line style / marker its variant (K).

    Speculative methods take the palette in order of appearance; baselines take greys.
    """
    methods = list(dict.fromkeys(s.method for s in summaries))
    baseline = {s.method: s.baseline for s in summaries}
    speculative = [m for m in methods if not baseline[m]]
    colour = {m: PALETTE[i % len(PALETTE)] for i, m in enumerate(speculative)}
    colour.update({m: GREYS[i % len(GREYS)] for i, m in enumerate(m for m in methods if baseline[m])})
    rounds = {m: i // len(PALETTE) for i, m in enumerate(speculative)}  # palette exhausted: shift hatches
    seen: dict[str, int] = {}
    styles = {}
    for s in summaries:
        variant = seen.get(s.method, 0) + 2 * rounds.get(s.method, 0)
        seen[s.method] = seen.get(s.method, 0) + 1
        styles[s.label] = {"color": colour[s.method], "hatch": HATCHES[variant % len(HATCHES)],
                           "linestyle": LINESTYLES[variant % len(LINESTYLES)],
                           "marker": MARKERS[variant % len(MARKERS)]}
    return styles


def _new_figure(width: float, height: float) -> Figure:
    figure = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(figure)  # the Agg backend, explicitly, for this figure only
    return figure


def _title(figure: Figure, title: str, subtitle: str | None) -> None:
    figure.suptitle(title + (f"\n{subtitle}" if subtitle else ""), fontsize=12)


def _legend_right(ax, handles: list | None = None, labels: list[str] | None = None) -> None:
    """The legend outside the axes, on their right, so it never covers data."""
    if handles is None:
        handles, labels = ax.get_legend_handles_labels()
    ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0,
              title="method", fontsize=9)


def _save(figure: Figure, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=DPI, facecolor="white")
    return path


def plot_speedup_by_task(summaries: list[MethodSummary], path: Path, subtitle: str | None = None) -> Path:
    """Grouped bars of speedup vs hf: x = tasks then overall, one bar per label; hf is the dashed 1.0."""
    styles = label_styles(summaries)
    cells = {s.label: s.cells for s in summaries if s.label != HF}
    labels = list(cells)
    groups = [*tasks_in_order(t for c in cells.values() for t in c if t != OVERALL), OVERALL]
    width = 0.84 / len(labels)
    figure = _new_figure(min(15.0, max(8.0, 3.0 + 0.13 * len(groups) * len(labels))), 5.0)
    ax = figure.add_subplot()
    top = 1.0
    crowded = len(labels) > 5
    for i, label in enumerate(labels):
        style = styles[label]
        xs, ys = [], []
        for g, group in enumerate(groups):
            value = cells[label][group].speedup_vs_hf if group in cells[label] else None
            if value is not None:
                xs.append(g - 0.42 + width * (i + 0.5))
                ys.append(value)
        top = max([top, *ys])
        ax.bar(xs, ys, width * 0.9, label=display_label(label), color=style["color"], hatch=style["hatch"],
               edgecolor="0.15", linewidth=0.5)
        for x, y in zip(xs, ys):
            if x > len(groups) - 1.5:  # values on the overall group only, where there is room
                ax.annotate(f"{y:.2f}", (x, y), xytext=(0, 2), textcoords="offset points", ha="center",
                            va="bottom", fontsize=7 if crowded else 8, rotation=90 if crowded else 0,
                            bbox={"boxstyle": "square,pad=0.05", "facecolor": "white", "edgecolor": "none",
                                  "alpha": 0.8})
    ax.axhline(1.0, color="0.2", linestyle="--", linewidth=1.2, label="hf = 1.0× (HF generate())")
    ax.axvline(len(groups) - 1.5, color="0.6", linewidth=0.8)  # sets overall apart from the tasks
    ax.set_xticks(range(len(groups)), [g.replace("_", " ") for g in groups])
    ax.get_xticklabels()[-1].set_fontweight("bold")
    ax.set_xlim(-0.55, len(groups) - 0.45)
    ax.set_ylim(0, top * (1.18 if crowded else 1.1))
    ax.set_xlabel("Spec-Bench task")
    ax.set_ylabel("speedup vs HF generate() (×, wall clock)")
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)
    _legend_right(ax)
    _title(figure, "Speedup over Hugging Face generate(), by task", subtitle)
    return _save(figure, path)


def plot_acceptance_by_position(curves: dict[str, tuple[list[float], list[int]]],
                                summaries: list[MethodSummary], path: Path,
                                subtitle: str | None = None) -> Path:
    """Conditional acceptance rate vs draft position, one line per label in `curves` (label ->
    (rate per position, times each position was reached)).

    Positions reached fewer than MIN_REACHED times are drawn dotted: too few samples to read much.
    """
    styles = label_styles(summaries)
    figure = _new_figure(9.0, 4.8)
    ax = figure.add_subplot()
    any_sparse = False
    for label, (rates, reached) in curves.items():
        style = styles[label]
        positions = list(range(1, len(rates) + 1))
        solid = sum(1 for n in reached if n >= MIN_REACHED) or 1  # reached only falls with position
        any_sparse |= solid < len(rates)
        ax.plot(positions[:solid], rates[:solid], color=style["color"], linestyle=style["linestyle"],
                marker=style["marker"], linewidth=1.8, markersize=5, label=display_label(label))
        if solid < len(rates):
            ax.plot(positions[solid - 1:], rates[solid - 1:], color=style["color"], linestyle=":",
                    marker=style["marker"], markerfacecolor="none", linewidth=1.0, markersize=4, alpha=0.7)
    ax.set_ylim(-0.02, 1.05)
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("draft position i (1 = first drafted token)")
    ax.set_ylabel("P(accept i | 1..i−1 accepted)")
    ax.grid(alpha=0.3)
    if any_sparse:
        ax.text(0.99, 0.02, f"dotted, hollow: reached < {MIN_REACHED} times", transform=ax.transAxes,
                ha="right", va="bottom", fontsize=8, color="0.3")
    _legend_right(ax)
    _title(figure, "Conditional acceptance by draft position", subtitle)
    return _save(figure, path)


def plot_k_sweep(sweeps: dict[str, list[tuple[int, str]]], summaries: list[MethodSummary], path: Path,
                 subtitle: str | None = None) -> Path:
    """τ (left) and overall speedup (right) vs K for each method in `sweeps` ({method: [(k, label),
    ...]}). The speedup is vs hf, or vs ar when no hf runs exist."""
    overall = {s.label: s.overall for s in summaries}
    swept = [label for points in sweeps.values() for _, label in points]
    key = "speedup_vs_hf" if any(overall[lb].speedup_vs_hf is not None for lb in swept) \
        else "speedup_vs_ar"
    baseline = HF if key == "speedup_vs_hf" else AR
    styles = label_styles(summaries)
    figure = _new_figure(10.5, 4.6)
    ax_tau, ax_speed = figure.subplots(1, 2)
    all_ks = sorted({k for points in sweeps.values() for k, _ in points})
    for i, (method, points) in enumerate(sweeps.items()):
        colour = styles[points[0][1]]["color"]
        for ax, metric in ((ax_tau, "mean_accepted_tokens"), (ax_speed, key)):
            pairs = [(k, getattr(overall[lb], metric)) for k, lb in points
                     if getattr(overall[lb], metric) is not None]
            if pairs:
                ax.plot(*zip(*pairs), marker=MARKERS[i % len(MARKERS)], color=colour, linewidth=1.8,
                        markersize=6, label=display_label(method) if ax is ax_tau else None)
    for ax in (ax_tau, ax_speed):
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_locator(FixedLocator(all_ks))
        ax.xaxis.set_major_formatter(lambda value, _: f"{value:g}")
        ax.xaxis.set_minor_locator(FixedLocator([]))
        ax.set_xlabel("K (tokens drafted per step, log scale)")
        ax.grid(alpha=0.3)
    ax_tau.axhline(1.0, color="0.2", linestyle="--", linewidth=1.0, label="plain decoding (τ = 1)")
    ax_speed.axhline(1.0, color="0.2", linestyle="--", linewidth=1.0)
    for ax in (ax_tau, ax_speed):
        ax.set_ylim(bottom=0)
    ax_tau.set_title("τ: new tokens per target forward")
    ax_tau.set_ylabel("τ (tokens / forward)")
    ax_speed.set_title(f"overall speedup vs {baseline} (dashed: {baseline} = 1.0×)")
    ax_speed.set_ylabel(f"speedup vs {baseline} (×, wall clock)")
    _legend_right(ax_speed, *ax_tau.get_legend_handles_labels())
    _title(figure, "Draft length sweep", subtitle)
    return _save(figure, path)


def plot_batched_throughput(results: dict, path: Path) -> Path:
    """Generated tokens per second over all rows against batch size, one line per method
    (`verispec bench --batch-size`); baselines dashed grey."""
    sizes = list(results["sizes"])
    labels = results["config"]["labels"]
    figure = _new_figure(8.5, 4.6)
    ax = figure.subplots()
    xs = [int(s) for s in sizes]
    for i, label in enumerate(labels):
        colour = {HF: GREYS[0], AR: GREYS[2]}.get(label, PALETTE[i % len(PALETTE)])
        ax.plot(xs, [results["sizes"][s][label]["tokens_per_second"] for s in sizes],
                marker=MARKERS[i % len(MARKERS)], color=colour, linewidth=1.8,
                linestyle="--" if label in (HF, AR) else "-", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("batch size (sequences decoded together)")
    ax.set_ylabel("generated tokens / s, all rows")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    _legend_right(ax)
    _title(figure, "Throughput against batch size", results["machine"]["processor"])
    return _save(figure, path)
