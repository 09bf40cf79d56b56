"""The bench's files: results.json, report.md and the figures it links, from Results."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from verispec.bench.markdown import render_markdown
from verispec.bench.records import HF, Results
from verispec.bench.summary import acceptance_curves, k_sweep_labels, speedup_model, summarize
from verispec.core.files import write_json

RESULTS_FILE = "results.json"
REPORT_FILE = "report.md"
SPEEDUP_PNG = "speedup_by_task.png"
ACCEPTANCE_PNG = "acceptance_by_position.png"
K_SWEEP_PNG = "k_sweep.png"


def results_json(results: Results) -> dict:
    """results.json's content: the results with their summary and speedup model."""
    return {"config": results.config, "machine": results.machine,
            "forward": results.forward.to_json() if results.forward else {},
            "runs": [run.to_json() for run in results.runs],
            "summary": {s.label: {task: asdict(cell) for task, cell in s.cells.items()}
                        for s in summarize(results.runs)},
            "theory": {label: asdict(model) for label, model in
                       speedup_model(results.runs, results.forward).items()}}


def figure_data(results: Results) -> dict[str, dict]:
    """The figures that have something to show, by file name, with the data each is drawn from."""
    summaries = summarize(results.runs)
    figures = {}
    if any(s.label != HF and s.overall.speedup_vs_hf is not None for s in summaries):
        figures[SPEEDUP_PNG] = {"summaries": summaries}
    if curves := acceptance_curves(results.runs):
        figures[ACCEPTANCE_PNG] = {"curves": curves, "summaries": summaries}
    if sweeps := k_sweep_labels(results.runs):
        figures[K_SWEEP_PNG] = {"sweeps": sweeps, "summaries": summaries}
    return figures


def write_report(results: Results, out_dir: Path) -> list[Path]:
    """Write report.md and the figures into out_dir (created if needed); return the paths written."""
    from verispec.bench import plots  # matplotlib is loaded only when figures are drawn

    draw = {SPEEDUP_PNG: plots.plot_speedup_by_task, ACCEPTANCE_PNG: plots.plot_acceptance_by_position,
            K_SWEEP_PNG: plots.plot_k_sweep}
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    subtitle = " · ".join(str(results.config[k]) for k in ("model", "dtype", "device")
                          if results.config.get(k))
    figures = [draw[name](path=out_dir / name, subtitle=subtitle, **data)
               for name, data in figure_data(results).items()]
    report = out_dir / REPORT_FILE
    report.write_text(render_markdown(results, [p.name for p in figures]), encoding="utf-8")
    return [report, *figures]


def write_results(results: Results, out_dir: Path, report: bool) -> None:
    """results.json (rewritten after every question), and with `report` report.md and figures."""
    write_json(Path(out_dir) / RESULTS_FILE, results_json(results))
    if report and results.runs:
        write_report(results, out_dir)
