"""What several kinds of component need to know or do about a model: where its folder is,
how many of its parameters train, and how to undo TRL's per-instance forward patches."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import ValidationInfo


def resolve_model_path(value: str | None, info: ValidationInfo) -> str | None:
    """A folder relative to the plan, if one is there; otherwise a hub id, left as is."""
    if value is None:
        return None
    base = Path((info.context or {}).get("base_dir", "."))
    candidate = (base / Path(value).expanduser())
    if candidate.exists():
        return str(candidate.resolve())
    if value.startswith((".", "/", "~")) or value.count("/") > 1:
        raise ValueError(f"no such model folder: {candidate.resolve()}")
    return value


def trainable_counts(model: Any) -> dict[str, Any]:
    """Trainable and total parameters, and the trainable share in percent (4-bit weights counted
    unpacked, as peft does)."""
    trainable = total = 0
    for p in model.parameters():
        n = p.numel()
        if p.__class__.__name__ == "Params4bit":  # two 4-bit values per stored byte
            n *= 2 * (p.element_size() if hasattr(p, "element_size") else 1)
        total += n
        trainable += n if p.requires_grad else 0
    return {"trainable_params": trainable, "total_params": total,
            "trainable_percent": 100.0 * trainable / total if total else 0.0}


def report_trainable(model, reporter, label: str) -> dict:
    """Report how many parameters train; returns the counts (also the stage's metrics: see run_trl)."""
    counts = trainable_counts(model)
    reporter.info(f"{label}: {counts['trainable_params']:,} trainable parameters of {counts['total_params']:,} "
                  f"({counts['trainable_percent']:.2f}%)")
    return counts


def strip_forward_patches(model: Any) -> Any:
    """Remove the per-instance ``forward`` TRL installs (its fused LM head, a closure over the original
    bound ``forward``), so the model is a plain transformers model again: a deep copy of a patched model
    (a reference model, say) would keep calling the original's forward, on the live weights."""
    import types

    for module in model.modules():
        patched = module.__dict__.get("forward")
        if isinstance(patched, types.MethodType) and patched.__func__.__closure__:
            del module.forward
    return model
