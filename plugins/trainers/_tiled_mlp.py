"""``tiled_mlp = true``: each decoder layer's MLP run over shards of the sequence by DeepSpeed's ``TiledMLP``
(Arctic Long Sequence Training, arXiv 2506.13996), for a stage's training.

``TiledMLP`` is an autograd Function: its forward runs the MLP shard by shard without keeping anything but
the MLP's input, and its backward runs each shard's forward again and backpropagates it, so only one
shard's intermediate activations (tokens / shards x intermediate_size, times the few tensors the MLP makes)
exist at a time, instead of the whole row's. The price is one more forward of every MLP per step. The
shard count is DeepSpeed's rule, ``ceil(tokens / hidden_size)`` (shards about as long as the model is
wide), agreed on by every process (the largest) when several train together.

The MLPs are found from the loaded model (``layer_mlps``): the module each decoder layer holds as its MLP
(``mlp``, ``feed_forward``, ...) when it is dense (at least two linear projections, no routed experts).
Their ``forward`` is replaced on the instance, over the original (with any LoRA layers inside it), while the
stage trains, and put back afterwards (``tiled_mlps``). Forwards without gradients (evaluation, generation,
a reference model's scores) run the MLP whole: there is no backward to save activations for, and ranks that
generate different lengths must not have to agree on a shard count.

``plan_problems`` is what ``ftcore validate`` checks (no import of torch or DeepSpeed)."""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator
from typing import Any

from ftcore_plugins.common.seq2seq import plan_encoder_decoder

# The attribute a decoder layer holds its feed-forward block under, across transformers' causal LMs.
MLP_ATTRIBUTES = ("mlp", "feed_forward", "ffn", "block_sparse_moe")
RULE = "ceil(tokens / hidden_size) shards of the sequence"


def plan_problems(component: Any, plan: Any) -> list[str]:
    """``check(plan)`` problems of ``tiled_mlp = true`` on the stages that use ``component``."""
    o = component.options
    if not getattr(o, "tiled_mlp", False) or not any(s.trainer.options is o for s in plan.stages):
        return []
    if importlib.util.find_spec("deepspeed") is None:
        return ["tiled_mlp: runs each MLP with DeepSpeed's TiledMLP, and DeepSpeed is not installed; install it "
                "with: pip install 'ftcore[distributed]', or set tiled_mlp = false"]
    out = []
    if family := plan_encoder_decoder(plan):
        out.append(f"tiled_mlp: tiles a decoder-only model's MLPs, and this model is an encoder-decoder "
                   f"({family}); set tiled_mlp = false")
    d = getattr(plan, "distributed", None)
    if d is not None and d.processes > 1 and d.accelerate_config is None and d.engine != "deepspeed":
        out.append(f"tiled_mlp: the backward of a tiled MLP adds its weights' gradients shard by shard, which "
                   f"engine = \"{d.engine}\" takes as the gradient being ready more than once; use engine = "
                   "\"deepspeed\" in [distributed] (DeepSpeed waits for the last shard), or set tiled_mlp = false")
    return out


def _is_linear(module: Any) -> bool:
    """A projection: a linear layer (a quantized or peft-wrapped one too) or GPT-2's Conv1D."""
    import torch

    return isinstance(module, torch.nn.Linear) or hasattr(module, "base_layer") \
        or type(module).__name__ == "Conv1D"


def _is_moe(module: Any) -> bool:
    """A mixture of experts: routed experts inside (``experts``, a router), not a dense MLP."""
    return any("expert" in name.lower() or name == "router" for name, _ in module.named_children())


def layer_mlps(model: Any) -> tuple[list[Any], list[str], int]:
    """The dense MLP of each of ``model``'s decoder layers (found through a peft wrapper); the class names of
    the layers' mixtures of experts, which are not tiled; and how many decoder layers there are."""
    from ftcore_plugins.trainers._compile import repeated_blocks

    blocks = repeated_blocks(model)
    dense, experts = [], []
    for block in blocks:
        mlp = next((getattr(block, a) for a in MLP_ATTRIBUTES if getattr(block, a, None) is not None), None)
        if mlp is None:
            continue
        if _is_moe(mlp):
            experts.append(type(mlp).__name__)
        elif sum(_is_linear(child) for child in mlp.children()) >= 2:
            dense.append(mlp)
    return dense, experts, len(blocks)


def _dropout(mlp: Any) -> float:
    """The largest dropout probability inside ``mlp`` (a LoRA layer's lora_dropout, the model's own)."""
    import torch

    return max((m.p for m in mlp.modules() if isinstance(m, torch.nn.modules.dropout._DropoutNd)), default=0.0)


def _exact(shards: int, *lengths: int) -> int:
    """The largest count up to ``shards`` that ``torch.chunk`` splits each of ``lengths`` into exactly (it gives
    fewer, larger chunks when they do not divide evenly; TiledMLP tells DeepSpeed a gradient is ready at its
    ``shards``-th chunk)."""
    for n in range(min(shards, *lengths), 1, -1):
        if all(-(-length // -(-length // n)) == n for length in lengths):
            return n
    return 1


def _tiled_forward(previous: Any, seen: dict[str, int]) -> Any:
    """A ``forward`` for an MLP: DeepSpeed's TiledMLP over ``previous`` (the instance's own forward when it had
    one, else its class's), when gradients are being recorded. Bound to the module, so a deep copy of the
    model (a reference model) runs its own weights."""
    import math

    import torch
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    from ftcore.errors import FtcoreError

    def forward(self: Any, x: Any, *args: Any, **kwargs: Any) -> Any:
        def whole(module: Any, hidden: Any) -> Any:
            return previous(hidden, *args, **kwargs) if previous is not None \
                else type(module).forward(module, hidden, *args, **kwargs)

        if not torch.is_grad_enabled() or x.dim() < 2:
            return whole(self, x)
        if any(isinstance(a, torch.Tensor) for a in (*args, *kwargs.values())):
            raise FtcoreError(f"tiled_mlp: {type(self).__name__}.forward takes tensors beside the hidden states, "
                              "which tiling the sequence would not split with them; set tiled_mlp = false")
        tokens, hidden = x.shape[-2], x.shape[-1]
        shards = math.ceil(tokens / hidden)
        if torch.distributed.is_available() and torch.distributed.is_initialized() \
                and torch.distributed.get_world_size() > 1:
            # every process runs the same number of shards (ZeRO-3 gathers the weights for each)
            agreed = torch.tensor(shards, device=x.device)
            torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MAX)
            shards = int(agreed.item())
        shards = _exact(shards, tokens, x.numel() // hidden)  # forward chunks the tokens, backward all rows
        seen["shards"] = max(seen["shards"], shards)
        params = list(self.parameters())
        if not x.requires_grad and any(p.requires_grad for p in params):
            # An autograd Function's output needs a grad-requiring input for its backward to run: the first
            # layer's MLP input does not when only the MLP trains (LoRA on its projections alone).
            x = x.detach().requires_grad_()
        return TiledMLP.apply(whole, self, x, shards, params)

    return forward


@contextlib.contextmanager
def tiled_mlps(model: Any, enabled: bool, *, stage: str = "", reporter: Any = None,
               distributed_engine: bool = True) -> Iterator[dict[str, int]]:
    """Tile ``model``'s decoder-layer MLPs while the block runs; yields ``{"layers": tiled MLPs, "shards": the
    most shards a forward used}`` (layers 0 when not ``enabled``). ``distributed_engine``: whether the weights'
    gradients may arrive shard by shard (DeepSpeed, or one process); refused otherwise."""
    import types

    from ftcore.errors import FtcoreError

    seen = {"layers": 0, "shards": 0}
    if not enabled:
        yield seen
        return
    where = f"stage {stage}: " if stage else ""
    if not distributed_engine:
        raise FtcoreError(f"{where}tiled_mlp: the backward of a tiled MLP adds its weights' gradients shard by "
                          "shard, which only DeepSpeed's engine waits for when several processes train; use "
                          "DeepSpeed, or set tiled_mlp = false")
    mlps, experts, layers = layer_mlps(model)
    name = type(model.get_base_model() if hasattr(model, "get_base_model") else model).__name__
    if not mlps:
        what = f"their feed-forward blocks are mixtures of experts ({experts[0]})" if experts else \
            "none holds a dense MLP (an mlp with linear projections)"
        raise FtcoreError(f"{where}tiled_mlp: {name} has {layers} decoder layers and {what}, so there is no MLP "
                          "to tile; set tiled_mlp = false")
    if (p := max(_dropout(m) for m in mlps)) > 0:
        raise FtcoreError(f"{where}tiled_mlp: the MLPs hold dropout (p = {p:g}, e.g. the adapter's lora_dropout), "
                          "and a tiled MLP's backward runs its forward again, with other dropout masks than the "
                          "loss saw; set lora_dropout = 0, or tiled_mlp = false")
    saved = [(m, m.__dict__.get("forward")) for m in mlps]
    for module, previous in saved:
        module.forward = types.MethodType(_tiled_forward(previous, seen), module)
    seen["layers"] = len(mlps)
    if reporter is not None:
        skipped = f"; {len(experts)} mixtures of experts ({experts[0]}) run whole" if experts else ""
        reporter.info(f"{where}tiled_mlp: {len(mlps)} MLPs ({type(mlps[0]).__name__}) of {layers} decoder layers "
                      f"tiled: each trains in {RULE} (hidden_size {_width(model)}), recomputed shard by shard in "
                      f"backward{skipped}")
    try:
        yield seen
    finally:
        for module, previous in saved:
            if previous is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = previous


def _width(model: Any) -> Any:
    config = getattr(model, "config", None)
    config = getattr(config, "get_text_config", lambda: config)() if config is not None else None
    return getattr(config, "hidden_size", "?")
