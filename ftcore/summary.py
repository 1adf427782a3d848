"""The table printed at the end of a run."""

from __future__ import annotations

from typing import Any


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v)


def print_summary(console: Any, summary: dict[str, Any]) -> None:
    from rich.table import Table

    before = summary["evaluations"].get("before", {})
    after = summary["evaluations"].get("after", {})
    if before or after:
        table = Table(title="Evaluation", title_justify="left")
        for col in ("evaluation", "metric", "before", "after", "change"):
            table.add_column(col, justify="right" if col in ("before", "after", "change") else "left")
        for name in dict.fromkeys([*before, *after]):
            b, a = before.get(name, {}), after.get(name, {})
            for metric in dict.fromkeys([*b, *a]):
                bv, av = b.get(metric), a.get(metric)
                change = ""
                if isinstance(bv, (int, float)) and isinstance(av, (int, float)):
                    change = f"{av - bv:+.4g}"
                table.add_row(name, metric, _fmt(bv), _fmt(av), change)
        console.print(table)

    table = Table(title="Steps", title_justify="left")
    for col in ("step", "time (s)", "result"):
        table.add_column(col, justify="right" if col == "time (s)" else "left")
    for step in summary["steps"]:
        metrics = summary["stages"].get(step["name"], {})
        shown = ", ".join(f"{k}={_fmt(v)}" for k, v in metrics.items() if k in ("train_loss", "global_step",
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
            table.add_row(point, *(_fmt(values.get(key)) for key, _ in used))
        console.print(table)

    if summary["exports"]:
        table = Table(title="Artifacts", title_justify="left")
        table.add_column("export")
        table.add_column("path", overflow="fold")
        for name, path in summary["exports"].items():
            table.add_row(name, path)
        console.print(table)
    console.print(f"run directory: {summary['run_dir']}", highlight=False, soft_wrap=True)
