"""Evaluator ``compare``: another evaluation of the plan, run on a baseline model and on the
current one in the same step, with the same data and settings, shown as a table of deltas."""

from __future__ import annotations

import dataclasses
from typing import Any

import ftcore
from ftcore.component import Component, Options
from ftcore.errors import FtcoreError

from ftcore_plugins.evaluators._baseline import model_ready_problems, own_entry


class Compare(Component):
    """Runs another [[evaluate]] entry on a baseline model ("base" or a finished stage) and on the
    current model; reports both and the change."""

    name = "compare"

    class Options(Options):
        evaluation: str  # the name of another [[evaluate]] entry in this plan: its evaluator, options and data
        baseline: str = "base"  # "base" (the model as loaded) or the name of a stage: the model after it

    def check(self, plan) -> list[str]:
        target = next((e for e in plan.evaluations if e.name == self.options.evaluation), None)
        if target is None:
            others = [e.name for e in plan.evaluations if e.evaluator.options is not self.options]
            return [f"evaluation: no [[evaluate]] named {self.options.evaluation!r}; "
                    f"name one of: {', '.join(others) or 'none (add one)'}"]
        if isinstance(target.evaluator.create(), Compare):
            return [f"evaluation: {target.name!r} is itself a comparison; name a measuring evaluation"]
        problems = model_ready_problems(plan, self, "baseline", self.options.baseline)
        entry = own_entry(plan, self)
        if entry is not None and "before" in entry.when and self.options.baseline == "base":
            problems.append("when: before training the model is the base, so there is nothing to compare; "
                            "set when = \"after\" (or a stage name)")
        return problems

    def evaluate(self, ctx):
        plan = ctx.run.plan
        target = next(e for e in plan.evaluations if e.name == self.options.evaluation)
        data = ctx.load_data(target.data) if target.data else None
        measure = target.evaluator.create()

        def run(label: str, model: Any, tokenizer: Any) -> dict[str, Any]:
            out = ctx.output_dir / label
            if ctx.run.is_main:
                out.mkdir(parents=True, exist_ok=True)
            return measure.evaluate(dataclasses.replace(ctx, model=model, tokenizer=tokenizer, data=data,
                                                        output_dir=out)) or {}

        current = run("current", ctx.model, ctx.tokenizer)
        base_model, base_tokenizer = ctx.load_model(self.options.baseline)
        try:
            baseline = run("baseline", base_model, base_tokenizer)
        finally:
            del base_model
        if not current:
            raise FtcoreError(f"evaluator 'compare': evaluation {target.name!r} returned no metrics")
        metrics: dict[str, Any] = {}
        rows = []
        for metric, value in current.items():
            base = baseline.get(metric)
            metrics[metric] = value
            metrics[f"{metric}/baseline"] = base
            numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (value, base))
            if numeric:
                metrics[f"{metric}/delta"] = value - base
            rows.append([metric, base, value, f"{value - base:+.4g}" if numeric else ""])
        ctx.reporter.table(f"{target.name}: {self.options.baseline} vs {ctx.phase}",
                           ["metric", self.options.baseline, ctx.phase, "delta"], rows)
        return metrics


@ftcore.hookimpl
def register_evaluators(register):
    register(Compare)
