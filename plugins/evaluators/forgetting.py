"""Evaluator ``forgetting``: perplexity on general text the user names (replay data, say) before
and after training, flagged when it rose by more than a threshold."""

from __future__ import annotations

from pydantic import Field

import ftcore

from ftcore_plugins.evaluators._baseline import model_ready_problems
from ftcore_plugins.evaluators.perplexity import Perplexity


class Forgetting(Perplexity):
    """Perplexity on general text, compared with the base model's: flags a rise above ``threshold``."""

    name = "forgetting"

    class Options(Perplexity.Options):
        threshold: float = Field(0.05, ge=0)  # flag a relative perplexity increase above this (0.05 = 5%)
        # Compared with: "base" (the model as loaded) or a stage's name (the model right after it),
        # e.g. the pre-training stage when a plan pre-trains and then fine-tunes.
        baseline: str = "base"

    def check(self, plan) -> list[str]:
        return model_ready_problems(plan, self, "baseline", self.options.baseline)

    def evaluate(self, ctx):
        metrics = super().evaluate(ctx)
        phase = "before" if self.options.baseline == "base" else self.options.baseline
        if ctx.phase == phase:
            return metrics
        # This evaluation's own result at the baseline has the same data and settings; without one
        # (its `when` skips that phase), measure the baseline model now.
        base = ctx.earlier.get(phase, {}).get("perplexity")
        if base is None:
            model, _ = ctx.load_model(self.options.baseline)
            try:
                base = self.measure(ctx, ctx.data, model, f"{self.name} ({self.options.baseline})")["perplexity"]
            finally:
                del model
        increase = metrics["perplexity"] / base - 1
        flagged = increase > self.options.threshold
        if flagged:
            ctx.reporter.warn(f"forgetting: perplexity on this data rose {increase:+.1%} since "
                              f"{self.options.baseline} ({base:.4g} -> {metrics['perplexity']:.4g}), above the "
                              f"{self.options.threshold:.0%} threshold; mix some of it into the training data "
                              "(replay) or train less")
        return {**metrics, "baseline_perplexity": base, "increase": increase, "forgetting": flagged}


@ftcore.hookimpl
def register_evaluators(register):
    register(Forgetting)
