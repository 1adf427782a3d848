"""Exporters that write the language model alone (``gguf``, ``onnx``) and a vision-language model: they
refuse it in one line, at validation where the plan tells (without loading anything, or importing torch),
else when the export runs. ``merged`` and ``adapter`` export a VLM with its processor (docs/vision.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ftcore.errors import FtcoreError


def plan_vision_model(plan: Any) -> str | None:
    """The model type of the plan's model when it is a vision-language model, found without loading: the
    ``scratch`` loader's VLM architectures, or a local folder whose ``config.json`` has a ``vision_config``
    (as every transformers VLM config has). None for a text model, or when it cannot be known yet (a hub id)."""
    from ftcore_plugins.models import _checks
    from ftcore_plugins.models._vlm import FAMILIES

    options = plan.model.options
    if plan.model.name == "scratch":
        architecture = getattr(options, "architecture", None)
        return architecture if architecture in FAMILIES else None
    path = getattr(options, "path", None)
    if path is None or not Path(str(path)).is_dir():
        return None
    config, _ = _checks.read_config(Path(str(path)))
    return vision_model_type(config)


def vision_model_type(config: Any) -> str | None:
    """The model type of a config (config.json's dict or a transformers config) that has a vision tower."""
    if config is None:
        return None
    get = config.get if isinstance(config, dict) else lambda k: getattr(config, k, None)
    return str(get("model_type") or "unknown") if get("vision_config") is not None else None


def refusal(exporter: str, kind: str, why: str) -> str:
    return (f"exporter '{exporter}' does not export a vision-language model ({kind}): {why}; export it with "
            "\"merged\" or \"adapter\" (docs/vision.md)")


def refuse_loaded(ctx: Any, model: Any, exporter: str, why: str) -> None:
    """When the export runs: the one-line refusal for a vision-language model the plan did not show (a hub id)."""
    kind = vision_model_type(getattr(model, "config", None))
    if kind is not None:
        raise FtcoreError(f"export '{ctx.name}': " + refusal(exporter, kind, why))


# The `adapter` export's model card for a vision-language model: the adapter on its base, the processor from the export.
ADAPTER_USAGE = """
from peft import PeftModel
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor

base = AutoModelForImageTextToText.from_pretrained("{base}")  # the model the adapter was trained on
model = PeftModel.from_pretrained(base, "{path}")
processor = AutoProcessor.from_pretrained("{path}")
messages = [{{"role": "user", "content": [{{"type": "image"}}, {{"type": "text", "text": "What is this?"}}]}}]
text = processor.apply_chat_template(messages, add_generation_prompt=True)
inputs = processor(text=[text], images=[[Image.open("image.png")]], add_special_tokens=False, return_tensors="pt")
print(processor.decode(model.generate(**inputs, max_new_tokens=64)[0]))
"""
