"""LoRA on fused expert parameters, run per expert: ``x W^T + s (x A^T) B^T`` over transformers' grouped matmul.

peft 0.21 adapts a fused expert parameter (``experts.gate_up_proj``, experts x out x in) with a ``ParamWrapper``
that, while the experts run, parametrizes it as ``W + s B A`` for every expert at once (``_LoraFactorsProxy``: one
``baddbmm`` over the whole stack), which the experts' grouped matmul then saves for backward: a copy of the whole
expert stack per adapted tensor, and a gradient as large in backward (benchmarks/RESULTS.md, "Expert LoRA memory
(issue #42)"). Here the wrappers keep their modules, state dict, merge and adapter files, but instead of
parametrizing they hand their factors to the experts module, and an experts implementation registered with
transformers' ``ExpertsInterface`` (:data:`NAME`, its extension point) runs each projection as the frozen
weight's grouped matmul plus the low-rank path of each expert on its own tokens: backward keeps the rank-r
intermediates, not ``W + s B A``.

:func:`enable` (``lora`` calls it once peft has wrapped the model) switches the experts modules that run
transformers' default ``grouped_mm`` to :data:`NAME` and has the wrappers on their fused parameters hand over
their factors; :func:`disable` switches them back (peft's path again). Where the grouped path cannot apply
(:func:`why_not`: several active adapters, float8 weights, expert parallel, experts that are not transformers'
``use_experts_implementation`` kind, another experts implementation) a wrapper parametrizes as peft does, and
says why in a debug log.
"""

from __future__ import annotations

import logging
import types
from contextlib import contextmanager
from typing import Any

log = logging.getLogger("ftcore")

NAME = "ftcore_lora_grouped_mm"  # the experts implementation registered with transformers' ExpertsInterface
DEFAULT = "grouped_mm"  # transformers' default implementation, which NAME extends
_ACTIVE = "_ftcore_expert_lora"  # on an experts module while its wrappers run: parameter name -> factors
_said: set[tuple[str, str, str]] = set()


def register() -> None:
    """Register :func:`lora_grouped_mm_experts_forward` as :data:`NAME` (idempotent)."""
    from transformers.integrations.moe import ExpertsInterface

    if ExpertsInterface._global_mapping.get(NAME) is not lora_grouped_mm_experts_forward:
        ExpertsInterface.register(NAME, lora_grouped_mm_experts_forward)


def _decorated(module: Any) -> bool:
    """An experts module of transformers' ``use_experts_implementation`` kind (its forward dispatches through
    ``ExpertsInterface`` on ``config._experts_implementation``)."""
    return all(hasattr(module, a) for a in ("config", "has_gate", "is_transposed", "_is_expert_parallel")) and \
        hasattr(type(module).forward, "__wrapped__")


def _projections(experts: Any) -> tuple[str, str]:
    return ("gate_up_proj" if experts.has_gate else "up_proj"), "down_proj"


def _adapters(wrapper: Any, active: Any = None) -> list[str]:
    return [a for a in (wrapper.active_adapters if active is None else active) if a in wrapper.lora_A]


def why_not(wrapper: Any, adapters: list[str] | None = None) -> str | None:
    """Why ``wrapper`` (a peft ``ParamWrapper``) cannot run the grouped path with ``adapters`` active (by default
    its active adapters), or None when it can."""
    import torch

    adapters = _adapters(wrapper) if adapters is None else adapters
    if len(adapters) != 1:
        return f"{len(adapters)} adapters active (peft sums their deltas into the weight)"
    base = wrapper.get_base_layer()
    if not _decorated(base):
        return f"{type(base).__name__} is not an experts module of transformers' use_experts_implementation kind"
    if wrapper.parameter_name not in _projections(base) or wrapper.get_param().dim() != 3:
        return f"{wrapper.parameter_name} is not one of the experts' fused projections"
    implementation = base.config._experts_implementation
    if implementation != NAME:
        return f"the experts run transformers' {implementation!r} implementation, not {NAME!r}"
    dtype = wrapper.get_param().dtype
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"its weights are {str(dtype).removeprefix('torch.')} (peft adds the delta at higher precision)"
    if base._is_expert_parallel:
        return "the experts are split across devices (expert parallel)"
    if wrapper.use_dora.get(adapters[0]) or wrapper.lora_bias.get(adapters[0]):
        return "DoRA or lora_bias"
    return None


def runs_grouped(wrapper: Any) -> bool:
    """Whether ``wrapper`` runs the grouped path as the model stands (:func:`enable` applied, nothing in the way)."""
    return "_activate_lora" in wrapper.__dict__ and why_not(wrapper) is None


def padded_rank(r: int, dtype: Any) -> int:
    """The rank the grouped matmul runs at: torch's grouped_mm wants each row of the rank-r operands 16-byte
    aligned (r * element size a multiple of 16; CPU and CUDA alike), so r is padded with zeros up to that."""
    import torch

    step = 16 // (torch.finfo(dtype).bits // 8)
    return -(-r // step) * step


def _factors(wrapper: Any, adapter: str, dtype: Any) -> tuple[Any, Any]:
    """``(A, B)`` of each expert as the grouped matmul takes them, in the weight's dtype as peft's path has them:
    A experts x r x in (a view of peft's ``lora_A``, unless cast or padded), B experts x out x r (a copy: peft
    stores it out x (r x experts), experts fastest, which no grouped matmul reads)."""
    import torch.nn.functional as F

    e = wrapper.num_experts
    a = wrapper.lora_A[adapter].weight
    b = wrapper.lora_B[adapter].weight
    a = a.reshape(e, -1, a.shape[-1])  # peft's layout, as get_delta_factors reads it
    b = b.reshape(b.shape[0], -1, e).permute(2, 0, 1)
    pad = padded_rank(a.shape[1], dtype) - a.shape[1]
    if pad:  # zero rows of A and columns of B: the product is unchanged
        a, b = F.pad(a, (0, 0, 0, pad)), F.pad(b, (0, pad))
    return a.to(dtype), b.to(dtype).contiguous()


def _say(wrapper: Any, why: str) -> None:
    key = (type(wrapper.get_base_layer()).__name__, wrapper.parameter_name, why)
    if key not in _said:
        _said.add(key)
        log.debug("expert LoRA on %s.%s runs peft's path (W + s B A for every expert at once): %s", *key)


@contextmanager
def _activate_lora(self, active_adapters: list[str]):
    """Replaces ``ParamWrapper._activate_lora`` on the wrappers :func:`enable` takes: while the experts run, hand
    this parameter's factors to the experts module instead of parametrizing it; peft's own where :func:`why_not`."""
    from peft.tuners.lora import ParamWrapper

    adapters = _adapters(self, active_adapters)
    why = why_not(self, adapters) if adapters else "no adapter"
    if why is not None:
        if adapters:
            _say(self, why)
        with ParamWrapper._activate_lora(self, active_adapters):
            yield
        return
    adapter = adapters[0]
    base = self.get_base_layer()
    active = base.__dict__.setdefault(_ACTIVE, {})
    a, b = _factors(self, adapter, self.get_param().dtype)
    active[self.parameter_name] = (a, b, self.scaling[adapter], self.lora_dropout[adapter])
    try:
        yield
    finally:
        active.pop(self.parameter_name, None)


def _experts_wrappers(model: Any):
    """(wrapper, experts module) for each peft ParamWrapper on a 3-D parameter."""
    from peft.tuners.lora import ParamWrapper

    for module in model.modules():
        if isinstance(module, ParamWrapper) and module.get_param().dim() == 3:
            yield module, module.get_base_layer()


def enable(model: Any) -> int:
    """Run the LoRA of ``model``'s fused expert parameters through the grouped path; the number of wrappers that
    do (the others say why in a debug log)."""
    register()
    count = 0
    for wrapper, experts in _experts_wrappers(model):
        if _decorated(experts):
            wrapper._activate_lora = types.MethodType(_activate_lora, wrapper)
            if experts.config._experts_implementation == DEFAULT:  # one chosen on purpose (batched_mm, ...) stays
                experts.config._experts_implementation = NAME
        why = why_not(wrapper)
        if why is None:
            count += 1
        else:
            _say(wrapper, why)
    return count


def disable(model: Any) -> None:
    """Back to transformers' ``grouped_mm``: the wrappers then parametrize as peft does (and a merged model, its
    experts without wrappers, runs transformers' own forward)."""
    for module in model.modules():
        config = getattr(module, "config", None)
        if _decorated(module) and config._experts_implementation == NAME:
            config._experts_implementation = DEFAULT


def lora_grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """transformers' ``grouped_mm_experts_forward`` (integrations/moe.py), each projection a wrapper handed factors
    for adding ``s (drop(x) A_e^T) B_e^T`` on each expert's own tokens, through the same ``_grouped_linear``.
    Without factors (adapters disabled or merged, no adapter here) it is transformers' function itself."""
    import torch
    from transformers.integrations.moe import _grouped_linear, grouped_mm_experts_forward

    lora = self.__dict__.get(_ACTIVE)
    if not lora:
        return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    if self._is_expert_parallel:  # why_not keeps the factors away: transformers' sentinel rows are not handled here
        raise RuntimeError("ftcore's grouped expert LoRA does not run under expert parallel")
    device = hidden_states.device
    num_top_k = top_k_index.size(-1)
    num_tokens, hidden_dim = hidden_states.size(0), hidden_states.size(-1)

    # Tokens sorted by expert, and each expert's end row, as transformers computes them.
    expert_ids, perm = torch.sort(top_k_index.reshape(-1))
    x = hidden_states[perm // num_top_k]
    sample_weights = top_k_weights.reshape(-1)[perm]
    histc_input = expert_ids.float() if device.type in ("cpu", "mps") else expert_ids.int()
    offsets = torch.cumsum(torch.histc(histc_input, bins=self.num_experts, min=0, max=self.num_experts - 1), dim=0,
                           dtype=torch.int32)

    def project(name: str, x):
        bias = getattr(self, f"{name}_bias")[expert_ids] if self.has_bias else None
        out = _grouped_linear(x, getattr(self, name), offsets, bias=bias, is_transposed=self.is_transposed)
        if name in lora:
            a, b, scaling, dropout = lora[name]
            low = _grouped_linear(dropout(x), a, offsets) * scaling  # (tokens, r): what backward keeps
            out = out + _grouped_linear(low, b, offsets)
        return out

    up, down = _projections(self)
    h = project(up, x)
    h = self._apply_gate(h) if self.has_gate else self.act_fn(h)
    out = project(down, h)
    if self.has_post_expert_norm:
        out = self.post_expert_norm(out)
    out = out * sample_weights.unsqueeze(-1)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.size(0), device=device)
    return out[inverse].view(num_tokens, num_top_k, hidden_dim).sum(dim=1).to(hidden_states.dtype)
