"""Exporter ``merged``: a standalone safetensors model folder with its tokenizer, adapter folded in.

Every merge is verified: on a few short chat prompts the merged model's logits must match the
adapter model's within ``tolerance``, else the export fails and writes nothing. A QLoRA adapter is
never merged into 4-bit weights: the base is loaded again at full precision (the quantizer skipped),
the trained adapter weights are copied onto it, and that model is merged and checked.

:func:`merge_verified` is what the other exporters that need a plain model (``onnx``) use.
"""

from __future__ import annotations

import copy
from typing import Any, Literal

from pydantic import Field

import ftcore
from ftcore.component import Component, Options
from ftcore.errors import FtcoreError

from ftcore_plugins.common.seq2seq import auto_class
from ftcore_plugins.common.vision import processor_of
from ftcore_plugins.exporters._card import card_path, write_card

# Short user turns rendered with the plan's template: the verification inputs.
PROMPTS = ("Hello! Who are you?", "Name three colours.", "Explain in one sentence why the sky is blue.")
# Max abs logit difference a correct merge stays under, by the dtype merged in: float32 rounding
# across a deep model stays well below 1e-4; in 16 bits every merged weight is rounded again (8 or
# 11 significant bits): casting the quickstart model (logits up to 9.7) moved them by 0.083 (bf16), 0.0095 (fp16).
TOLERANCES = {"float32": 1e-4, "float64": 1e-8, "bfloat16": 0.25, "float16": 0.05}
Dtype = Literal["auto", "float32", "bfloat16", "float16"]

USAGE = """
from transformers import {auto}, AutoTokenizer

model = {auto}.from_pretrained("{path}")
tokenizer = AutoTokenizer.from_pretrained("{path}")
messages = [{{"role": "user", "content": "Hello!"}}]
inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
print(tokenizer.decode(model.generate(**inputs, max_new_tokens=64)[0]))
"""


VISION_USAGE = """
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor

model = AutoModelForImageTextToText.from_pretrained("{path}")
processor = AutoProcessor.from_pretrained("{path}")
messages = [{{"role": "user", "content": [{{"type": "image"}}, {{"type": "text", "text": "What is this?"}}]}}]
text = processor.apply_chat_template(messages, add_generation_prompt=True)
inputs = processor(text=[text], images=[[Image.open("image.png")]], add_special_tokens=False, return_tensors="pt")
print(processor.decode(model.generate(**inputs, max_new_tokens=64)[0]))
"""


class MergedOptions(Options):
    dtype: Dtype = "auto"  # auto: as trained
    # Max abs logit difference allowed between the merged model and the adapter model, in the dtype
    # merged in (before any cast to ``dtype``); unset: 1e-4 for float32, 0.05 for float16, 0.25 for bfloat16.
    tolerance: float | None = Field(None, ge=0)


class MergedExporter(Component):
    """A plain transformers model folder (safetensors + tokenizer + generation config + model card),
    adapters merged in and the merge checked against the adapter model."""

    name = "merged"
    Options = MergedOptions
    merges = True  # runs after the exports that need the adapter model, and merges it in place

    def export(self, ctx):
        merged, verification = merge_verified(ctx, self.options.dtype, self.options.tolerance, self.name)
        ctx.path.mkdir(parents=True, exist_ok=True)
        merged.save_pretrained(ctx.path)  # safetensors, config.json, generation_config.json
        ctx.tokenizer.save_pretrained(ctx.path)  # with the template as its chat_template
        processor = processor_of(ctx.tokenizer)
        if processor is not None:  # a vision-language model: its processor too (image processor, template)
            processor.save_pretrained(ctx.path)
        usage = (VISION_USAGE if processor is not None else USAGE).format(path=card_path(ctx),
                                                                          auto=auto_class(merged.config).__name__)
        write_card(ctx.path, ctx, title="merged model", library="transformers", tags=["merged"],
                   usage=usage, verification=verification)
        return ctx.path


def merge_verified(ctx, dtype: str, tolerance: float | None, exporter: str) -> tuple[Any, dict[str, Any]]:
    """The final model with its adapter folded in, and the verification record; raises a one-line
    FtcoreError when the merge is outside ``tolerance``. The merge is checked in the model's own
    dtype; a cast to ``dtype`` after it is recorded, not checked.

    Where the run gives the model up (``ctx.consume``), the adapter is merged in place, and the
    merged model is handed on (``ctx.merged``): one copy of the model, never two. Otherwise it is
    merged into a copy and ``ctx.model`` is left as it is. A QLoRA adapter is merged into the base
    reloaded at full precision; given up, the 4-bit model is dropped before that load. Without a
    peft adapter and a cast, the model returned is ``ctx.model`` itself."""
    import torch

    inputs = verification_inputs(ctx)
    live_logits = logits(ctx.model, inputs)
    peft = ctx.adapter is not None and getattr(ctx.adapter, "peft", False)
    record: dict[str, Any] = {"prompts": len(inputs)}
    if peft and ctx.quantized:
        reference = adapter_on_full_precision(ctx)
        reference_logits = logits(reference, inputs)
        merged = ctx.adapter.merge(reference)
        record["reference"] = "the trained adapter on the full-precision base"
    else:
        reference_logits = live_logits
        merged = ctx.adapter.merge(ctx.model if ctx.consume else copy.deepcopy(ctx.model)) if peft else ctx.model
        record["reference"] = "the trained adapter model" if peft else "the trained model"
    if ctx.consume:
        ctx.model = ctx.merged = merged
    merged_logits = logits(merged, inputs)
    merged_dtype = str(next(merged.parameters()).dtype).removeprefix("torch.")
    limit = tolerance if tolerance is not None else TOLERANCES.get(merged_dtype, TOLERANCES["float32"])
    diff = max_abs_diff(merged_logits, reference_logits)
    record.update({"merged_dtype": merged_dtype, "max_abs_logit_diff": diff, "tolerance": limit})
    if peft and ctx.quantized:
        # Information: the 4-bit model trained differs from the full-precision one by its quantization error.
        record["max_abs_logit_diff_vs_quantized_adapter"] = max_abs_diff(merged_logits, live_logits)
    if diff <= limit and dtype not in ("auto", merged_dtype):
        # A copy when the merged model is the live one (later exports get it as it is); else cast in place.
        merged = (copy.deepcopy(merged) if merged is ctx.model else merged).to(getattr(torch, dtype))
        # Information: what the requested precision costs, beyond the merge.
        record["dtype"] = dtype
        record["max_abs_logit_diff_after_cast"] = max_abs_diff(logits(merged, inputs), reference_logits)
    ctx.reporter.log(f"export:{ctx.name}", {k: v for k, v in record.items() if isinstance(v, float)})
    if diff > limit:
        raise FtcoreError(f"exporter '{exporter}': the merged model's logits differ from {record['reference']}'s "
                          f"by up to {diff:.3g} on {len(inputs)} prompts, above tolerance {limit:g}; nothing was "
                          "written (raise [[export]] tolerance if the difference is expected)")
    ctx.reporter.info(f"{exporter}: merge verified, max abs logit difference {diff:.3g} (tolerance {limit:g})")
    return merged, record


def adapter_on_full_precision(ctx) -> Any:
    """The live peft adapter's trained weights on the base rebuilt at full precision. Where the run
    gives the model up (``ctx.consume``), the quantized model is dropped before the base is loaded."""
    from peft import get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict

    if ctx.load_full_precision_base is None:
        raise FtcoreError("the model is quantized and this run cannot rebuild its full-precision base to merge into")
    live = ctx.model
    name = live.active_adapter
    config = copy.deepcopy(live.peft_config[name])
    weights = {k: v.detach().clone() for k, v in get_peft_model_state_dict(live, adapter_name=name).items()}
    if ctx.consume and ctx.release_model is not None:
        live = ctx.model = None
        ctx.release_model()
    model = get_peft_model(ctx.load_full_precision_base(), config, adapter_name=name)
    loaded = set_peft_model_state_dict(model, weights, adapter_name=name)
    if loaded.unexpected_keys:
        raise FtcoreError(f"the trained adapter does not fit the full-precision base: {loaded.unexpected_keys[0]}")
    return model


def verification_inputs(ctx) -> list[Any]:
    """Token ids of a few short chat prompts (plain text when the template cannot render them)."""
    out = []
    for prompt in PROMPTS:
        try:
            text = ctx.template.render([{"role": "user", "content": prompt}], ctx.tokenizer,
                                       add_generation_prompt=True)
            special = False  # the template writes its own BOS
        except FtcoreError:
            text, special = prompt, True
        out.append(ctx.tokenizer(text, return_tensors="pt", add_special_tokens=special)["input_ids"])
    return out


def logits(model, inputs: list[Any]) -> list[Any]:
    """float32 logits of each input on the CPU; the model's train/eval mode is put back. An encoder-decoder's
    decoder reads the input too (``common/seq2seq.py``), so its logits cover both halves of the model."""
    import torch

    from ftcore_plugins.common.seq2seq import decoder_inputs, is_encoder_decoder

    training = model.training
    model.eval()
    device = next(model.parameters()).device
    feed = (lambda ids: decoder_inputs(model, ids)) if is_encoder_decoder(model) else (lambda ids: {"input_ids": ids})
    try:
        with torch.no_grad():
            return [model(**feed(ids.to(device))).logits.float().cpu() for ids in inputs]
    finally:
        model.train(training)


def max_abs_diff(a: list[Any], b: list[Any]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


@ftcore.hookimpl
def register_exporters(register):
    register(MergedExporter)
