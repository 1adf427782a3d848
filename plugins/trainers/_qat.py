"""``qat = {...}`` on an ``sft`` stage: quantization-aware training through torchao (``common/qat.py`` names the
schemes).

While the stage trains, the linear layers the ``torchao`` exporter quantizes (every ``nn.Linear`` but the
output head; under LoRA the frozen base layers, not the adapter's) compute with their weights fake-quantized
to the scheme: torchao's ``QATConfig`` prepare step swaps them for ``FakeQuantizedLinear``, which keeps the
same parameters (the optimizer and checkpoints see nothing new). Evaluation during the stage runs them too,
so its loss is the quantized model's. When training ends, the convert step swaps them back to ``nn.Linear``:
the stage hands on a full-precision model, trained for the scheme, which ``[[export]] use = "torchao"``
quantizes for real.

Under LoRA the base weights are fake-quantized and the adapter is not, as in torchtune's and Unsloth's QAT
with LoRA; the export quantizes the merged weights, so it differs from the trained model by the adapter's
share of the rounding (the export's card states the difference it measured).

``plan_problems`` is what ``ftcore validate`` checks (no import of torch or torchao).
"""

from __future__ import annotations

import contextlib
import importlib.util
import re
from collections.abc import Iterator
from typing import Any

from ftcore.errors import FtcoreError

from ftcore_plugins.common.seq2seq import plan_encoder_decoder


def plan_problems(component: Any, plan: Any) -> list[str]:
    """``check(plan)`` problems of ``qat`` on the stages that use ``component``."""
    qat = getattr(component.options, "qat", None)
    if qat is None or not any(s.trainer.options is component.options for s in plan.stages):
        return []
    if importlib.util.find_spec("torchao") is None:
        return ["qat: fake-quantizes with torchao, which is not installed: pip install 'ftcore[quantize]', or "
                "remove qat"]
    out = []
    if plan.quantizer.name != "none":
        out.append(f"qat: trains full-precision weights for a quantization applied after training, and [quantizer] "
                   f"use = \"{plan.quantizer.name}\" stores the base quantized already; use [quantizer] use = "
                   "\"none\", or remove qat")
    if family := plan_encoder_decoder(plan):
        out.append(f"qat: fake-quantizes decoder-only models, and this model is an encoder-decoder ({family}); "
                   "remove qat")
    from ftcore_plugins.trainers._hybrid import model_config

    config = model_config(plan) or {}
    heads, head_dim = config.get("num_attention_heads"), config.get("head_dim")
    inputs = {"hidden_size": config.get("hidden_size"), "intermediate_size": config.get("intermediate_size"),
              "num_attention_heads x head_dim": heads * head_dim if isinstance(heads, int) and
              isinstance(head_dim, int) else None}
    for key, width in inputs.items():
        if isinstance(width, int) and width % qat.group_size:
            out.append(f"qat: group_size {qat.group_size} does not divide the model's {key} ({width}), the input "
                       f"width of some of its linear layers; use a group_size that divides it")
            break
    return out


def _targets(model: Any) -> dict[str, Any]:
    """The linear layers ``qat`` fake-quantizes, by path: plain ``nn.Linear`` layers, not the output head and
    not a peft adapter's own (``lora_A``, ``lora_B``, ...)."""
    import torch

    head = model.get_output_embeddings()
    return {path: m for path, m in model.named_modules()
            if type(m) is torch.nn.Linear and m is not head
            and not any(part.startswith("lora_") for part in path.split("."))}


def activation_bytes(options: Any, model: Any, checkpointing: bool) -> int:
    """What ``qat`` adds to a training step's saved tensors, for ``ftcore estimate`` (``model``: the meta model
    with its adapter): each fake-quantized layer keeps two weight-sized tensors in the weight's dtype for backward
    (torchao 0.18's fake quantization), and its fp32 scales twice (counted with saved-tensor hooks,
    tests/test_qat.py). With checkpointing one decoder layer
    is recomputed at a time: the largest layer's share."""
    if options is None or model is None:
        return 0
    sizes: dict[str, int] = {}
    for path, layer in _targets(model).items():
        block = re.match(r"(.*?\.\d+)(\.|$)", path)  # ...layers.3.mlp.up_proj -> ...layers.3: its decoder layer
        block = block.group(1) if block else path
        n = layer.weight.numel()  # two weight-sized tensors, and twice its fp32 scales (one per group)
        sizes[block] = sizes.get(block, 0) + 2 * n * layer.weight.element_size() + 2 * 4 * -(-n // options.group_size)
    return (max(sizes.values(), default=0) if checkpointing else sum(sizes.values()))


@contextlib.contextmanager
def fake_quantized(model: Any, options: Any, *, stage: str, reporter: Any) -> Iterator[int]:
    """Within the block, ``model``'s linear layers compute with fake-quantized weights (``options``: a
    ``QatOptions``, or None for nothing); yields how many. Put back to ``nn.Linear`` on the way out."""
    if options is None:
        yield 0
        return
    from torchao.quantization import quantize_
    from torchao.quantization.qat import QATConfig

    from ftcore_plugins.common.qat import base_config

    targets = _targets(model)
    for path, layer in targets.items():
        if layer.in_features % options.group_size:
            raise FtcoreError(f"qat: group_size {options.group_size} does not divide the input width "
                              f"{layer.in_features} of layer {path}; use a group_size that divides it")
    if not targets:
        raise FtcoreError(f"stage '{stage}': qat found no linear layer to fake-quantize in this model")
    chosen = {id(m) for m in targets.values()}
    quantize_(model, QATConfig(base_config(options), step="prepare"), filter_fn=lambda m, _: id(m) in chosen)
    reporter.info(f"stage {stage}: QAT: {len(targets)} linear layers train fake-quantized to {options.describe()} "
                  "(torchao)")
    try:
        yield len(targets)
    finally:
        quantize_(model, QATConfig(step="convert"))  # FakeQuantizedLinear -> nn.Linear, the same parameters
