"""What ``ftcore sweep`` leaves: ``best_plan.toml`` and the sweep report (``sweep.html``, ``sweep.md``,
plots under ``report/``), drawn with Optuna's matplotlib visualisations."""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path
from typing import Any

from ftcore import rundir
from ftcore.reporter import format_value

from ftcore_plugins.commands.report import PLOT_DIR, PLOT_DPI, Plot, Table, render_html, render_markdown

_KEY = re.compile(r"([A-Za-z_][\w-]*)|\[(\d+)\]")


# -- best_plan.toml ------------------------------------------------------------------------------------

def best_plan_text(plan: Any, spec: Any, best: Any, folder: Path) -> str:
    """The plan's own text (comments kept, through tomlkit) with the best trial's values filled in,
    without its ``[sweep]`` table, its relative paths rewritten for ``folder`` where it is saved,
    and ``run.name`` ``<name>-best`` so that running it never lands in the sweep's folder."""
    import tomlkit

    doc = tomlkit.parse(plan.path.read_text(encoding="utf-8-sig"))
    moved = rebased_paths(plan, folder)
    for p in spec.space:
        _set(doc, p.keys, best.params[p.path])
    for keys, value in moved.items():
        _set(doc, keys, value)
    doc.pop("sweep", None)
    run = doc.setdefault("run", tomlkit.table())
    run["name"] = f"{plan.run_name}-best"
    head = (f"# The best trial ({best.number}) of the sweep in this folder: {spec.metric} = {best.value:.6g} "
            f"({spec.direction}).\n# Written by `ftcore sweep` from {plan.path.name}; paths are relative to this "
            f"file. Run it with: ftcore run best_plan.toml\n")
    return head + tomlkit.dumps(doc)


def rebased_paths(plan: Any, folder: Path) -> dict[tuple[Any, ...], Any]:
    """Each relative path the plan holds (options typed as paths, a loader's local ``path`` or
    ``tokenizer`` folder, ``run.output_dir``, export paths), rewritten relative to ``folder``."""
    base = plan.base_dir

    def moved(value: str) -> str:
        return value if Path(value).expanduser().is_absolute() else os.path.relpath(base / value, folder)

    out: dict[tuple[Any, ...], Any] = {("run", "output_dir"): os.path.relpath(plan.output_dir, folder)}
    for i, section in enumerate(plan.raw.get("export", []) if isinstance(plan.raw.get("export"), list) else []):
        if isinstance(section.get("path"), str):
            out[("export", i, "path")] = moved(section["path"])
    sections = [plan.model, plan.quantizer, plan.template, *plan.data.values(), *plan.rewards.values(),
                *(s.trainer for s in plan.stages), *(s.adapter for s in plan.stages),
                *(e.evaluator for e in plan.evaluations), *(e.exporter for e in plan.exports)]
    for sel in sections:
        keys = tuple(m.group(1) or int(m.group(2)) for m in _KEY.finditer(sel.key))
        section = _get(plan.raw, keys)
        if not isinstance(section, dict):
            continue
        for field, info in type(sel.options).model_fields.items():
            name = info.alias or field
            value = section.get(name)
            values = value if isinstance(value, list) else [value]
            if not values or not all(isinstance(v, str) for v in values):
                continue
            typed = getattr(sel.options, field)
            is_path = isinstance(typed, Path) or (isinstance(typed, list) and all(isinstance(v, Path) for v in typed))
            # A loader's `path` may be a hub id or a local folder: a folder when one is there.
            local = name in ("path", "tokenizer") and all((base / v).exists() for v in values)
            if is_path or local:
                new = [moved(v) for v in values]
                out[(*keys, name)] = new if isinstance(value, list) else new[0]
    return out


def _get(raw: Any, keys: tuple[Any, ...]) -> Any:
    for key in keys:
        try:
            raw = raw[key]
        except (KeyError, IndexError, TypeError):
            return None
    return raw


def _set(doc: Any, keys: tuple[Any, ...], value: Any) -> None:
    """Set ``keys`` in a tomlkit document as :func:`ftcore.sweep.apply` does in a dict: a component
    written by name alone becomes an inline table; a stage without an adapter gets the default's."""
    import tomlkit

    node = doc
    for key in keys[:-1]:
        child = node[key] if isinstance(node, list) or key in node else None
        if child is None and keys[0] == "stage" and key == "adapter":
            child = doc.get("adapter", "full")
            child = tomlkit.item(child.unwrap() if hasattr(child, "unwrap") else child)
        if child is None:
            child = tomlkit.inline_table()
        if isinstance(child, str):
            table = tomlkit.inline_table()
            table["use"] = str(child)
            child = table
        node[key] = child
        node = node[key]
    node[keys[-1]] = value


# -- the report ----------------------------------------------------------------------------------------

def best_trial(study: Any) -> Any:
    """The best complete trial, or None when none completed."""
    try:
        return study.best_trial
    except ValueError:
        return None


def state(trial: Any) -> str:
    """``complete``, ``pruned``, ``fail`` or ``running``, or ``interrupted`` for a trial a stopped sweep left."""
    return "interrupted" if trial.user_attrs.get("interrupted") else trial.state.name.lower()


def state_counts(study: Any) -> dict[str, int]:
    counts: dict[str, int] = {}
    for t in study.trials:
        counts[state(t)] = counts.get(state(t), 0) + 1
    return counts


def result_keys(study: Any, spec: Any) -> list[str]:
    """The evaluations after training that trials recorded, the sweep's metric left out."""
    keys: dict[str, None] = {}
    for t in study.trials:
        keys.update(dict.fromkeys(t.user_attrs.get("results", {})))
    metric = spec.metric if "/" in spec.metric else f"{spec.metric}/{spec.metric}"
    return [k for k in keys if k != metric]


def trial_rows(study: Any, spec: Any) -> list[list[Any]]:
    rows = []
    results = result_keys(study, spec)
    for t in study.trials:
        rows.append([t.number, state(t), f"trials/{t.user_attrs['folder']}" if "folder" in t.user_attrs else "",
                     # A pruned trial's value is its last intermediate one, an eval loss: not the metric.
                     *(t.params.get(p.path) for p in spec.space), t.value if t.state.name == "COMPLETE" else None,
                     *(t.user_attrs.get("results", {}).get(k) for k in results), t.user_attrs.get("pruned_at_step"),
                     _last_eval_loss(t, spec), t.user_attrs.get("seconds"),
                     t.user_attrs.get("error", "")])
    return rows


def _last_eval_loss(trial: Any, spec: Any) -> float | None:
    """The eval loss a pruned trial was stopped at (intermediate values are negated when maximising)."""
    if trial.state.name != "PRUNED" or not trial.intermediate_values:
        return None
    value = trial.intermediate_values[max(trial.intermediate_values)]
    return -value if spec.direction == "maximize" else value


def write_report(folder: Path, study: Any, spec: Any, seconds: dict[str, float]) -> tuple[Path, Path]:
    """Write ``sweep.html``, ``sweep.md`` and the plots under ``report/`` into the sweep's folder."""
    counts, best = state_counts(study), best_trial(study)
    facts = [["study", study.study_name], ["sampler", spec.sampler], ["pruner", spec.pruner],
             ["metric", f"{spec.metric} ({spec.direction})"],
             ["trials", ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))],
             ["best", f"trial {best.number}: {format_value(best.value)}" if best else "no trial finished"],
             ["wall time (s)", round(seconds.get("wall", 0.0), 1)],
             ["in trials (s)", round(seconds.get("trials", 0.0), 1)],
             ["shared stages (s)", round(seconds.get("shared", 0.0), 1)]]
    head = [Table("Sweep", ["", ""], facts)]
    if best is not None:
        head.append(Table("Best parameters", ["parameter", "value"], [[k, v] for k, v in best.params.items()],
                          note="best_plan.toml holds them"))
    columns = ["trial", "state", "run folder", *(p.path for p in spec.space), spec.metric,
               *result_keys(study, spec), "pruned at step", "eval loss there",
               "seconds", "error"]
    tail = [Table("Trials", columns, trial_rows(study, spec))]
    plots = make_plots(folder, study, spec)
    title = f"Sweep report: {study.study_name}"
    html_path, md_path = folder / "sweep.html", folder / "sweep.md"
    for path, text in ((md_path, render_markdown(head, tail, plots, title)),
                       (html_path, render_html(head, tail, plots, title))):
        rundir.write_text(path, text)
    return html_path, md_path


def make_plots(folder: Path, study: Any, spec: Any) -> list[Plot]:
    """Optuna's own figures: the optimisation history, parameter importances, the metric against each
    parameter, and the intermediate values pruning compared. A figure Optuna cannot draw yet (too
    few finished trials) is left out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from optuna.visualization import matplotlib as vis

    out_dir = folder / PLOT_DIR
    out_dir.mkdir(exist_ok=True)
    figures = [("history", "Optimisation history", lambda: vis.plot_optimization_history(study)),
               ("importances", "Parameter importances", lambda: vis.plot_param_importances(study)),
               ("slice", f"{spec.metric} against each parameter", lambda: vis.plot_slice(study)),
               ("intermediate", "Intermediate values (eval loss)", lambda: vis.plot_intermediate_values(study))]
    plots = []
    finished = [t for t in study.trials if t.state.name == "COMPLETE"]
    for name, title, draw in figures:
        if name in ("importances", "slice") and len(finished) < 2:
            continue
        if name == "intermediate" and not any(t.intermediate_values for t in study.trials):
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Optuna marks its matplotlib figures experimental
            try:
                axes = draw()
            except (ValueError, RuntimeError):  # e.g. importances of a parameter that never varied
                continue
        first = axes.flat[0] if hasattr(axes, "flat") else axes
        fig = first.figure
        fig.set_size_inches(10, 4)
        fig.tight_layout()
        path = out_dir / f"sweep_{name}.png"
        fig.savefig(path, dpi=PLOT_DPI)
        plt.close(fig)
        plots.append(Plot(f"sweep_{name}", title, path))
    return plots
