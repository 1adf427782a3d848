"""The tables ``ftcore run`` prints when a run completes (through the ``ftcore_run_summary`` hook, which
``report.py`` implements), and the evaluation table they share with the run report."""

from __future__ import annotations

from typing import Any

from ftcore.reporter import format_value


def evaluation_rows(evaluations: dict[str, dict[str, Any]]) -> tuple[list[str], list[list[Any]]]:
    """The evaluation table of a run, for the end-of-run table and the run report: columns ``evaluation``,
    ``metric``, one per phase with results (in the given run order) and ``change`` (the last phase with a
    number minus the first) when there are two phases or more; rows hold raw values, the change as text."""
    phases = {p: r for p, r in evaluations.items() if r}
    rows = []
    for name in dict.fromkeys(name for results in phases.values() for name in results):
        for metric in dict.fromkeys(m for results in phases.values() for m in results.get(name) or {}):
            values = [(results.get(name) or {}).get(metric) for results in phases.values()]
            numbers = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
            counted = all(isinstance(v, int) for v in numbers)  # n, tokens: how much was scored, not a result
            change = [f"{numbers[-1] - numbers[0]:+.4g}" if len(numbers) > 1 and not counted else ""] \
                if len(phases) > 1 else []
            rows.append([name, metric, *values, *change])
    return ["evaluation", "metric", *phases, *(["change"] if len(phases) > 1 else [])], rows


def print_summary(console: Any, summary: dict[str, Any]) -> None:
    from rich.table import Table

    # Phases in run order ("before", any right after a stage, "after"); change = last minus first.
    columns, rows = evaluation_rows(summary["evaluations"])
    if rows:
        table = Table(title="Evaluation", title_justify="left")
        for col in columns:
            table.add_column(col, justify="left" if col in ("evaluation", "metric") else "right")
        for row in rows:
            table.add_row(*(format_value(v) for v in row))
        console.print(table)

    table = Table(title="Steps", title_justify="left")
    for col in ("step", "time (s)", "result"):
        table.add_column(col, justify="right" if col == "time (s)" else "left")
    for step in summary["steps"]:
        metrics = summary["stages"].get(step["name"], {})
        shown = ", ".join(f"{k}={format_value(v)}" for k, v in metrics.items() if k in ("train_loss", "global_step",
                                                                               "train_tokens", "tokens_per_second"))
        table.add_row(step["name"], "skipped (done)" if step["skipped"] else f"{step['seconds']:.1f}", shown)
    console.print(table)

    if summary.get("memory"):
        table = Table(title="Memory (MiB, measured)", title_justify="left")
        columns = [("rss_mib", "RSS"), ("peak_rss_mib", "peak RSS"), ("cuda_allocated_mib", "CUDA allocated"),
                   ("cuda_reserved_mib", "CUDA reserved"), ("cuda_peak_allocated_mib", "CUDA peak")]
        used = [c for c in columns if any(c[0] in v for v in summary["memory"].values())]
        table.add_column("point")
        for _, title in used:
            table.add_column(title, justify="right")
        for point, values in summary["memory"].items():
            table.add_row(point, *(format_value(values.get(key)) for key, _ in used))
        console.print(table)

    if summary["exports"]:
        table = Table(title="Artifacts", title_justify="left")
        table.add_column("export")
        table.add_column("path", overflow="fold")
        for name, path in summary["exports"].items():
            table.add_row(name, path)
        console.print(table)
    console.print(f"run directory: {summary['run_dir']}", highlight=False, soft_wrap=True)
