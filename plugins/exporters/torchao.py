"""Exporter ``torchao``: the merged model with its linear layers quantized by torchao (weight-only int8; int4 on a
CUDA GPU; after a stage trained with ``qat``, that stage's scheme), as a transformers folder that ``from_pretrained`` reloads quantized (its ``quantization_config``
says how), with its tokenizer and a model card.

The adapter is merged and verified as ``merged`` does (:func:`merge_verified`). The merged model is written at
full precision to a scratch folder beside the export, loaded again through ``TorchAoConfig`` (transformers
quantizes it as it loads, as the ``torchao`` quantizer does) and saved. The export is then reloaded on its own:
its logits must equal the quantized model's within ``tolerance``, and their difference from the merged model's,
the quantization error, is recorded in the card.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Literal

from pydantic import Field

import ftcore
from ftcore.component import Component, Options
from ftcore.errors import FtcoreError

from ftcore_plugins.common.seq2seq import auto_class
from ftcore_plugins.exporters._card import card_path, write_card
from ftcore_plugins.exporters.merged import USAGE, logits, max_abs_diff, merge_verified, verification_inputs

PIP = "pip install 'ftcore[quantize]'"
# torchao's int4 weight-only layouts run on CUDA only (plugins/quantizers/torchao.py says what stops them on a CPU).
CUDA_ONLY = {"int4": "torchao's int4 weight-only layouts run on CUDA only (\"Requires mslk >= 1.0.0\" on a CPU)"}


class TorchaoExporter(Component):
    """The merged model with torchao-quantized linear layers (weight-only, or a QAT stage's scheme), reloadable by
    transformers."""

    name = "torchao"
    merges = True  # runs after the exports that need the adapter model, and merges it in place

    class Options(Options):
        # auto: the scheme of the run's last stage that trained with qat (plugins/common/qat.py), else int8
        weights: Literal["auto", "int8", "int4"] = "auto"
        group_size: int = Field(128, ge=16)  # int4 only: weights sharing one scale and zero point
        # Max abs logit difference allowed between the export reloaded and the model quantized in memory (the
        # same weights: a reload changes nothing), and for the merge before it.
        tolerance: float = Field(1e-4, ge=0)

    def check(self, plan) -> list[str]:
        import importlib.util

        from ftcore_plugins.common.memory import gpu_visible

        problems = [] if importlib.util.find_spec("torchao") else [f"use: exporter 'torchao' needs torchao: {PIP}"]
        why = CUDA_ONLY.get(self.options.weights)
        if why and not gpu_visible():
            problems.append(f"weights: \"{self.options.weights}\": {why}; use weights = \"int8\" on this machine")
        return problems

    def scheme(self, plan) -> tuple[str, str]:
        """What the export quantizes to, for messages and the card, and for :meth:`config`: ``("qat", ...)`` for
        the scheme a stage trained for, else the ``weights`` option's."""
        from ftcore_plugins.common.qat import plan_qat

        found = plan_qat(plan) if self.options.weights == "auto" else None
        if found is not None:
            stage, qat = found
            return "qat", f"torchao {qat.describe()}, the scheme stage '{stage}' trained for (QAT)"
        weights = "int8" if self.options.weights == "auto" else self.options.weights
        return weights, f"torchao {weights} weight-only"

    def config(self, plan):
        from torchao.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig
        from transformers import TorchAoConfig

        from ftcore_plugins.common.qat import base_config, plan_qat

        weights, _ = self.scheme(plan)
        if weights == "qat":
            return TorchAoConfig(base_config(plan_qat(plan)[1]))
        return TorchAoConfig(Int8WeightOnlyConfig() if weights == "int8" else Int4WeightOnlyConfig(
            group_size=self.options.group_size))

    def export(self, ctx):
        weights, described = self.scheme(ctx.run.plan)
        merged, verification = merge_verified(ctx, "auto", self.options.tolerance, self.name)
        inputs = verification_inputs(ctx)
        full = logits(merged, inputs)
        model_cls = auto_class(merged.config)
        ctx.path.parent.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=".torchao-", dir=ctx.path.parent))
        try:
            merged.save_pretrained(scratch)
            quantized = model_cls.from_pretrained(scratch, quantization_config=self.config(ctx.run.plan),
                                                  dtype=next(merged.parameters()).dtype)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        quantized_logits = logits(quantized, inputs)
        ctx.path.mkdir(parents=True, exist_ok=True)
        quantized.save_pretrained(ctx.path)
        ctx.tokenizer.save_pretrained(ctx.path)
        del quantized
        reloaded = model_cls.from_pretrained(ctx.path)
        diff = max_abs_diff(logits(reloaded, inputs), quantized_logits)
        error = max_abs_diff(quantized_logits, full)
        verification.update({"quantization": described,
                             "max_abs_logit_diff_reloaded": diff,
                             "max_abs_logit_diff_vs_merged (quantization error)": error})
        ctx.reporter.log(f"export:{ctx.name}", {"max_abs_logit_diff_reloaded": diff, "quantization_error": error})
        if diff > self.options.tolerance:
            shutil.rmtree(ctx.path, ignore_errors=True)
            raise FtcoreError(f"exporter 'torchao': the export reloaded gives logits {diff:.3g} away from the model "
                              f"quantized in memory, above tolerance {self.options.tolerance:g}; nothing was kept")
        usage = USAGE.format(path=card_path(ctx), auto=model_cls.__name__)
        title = "torchao QAT model" if weights == "qat" else f"torchao {weights} model"
        write_card(ctx.path, ctx, title=title, library="transformers",
                   tags=["torchao", weights], usage=usage, verification=verification)
        ctx.reporter.info(f"torchao: {described}: export reloaded within {diff:.3g}; quantization error "
                          f"{error:.3g} (max abs logit difference from the merged model)")
        return ctx.path


@ftcore.hookimpl
def register_exporters(register):
    register(TorchaoExporter)
