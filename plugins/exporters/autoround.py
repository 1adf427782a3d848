"""Exporter ``autoround``: the merged model with low-bit weights (4 bits by default, in groups, fp16 scales) calibrated
on the run's own rows by Intel's AutoRound (SignRound: each block's rounding and clipping tuned by signed gradient
descent against its full-precision outputs), written in the W4A16 formats vLLM and transformers load:

- ``format = "compressed-tensors"`` (default): llm-compressor's ``pack-quantized`` layout, which plain transformers
  reloads with the compressed-tensors package;
- ``format = "gptq"``: the GPTQ layout (``qweight``, ``qzeros``, ``scales``), for GPTQ kernels. transformers
  reloads it through gptqmodel, or through auto-round's own backend (``AutoRoundConfig``), which the check here
  uses.

AutoRound, not llm-compressor's or gptqmodel's GPTQ, calibrates: neither installs beside ftcore's stack
(llm-compressor 0.14 pins transformers <= 5.17 and compressed-tensors 0.19; gptqmodel 7.7 needs torch >= 2.14.1,
and 7.6 pins numpy 2.2.6), while auto-round 0.16 changes no pin and runs on a CPU.

Calibration: the rows of ``data`` (default: the last stage's ``eval_data``, else its ``data``), rendered with the
plan's template, joined end to end (an end-of-sequence token between rows) and cut into ``nsamples`` windows of
``seqlen`` tokens, as GPTQ calibrates on a corpus. The merged model is saved to a scratch folder beside the export
and loaded from there for AutoRound, which quantizes the model it is given in place: once tuned, its linear layers
hold the rounded weights as plain ``nn.Linear`` (the quantized model's numbers), and their logits are the reference
before AutoRound packs them into the format. The export, reloaded, must give those logits within ``tolerance``; the
card states that difference and the quantization error, the reference's largest logit difference from the merged
model. (AutoRound's own ``fake`` copy is not the reference: auto-round 0.16.1 writes it with the unrounded weights.)
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import shutil
import tempfile
from pathlib import Path
from collections.abc import Iterator
from typing import Any, Literal

from pydantic import Field

import ftcore
from ftcore.component import Component, Options
from ftcore.errors import FtcoreError

from ftcore_plugins.common.seq2seq import auto_class
from ftcore_plugins.exporters._card import card_path, write_card
from ftcore_plugins.exporters.merged import USAGE, logits, max_abs_diff, merge_verified, verification_inputs

PIP = "pip install 'ftcore[quantize]'"
FORMATS = {"compressed-tensors": "llm_compressor", "gptq": "auto_gptq"}  # ours -> AutoRound's
# Reloaded vs the model AutoRound rounded in memory. compressed-tensors unpacks to the model's dtype: equal in
# float32; in 16 bits its unpacking and AutoRound's rounding can differ by a unit in the last place (0.0039 in
# logits where AutoRound rounded the tests' Llama in bfloat16), so the merge's tolerance (by dtype) applies.
# auto-round's GPTQ backend runs in fp16 on a CPU.
GPTQ_TOLERANCE = 0.05
GPTQ_USAGE = """
from transformers import AutoModelForCausalLM, AutoRoundConfig, AutoTokenizer

# with gptqmodel installed, without quantization_config
model = AutoModelForCausalLM.from_pretrained("{path}", quantization_config=AutoRoundConfig())
tokenizer = AutoTokenizer.from_pretrained("{path}")
"""


@contextlib.contextmanager
def quiet_logger(name: str) -> Iterator[None]:
    """Only ``name``'s errors while the block runs."""
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def calibration_ref(plan: Any, data: str | None) -> str | None:
    """The plan data reference the export calibrates on: ``data``, else the last stage's eval_data, else its data."""
    if data is not None:
        return data
    if not plan.stages:
        return None
    last = plan.stages[-1]
    return str(last.eval_data or last.data)


class AutoRoundExporter(Component):
    """The merged model with AutoRound-calibrated low-bit weights (compressed-tensors or GPTQ layout)."""

    name = "autoround"
    merges = True  # runs after the exports that need the adapter model

    class Options(Options):
        format: Literal["compressed-tensors", "gptq"] = "compressed-tensors"
        bits: Literal[2, 3, 4, 8] = 4
        group_size: int = Field(128, ge=8)  # weights sharing one scale (and zero point unless sym)
        sym: bool = True  # symmetric: no zero points (what vLLM's fastest W4A16 kernels take)
        iters: int = Field(200, ge=0)  # SignRound steps per block (AutoRound's default); 0: rounding to nearest
        nsamples: int = Field(128, ge=1)  # calibration windows (fewer if the rows run out)
        seqlen: int = Field(2048, ge=8)  # tokens per window
        data: str | None = None  # plan data to calibrate on, "name" or "name:split"; default: see the module
        tolerance: float | None = Field(None, ge=0)  # reloaded vs in memory; unset: the merge's, 0.05 for gptq

    def check(self, plan) -> list[str]:
        problems = [] if importlib.util.find_spec("auto_round") else [f"use: exporter 'autoround' needs auto-round: "
                                                                       f"{PIP}"]
        if self.options.format == "compressed-tensors" and importlib.util.find_spec("compressed_tensors") is None:
            problems.append(f"format: \"compressed-tensors\" is written and reloaded with the compressed-tensors "
                            f"package, which is not installed: {PIP}")
        ref = calibration_ref(plan, self.options.data)
        if ref is None:
            problems.append("data: exporter 'autoround' calibrates on the plan's rows, and the plan has no stage; "
                            "name a [data.<name>] with data = \"<name>\"")
        elif ref.split(":")[0] not in plan.data:
            problems.append(f"data: \"{ref}\" names no [data.<name>] of the plan; it has: {', '.join(plan.data)}")
        return problems

    def calibration(self, ctx) -> list[Any]:
        """The calibration windows: 1 x ``seqlen`` token tensors (the last one shorter if the rows run out)."""
        import torch

        from ftcore_plugins.common.chat import chosen_as_chat

        rows = chosen_as_chat(ctx.load_data(calibration_ref(ctx.run.plan, self.options.data)))
        o, tok = self.options, ctx.tokenizer
        eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
        ids: list[int] = []
        for row in rows:
            if "messages" in row:
                text = ctx.template.render(row["messages"], tok)
            elif isinstance(row.get("text"), str):
                text = row["text"]
            else:
                raise FtcoreError("exporter 'autoround': its calibration rows hold neither messages nor text; name "
                                  "chat or text data with data = \"<name>\"")
            ids += tok(text, add_special_tokens=False)["input_ids"] + eos
            if len(ids) >= o.nsamples * o.seqlen:
                break
        if not ids:
            raise FtcoreError("exporter 'autoround': its calibration data is empty; name rows with data = \"<name>\"")
        ids = ids[:o.nsamples * o.seqlen]
        return [torch.tensor([ids[i:i + o.seqlen]]) for i in range(0, len(ids), o.seqlen)]

    def export(self, ctx):
        import torch
        from auto_round import AutoRound, SignRoundConfig
        from auto_round.schemes import QuantizationScheme

        o = self.options
        merged, verification = merge_verified(ctx, "auto", None, self.name)
        windows = self.calibration(ctx)
        inputs = verification_inputs(ctx)
        full = logits(merged, inputs)
        model_cls = auto_class(merged.config)
        dtype = next(merged.parameters()).dtype
        ctx.path.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=".autoround-", dir=ctx.path.parent))
        try:
            merged.save_pretrained(scratch / "merged")
            model = model_cls.from_pretrained(scratch / "merged", dtype=dtype)
            cuda = torch.cuda.is_available()
            # torch.compile on a CPU: 106 s against 7 s of tuning on a 2-layer model (auto-round 0.16.1).
            scheme = QuantizationScheme(bits=o.bits, group_size=o.group_size, sym=o.sym, data_type="int")
            with quiet_logger("autoround"):  # its progress lines; the outcome is logged below
                ar = AutoRound(model, ctx.tokenizer, scheme=scheme, alg_configs=SignRoundConfig(iters=o.iters),
                               nsamples=len(windows), seqlen=o.seqlen, batch_size=1, dataset=windows,
                               seed=ctx.run.plan.seed, device_map="cuda" if cuda else "cpu",
                               enable_torch_compile=cuda, amp=dtype != torch.float32)  # amp: bf16 on a CPU
                quantized, _ = ar.quantize()
                rounded = logits(quantized, inputs)  # before packing replaces its layers
                ar.save_quantized(str(scratch / "out"), format=FORMATS[o.format], inplace=True)
            del ar, model, quantized
            (written,) = {p.parent for p in (scratch / "out").rglob("config.json")}
            for item in written.iterdir():
                shutil.move(str(item), ctx.path / item.name)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        ctx.tokenizer.save_pretrained(ctx.path)  # with the plan's chat template
        reloaded = logits(self.reload(model_cls, ctx.path), inputs)
        diff, error = max_abs_diff(reloaded, rounded), max_abs_diff(rounded, full)
        limit = o.tolerance if o.tolerance is not None else (
            GPTQ_TOLERANCE if o.format == "gptq" else verification["tolerance"])
        described = (f"AutoRound {o.bits}-bit weights in groups of {o.group_size}{'' if o.sym else ', asymmetric'}, "
                     f"{o.format} layout; {o.iters} SignRound steps a block on {len(windows)} windows of "
                     f"{calibration_ref(ctx.run.plan, o.data)}")
        verification.update({"quantization": described, "max_abs_logit_diff_reloaded": diff,
                             "reload_tolerance": limit, "max_abs_logit_diff_vs_merged (quantization error)": error})
        ctx.reporter.log(f"export:{ctx.name}", {"max_abs_logit_diff_reloaded": diff, "quantization_error": error})
        if diff > limit:
            shutil.rmtree(ctx.path, ignore_errors=True)
            raise FtcoreError(f"exporter 'autoround': the export reloaded gives logits {diff:.3g} away from the model "
                              f"quantized in memory, above tolerance {limit:g}; nothing was kept")
        usage = (GPTQ_USAGE if o.format == "gptq" else USAGE).format(path=card_path(ctx), auto=model_cls.__name__)
        write_card(ctx.path, ctx, title=f"AutoRound {o.bits}-bit model ({o.format})", library="transformers",
                   tags=["autoround", o.format, f"{o.bits}-bit"], usage=usage, verification=verification)
        ctx.reporter.info(f"autoround: {described}: export reloaded within {diff:.3g}; quantization error {error:.3g} "
                          "(max abs logit difference from the merged model)")
        return ctx.path

    def reload(self, model_cls, path: Path):
        """The export as a user loads it: plainly (compressed-tensors), or through auto-round's backend (GPTQ)."""
        if self.options.format == "gptq":
            from transformers import AutoRoundConfig

            with quiet_logger("autoround"):  # "Better backend is found": auto-round-lib, optional
                return model_cls.from_pretrained(path, quantization_config=AutoRoundConfig(), device_map="cpu")
        return model_cls.from_pretrained(path)


@ftcore.hookimpl
def register_exporters(register):
    register(AutoRoundExporter)
