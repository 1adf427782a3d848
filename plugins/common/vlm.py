"""Whether a plan's model is a vision-language model, told from the plan and config.json alone (no torch,
nothing loaded): for the exporters that refuse one at validation, and for the commands that take images."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ftcore_plugins.common.seq2seq import read_config_file

# The ``scratch`` loader's VLM architectures (plugins/models/_vlm.py builds them; a test keeps the two equal).
VLM_ARCHITECTURES = ("qwen2_5_vl", "qwen3_vl", "mllama", "gemma3", "llava", "idefics3")


def plan_vision_model(plan: Any) -> str | None:
    """The model type of the plan's model when it is a vision-language model, found without loading: the
    ``scratch`` loader's VLM architectures, or a local folder whose ``config.json`` has a ``vision_config``
    (as every transformers VLM config has). None for a text model, or when it cannot be known yet (a hub id)."""
    options = plan.model.options
    if plan.model.name == "scratch":
        architecture = getattr(options, "architecture", None)
        return architecture if architecture in VLM_ARCHITECTURES else None
    path = getattr(options, "path", None)
    if path is None or not Path(str(path)).is_dir():
        return None
    return vision_model_type(read_config(Path(str(path))))


def read_config(folder: Path) -> dict[str, Any] | None:
    """``config.json`` of ``folder`` as a dict; None when there is none or it does not read (the model
    loader's checks say why)."""
    return read_config_file(Path(folder) / "config.json")


def vision_model_type(config: Any) -> str | None:
    """The model type of a config (config.json's dict or a transformers config) that has a vision tower."""
    if config is None:
        return None
    get = config.get if isinstance(config, dict) else lambda k: getattr(config, k, None)
    return str(get("model_type") or "unknown") if get("vision_config") is not None else None
