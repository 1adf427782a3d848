"""Where a mixture-of-experts model keeps its routed experts: shared by the adapters (which adapt them), the
quantizers (which say what stays unquantized) and the estimate (which counts them)."""

from __future__ import annotations

from typing import Any


def _conv1d_class():
    from transformers.pytorch_utils import Conv1D

    return Conv1D


def is_torch_layer(module: Any) -> bool:
    """A layer of torch's kinds (Linear, Conv1d, Embedding, norms; transformers' subclasses, GPT-2's
    Conv1D): its weight is the layer's, neither an expert's nor a router's."""
    import torch

    return type(module).__module__.startswith("torch.nn") or isinstance(
        module, (torch.nn.Linear, torch.nn.Embedding, torch.nn.modules.conv._ConvNd, _conv1d_class()))


def expert_parameters(model: Any) -> dict[str, Any]:
    """The routed experts' weights stored as parameters, by path (``model.layers.0.mlp.experts.gate_up_proj``),
    in model order: each 3-D floating-point parameter (experts x in x out, in either order) of a module that
    torch does not define (a Conv1d's kernel is 3-D too) and that a path part or its class name marks as
    experts (``mlp.experts``, JetMoE's ``JetMoeParallelExperts``)."""
    found = {}
    for path, module in model.named_modules():
        if is_torch_layer(module):
            continue
        if "expert" not in type(module).__name__.lower() and not any("expert" in p for p in path.lower().split(".")):
            continue
        for name, param in module.named_parameters(recurse=False):
            if param.dim() == 3 and param.is_floating_point():
                found[f"{path}.{name}" if path else name] = param
    return found

