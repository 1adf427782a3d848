"""Exporter ``onnx``: the merged model as ONNX (``torch.onnx.export``, the dynamo exporter) for
onnxruntime, with the tokenizer beside it.

The graph takes ``input_ids`` and ``attention_mask`` (batch and sequence lengths dynamic) and
returns ``logits`` for every position; it has no KV cache, so generating with it recomputes the
whole sequence each step. Weights are float32. After writing, onnxruntime runs the file on a few
chat prompts, padded into one batch, and its logits must match transformers' within ``tolerance``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
from collections.abc import Iterator
from typing import Any

from pydantic import Field

import ftcore
from ftcore.component import Component, Options
from ftcore.errors import FtcoreError

from ftcore_plugins.common import seq2seq
from ftcore_plugins.exporters._card import card_path, write_card
from ftcore_plugins.exporters._vision import plan_vision_model, refusal, refuse_loaded
from ftcore_plugins.exporters.merged import merge_verified, verification_inputs

PIP_ONNX = "pip install 'ftcore[onnx]'"
MODULES = ("onnx", "onnxruntime", "onnxscript")  # onnxscript: torch's dynamo exporter writes with it
FILE = "model.onnx"

USAGE = """
import numpy as np
import onnxruntime
from transformers import AutoTokenizer

tokenizer = AutoTokenizer.from_pretrained("{path}")
session = onnxruntime.InferenceSession("{path}/{file}")
text = tokenizer.apply_chat_template([{{"role": "user", "content": "Hello!"}}], add_generation_prompt=True,
                                     tokenize=False)
inputs = tokenizer(text, return_tensors="np", add_special_tokens=False)
(logits,) = session.run(["logits"], {{"input_ids": inputs["input_ids"],
                                      "attention_mask": inputs["attention_mask"]}})
print(tokenizer.decode(int(np.argmax(logits[0, -1]))))  # the next token
"""


# Why a vision-language model is refused (plugins/exporters/_vision.py).
VISION_WHY = "its graph takes input_ids and attention_mask, no pixels, so it would hold the language model alone"
# Why an encoder-decoder (T5, BART) is refused (common/seq2seq.py).
SEQ2SEQ_WHY = "its graph takes input_ids and attention_mask to a causal LM's logits, with no decoder input"
SEQ2SEQ_FIX = "export it with \"merged\" or \"adapter\""


class OnnxOptions(Options):
    opset: int = Field(18, ge=18)  # ONNX opset; the dynamo exporter writes 18 and later
    # Max abs logit difference allowed between onnxruntime and transformers (and for the merge before it).
    tolerance: float = Field(1e-4, ge=0)


class OnnxExporter(Component):
    """The merged model as one ONNX graph (logits for input_ids and attention_mask), checked with onnxruntime."""

    name = "onnx"
    Options = OnnxOptions
    merges = True  # runs after the exports that need the adapter model, and merges it in place

    def check(self, plan) -> list[str]:
        if (vlm := plan_vision_model(plan)) is not None:
            return [f"use: {refusal(self.name, vlm, VISION_WHY)}"]
        if (family := seq2seq.plan_encoder_decoder(plan)) is not None:
            return [f"use: {seq2seq.refusal(f'exporter {self.name!r}', family, SEQ2SEQ_WHY, SEQ2SEQ_FIX)}"]
        absent = [m for m in MODULES if importlib.util.find_spec(m) is None]
        if absent:
            return [f"use: exporter 'onnx' needs {', '.join(absent)}, which is not installed: {PIP_ONNX}"]
        return []

    def export(self, ctx):
        import torch

        refuse_loaded(ctx, ctx.model, self.name, VISION_WHY)
        model, merge = merge_verified(ctx, "float32", self.options.tolerance, self.name)
        batch = torch.export.Dim("batch")
        sequence = torch.export.Dim("sequence")
        # Two separate tensors: the exporter treats one tensor passed twice as one input.
        ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
        example = (ids, torch.ones_like(ids))
        ctx.path.mkdir(parents=True, exist_ok=True)
        training = model.training  # it can be ctx.model itself (no adapter to merge): put its mode back
        try:
            with quiet("onnxscript", "onnx_ir"):  # their INFO lines, one per optimisation pass, would fill run.log
                torch.onnx.export(logits_only(model), example, ctx.path / FILE,
                                  input_names=["input_ids", "attention_mask"], output_names=["logits"],
                                  dynamic_shapes={"input_ids": {0: batch, 1: sequence},
                                                  "attention_mask": {0: batch, 1: sequence}},
                                  opset_version=self.options.opset, dynamo=True, verbose=False)
            check = self.verify(ctx, model)
        finally:
            model.train(training)
        ctx.tokenizer.save_pretrained(ctx.path)
        model.config.save_pretrained(ctx.path)
        model.generation_config.save_pretrained(ctx.path)
        write_card(ctx.path, ctx, title="ONNX model", library="onnx", tags=["onnx"],
                   usage=USAGE.format(path=card_path(ctx), file=FILE),
                   verification={**{f"merge {k}": v for k, v in merge.items()}, **check})
        return ctx.path / FILE

    def verify(self, ctx, model) -> dict[str, Any]:
        """onnxruntime against transformers on the prompts padded into one batch (left padding, so the
        batch and sequence axes both vary), compared where the attention mask is 1."""
        import onnxruntime
        import torch

        inputs = verification_inputs(ctx)
        width = max(ids.shape[1] for ids in inputs)
        pad = ctx.tokenizer.pad_token_id if ctx.tokenizer.pad_token_id is not None else 0
        ids = torch.full((len(inputs), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, one in enumerate(inputs):
            ids[row, width - one.shape[1]:] = one[0]
            mask[row, width - one.shape[1]:] = 1
        session = onnxruntime.InferenceSession(str(ctx.path / FILE), providers=["CPUExecutionProvider"])
        (onnx_logits,) = session.run(["logits"], {"input_ids": ids.numpy(), "attention_mask": mask.numpy()})
        with torch.no_grad():
            reference = logits_only(model)(ids, mask).float()
        keep = mask.bool()
        diff = float((torch.from_numpy(onnx_logits)[keep] - reference[keep]).abs().max())
        record = {"onnxruntime max_abs_logit_diff": diff, "onnxruntime tolerance": self.options.tolerance,
                  "onnxruntime batch": list(ids.shape)}
        ctx.reporter.log(f"export:{ctx.name}", {"onnxruntime_max_abs_logit_diff": diff})
        if diff > self.options.tolerance:
            raise FtcoreError(f"exporter 'onnx': onnxruntime's logits differ from transformers' by up to {diff:.3g} "
                              f"on {len(inputs)} prompts, above tolerance {self.options.tolerance:g} "
                              f"({ctx.path / FILE} is left for inspection)")
        ctx.reporter.info(f"onnx: onnxruntime matches transformers, max abs logit difference {diff:.3g}")
        return record


@contextlib.contextmanager
def quiet(*loggers: str) -> Iterator[None]:
    saved = {name: logging.getLogger(name).level for name in loggers}
    for name in loggers:
        logging.getLogger(name).setLevel(logging.WARNING)
    try:
        yield
    finally:
        for name, level in saved.items():
            logging.getLogger(name).setLevel(level)


def logits_only(model) -> Any:
    """``(input_ids, attention_mask) -> logits`` without a KV cache: the module the exporter traces."""
    import torch

    class LogitsOnly(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask):
            return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits

    return LogitsOnly().eval()


@ftcore.hookimpl
def register_exporters(register):
    register(OnnxExporter)
