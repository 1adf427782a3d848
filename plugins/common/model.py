"""What several kinds of component need to know or do about a model: where its folder is,
how many of its parameters train, and how to undo TRL's per-instance forward patches."""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path
from typing import Any

from pydantic import ValidationInfo


HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")  # org/name


def resolve_model_path(value: str | None, info: ValidationInfo) -> str | None:
    """A folder relative to the plan, if one is there; otherwise a hub id (``org/name``), left as is.
    Anything else (``x``, ``./x``, ``/x``, ``a/b/c``), or a hub id that offline mode (``HF_HUB_OFFLINE``)
    could only take from an empty cache, is "no such folder" here rather than a hub lookup later."""
    if value is None:
        return None
    base = Path((info.context or {}).get("base_dir", "."))
    candidate = (base / Path(value).expanduser())
    if candidate.exists():
        return str(candidate.resolve())
    missing = f"no such folder: {candidate.resolve()}"
    if not hub_id(value):
        looks = re.fullmatch(r"[^/.~][^/]*/[^/]+", value)  # org/name, but not as the hub allows it
        raise ValueError(missing + (" (a Hugging Face id is written org/name)" if "/" not in value else
                                    " (nor a valid Hugging Face id)" if looks else ""))
    if (base / value.split("/")[0]).is_dir():  # "models/base" beside a models/ folder: a path, not a hub id
        raise ValueError(f"{missing} (there is a folder {(base / value.split('/')[0]).resolve()}, so this is not "
                         "read as a Hugging Face id)")
    if _offline() and not _in_hub_cache(value):
        raise ValueError(f"{missing} (nor a model in the Hugging Face cache, and HF_HUB_OFFLINE is set)")
    return value


def hub_id(value: str) -> bool:
    """Whether ``value`` can name a Hugging Face repository: ``org/name`` as the hub allows it (no ``--`` or
    ``..``, neither part starting or ending with ``-`` or ``.``, at most 96 characters)."""
    return bool(HUB_ID.fullmatch(value)) and len(value) <= 96 and "--" not in value and ".." not in value \
        and not any(part[-1] in "-." for part in value.split("/"))


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _in_hub_cache(repo_id: str) -> bool:
    from huggingface_hub.constants import HF_HUB_CACHE

    return (Path(HF_HUB_CACHE) / f"models--{repo_id.replace('/', '--')}").is_dir()


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


def transformers_source(model_type: str, kind: str = "modeling") -> str:
    """The installed transformers' ``kind`` (``modeling``, ``configuration``) source for ``model_type``, read
    as files (nothing imported, so ``ftcore validate`` can ask); "" where there is none."""
    spec = importlib.util.find_spec("transformers")
    if not model_type or spec is None or not spec.submodule_search_locations:
        return ""
    models = Path(spec.submodule_search_locations[0]) / "models"
    folder = models / model_type.replace("-", "_")
    if not folder.is_dir():  # a config class that lives in another family's module (qwen3_5_text in qwen3_5)
        declared = re.compile(rf"^\s+model_type\s*=\s*[\"']{re.escape(model_type)}[\"']", re.M)
        folder = next((f.parent for f in sorted(models.glob("*/configuration_*.py"))
                       if declared.search(f.read_text(encoding="utf-8", errors="replace"))), folder)
    try:
        return "\n".join(f.read_text(encoding="utf-8") for f in sorted(folder.glob(f"{kind}_*.py")))
    except OSError:
        return ""


def checkpointing_on(model: Any) -> None:
    """Non-reentrant gradient checkpointing: gradients reach adapters inside a block whose input needs none
    (peft adds its input-grad hook for reentrant checkpointing only)."""
    enable = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5.x's name
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:  # pragma: no cover - older transformers
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
