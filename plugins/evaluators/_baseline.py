"""What the evaluators that load another model (``compare``, ``forgetting``, ``preference``) check
about it: it must exist and be finished by every phase the evaluation runs in."""

from __future__ import annotations

from typing import Any

from ftcore.plan import phase_order


def own_entry(plan: Any, component: Any) -> Any:
    """The plan's [[evaluate]] entry this component instance was created for."""
    return next((e for e in plan.evaluations if e.evaluator.options is component.options), None)


def model_ready_problems(plan: Any, component: Any, key: str, which: str | None) -> list[str]:
    """Problems with naming ``which`` ("base" or a stage) as a model to load in each phase this
    evaluation runs in: the stage must exist and have finished by then."""
    if which is None or which == "base":
        return []
    names = [s.name for s in plan.stages]
    if which not in names:
        return [f"{key}: no stage named {which!r}; use \"base\" or one of: {', '.join(names) or 'none'}"]
    entry = own_entry(plan, component)
    order = phase_order(names)
    early = [p for p in (entry.when if entry else ()) if order.index(p) <= names.index(which)]
    if early:
        return [f"{key}: stage {which!r} has not finished in phase {early[0]!r}; run this evaluation later "
                f"(when = \"after\" or a stage after {which!r})"]
    return []
