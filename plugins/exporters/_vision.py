"""Exporters that write the language model alone (``gguf``, ``onnx``) and a vision-language model: they
refuse it in one line, at validation where the plan tells (without loading anything, or importing torch),
else when the export runs. ``merged`` and ``adapter`` export a VLM with its processor (docs/vision.md)."""

from __future__ import annotations

from typing import Any

from ftcore.errors import FtcoreError

from ftcore_plugins.common.vlm import plan_vision_model, vision_model_type  # noqa: F401 (the exporters' names)


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
