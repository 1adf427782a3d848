"""The language-model loss of ``sft`` and ``pretrain`` (and trainers built on them).

``loss_kernel`` picks how it is computed (``auto``, the default: the device's first that runs, from
``plugins/common/device_defaults.py``: ``liger`` then ``chunked`` on a GPU, ``chunked`` on a CPU):

- ``chunked``: cross-entropy on the trained tokens only, 16M logits at a time
  (about 110 rows of a 150k vocabulary). Each chunk's gradient is computed in the forward pass,
  while its logits are at hand, so the backward pass only scales it: the same matrix products as
  the plain loss, and no more than one chunk's logits ever exist. Plain torch, so it runs wherever the
  model does; no host sync inside the loop. The chunk's size is the device's (16M logits on a CPU, 64M
  on a GPU, where fewer rows leave the head's products bound by reading its weight).
- ``liger``: Liger's fused linear cross-entropy (Triton, CUDA), on the same trained positions.
- ``full``: the whole sequence's logits, then cross-entropy (what transformers does); the
  reference the others are checked against.
- ``trl``: TRL's fused LM head as ``trl.SFTTrainer`` ships it (tiled, recomputed in backward, with
  entropy and top-1 for every position).

``liger = true`` (CUDA only) adds Liger's kernels for the layers (RMSNorm, RoPE, SwiGLU, through
TRL's ``use_liger_kernel``) and makes the ``chunked`` loss Liger's fused linear cross-entropy.

Token accuracy is logged with each of them; entropy costs a pass over the logits, so it is logged
only with ``log_entropy = true``.
"""

from __future__ import annotations

import functools
from typing import Any, Literal

from pydantic import Field

from ftcore.component import Options

from ftcore_plugins.common.memory import gpu_visible

LossKernel = Literal["auto", "chunked", "liger", "full", "trl"]

# Logit elements per chunk (fp32) on a CPU: 16M is 64 MiB, ~110 tokens of a 150k vocabulary, and a few
# temporaries of that size live at once. Large enough that the products stay efficient. A GPU's is
# device_defaults.CUDA.loss_chunk_elements.
CHUNK_ELEMENTS = 1 << 24


class LossOptions(Options):
    """The options of the trainers whose loss is next-token cross-entropy."""

    loss_kernel: LossKernel = "auto"  # how the loss is computed; auto: the device's fastest (docs/trainers.md)
    log_entropy: bool = False  # also log the mean entropy of the predictions (one more pass over the logits)
    liger: bool = False  # Liger's Triton kernels: the layers, and the loss (fused linear cross-entropy); CUDA only
    neftune_noise_alpha: float | None = Field(None, gt=0, le=1000)  # NEFTune: noise on the embeddings in training


def loss_problems(o: LossOptions) -> list[str]:
    """``ftcore validate`` problems of the loss options on this machine."""
    import importlib.util

    key = "liger" if o.liger else "loss_kernel" if o.loss_kernel == "liger" else None
    if key is None:
        return []
    if not gpu_visible():
        return [f"{key}: Liger's kernels are Triton kernels for CUDA GPUs, and none is visible here; "
                f"remove {key} = {'true' if o.liger else chr(34) + 'liger' + chr(34)} (the default chunked loss "
                "already keeps the logits small)"]
    if importlib.util.find_spec("liger_kernel") is None:
        return [f"{key}: the liger-kernel package is not installed (pip install 'ftcore[liger]')"]
    from ftcore_plugins.common.device_defaults import triton_problem

    problem = triton_problem()
    return [f"{key}: Liger's kernels are Triton kernels: {problem}"] if problem else []


def chunked_cross_entropy(hidden: Any, weight: Any, bias: Any, targets: Any, *, softcap: float | None = None,
                          scale: float = 1.0, entropy: bool = False,
                          chunk_elements: int = CHUNK_ELEMENTS) -> tuple[Any, Any, Any]:
    """The summed negative log-likelihood of ``targets`` under ``hidden @ weight.T (+ bias)``, the number
    of targets that are the argmax, and the summed entropy (None unless ``entropy``), without ever
    holding more than ``chunk_elements`` logits. ``hidden`` is (N, H), ``targets`` (N,) with no
    ignored positions. Logits are ``softcap * tanh(scale * z / softcap)`` when ``softcap`` is set
    (Gemma 2/3), else ``scale * z``. Differentiable in ``hidden``, ``weight`` and ``bias``."""
    import torch

    grads = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))
    chunk = max(1, chunk_elements // weight.shape[0])
    return _nll_function().apply(hidden, weight, bias, targets, chunk, softcap, scale, grads, entropy)


@functools.cache
def _nll_function() -> Any:
    import torch

    class ChunkedNLL(torch.autograd.Function):
        @staticmethod
        def forward(ctx, hidden, weight, bias, targets, chunk, softcap, scale, grads, entropy):
            device = hidden.device
            acc = torch.promote_types(hidden.dtype, torch.float32)  # fp32 at least, whatever the model's dtype
            nll = torch.zeros((), device=device, dtype=acc)
            correct = torch.zeros((), device=device, dtype=torch.long)
            entropy_sum = torch.zeros((), device=device, dtype=acc) if entropy else None
            need_h, need_w, need_b = (grads and flag for flag in ctx.needs_input_grad[:3])
            # The head's products in the precision the model computes in (autocast's, else the weight's):
            # torch runs the forward product so under autocast, but an in-place product into an fp32
            # gradient would be a GEMM at fp32 speed (autocast leaves in-place operations alone).
            low = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else weight.dtype
            w = weight.to(low)  # cast once, not once a chunk (autocast would, for a weight that is not trained)
            grad_h = torch.empty(hidden.shape, device=device, dtype=acc) if need_h else None
            grad_w = torch.zeros(weight.shape, device=weight.device, dtype=acc) if need_w else None
            grad_b = torch.zeros(bias.shape, device=bias.device, dtype=acc) if need_b else None
            for start in range(0, hidden.shape[0], chunk):
                h, t = hidden[start:start + chunk], targets[start:start + chunk]
                z = torch.mm(h.to(low), w.t())
                if bias is not None:
                    z = z + bias
                z = z.to(acc)
                if scale != 1.0:
                    z.mul_(scale)
                tanh = None
                if softcap:
                    tanh = torch.tanh(z / softcap)
                    z = tanh * softcap
                rows = torch.arange(t.shape[0], device=device)
                target = z[rows, t]
                top, best = z.max(-1)
                correct += (best == t).sum()
                # In place, to hold one chunk of logits: z - max, then its exp, then p (softmax).
                d = z.sub_(top.unsqueeze(-1))
                e = d.exp() if entropy_sum is not None else d.exp_()
                total = e.sum(-1)
                nll += (top + total.log() - target).sum()
                if entropy_sum is not None:  # H = log(sum e) - sum(e * d) / sum(e)
                    entropy_sum += (total.log() - (e * d).sum(-1) / total).sum()
                    del d, z
                if grad_h is None and grad_w is None and grad_b is None:
                    continue
                # the gradient of -log p_t is p - onehot(t)
                p = e.div_(total.unsqueeze(-1))
                p[rows, t] -= 1.0
                if tanh is not None:
                    p.mul_(1.0 - tanh * tanh)
                if scale != 1.0:
                    p.mul_(scale)
                g = p.to(low)
                if grad_h is not None:
                    grad_h[start:start + chunk] = torch.mm(g, w).to(acc)
                if grad_w is not None:
                    _add_product(grad_w, g.t(), h.to(low))
                if grad_b is not None:
                    grad_b += p.sum(0)
            ctx.grads = (grad_h, grad_w, grad_b)
            ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
            ctx.mark_non_differentiable(*(x for x in (correct, entropy_sum) if x is not None))
            return nll, correct, entropy_sum

        @staticmethod
        def backward(ctx, grad_nll, *_):
            out = [None if g is None else (g * grad_nll).to(dtype) for g, dtype in zip(ctx.grads, ctx.dtypes)]
            ctx.grads = None
            return (*out, None, None, None, None, None, None)

    return ChunkedNLL


def _add_product(acc: Any, a: Any, b: Any) -> None:
    """``acc += a @ b``, ``acc`` in fp32. Operands in fp32 are one in-place product. Lower-precision ones
    (bf16, fp16) keep their speed: on a GPU, one product with fp32 output into ``acc`` (torch's
    ``out_dtype``, CUDA only); elsewhere, or where that is refused, the product in its own precision
    (accumulated in fp32 inside the kernel), then added to ``acc``."""
    import torch

    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
        return
    if a.is_cuda and _FP32_OUT.get("cuda", True):
        try:
            torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
            return
        except (RuntimeError, TypeError):  # a torch without it for this device or these dtypes
            _FP32_OUT["cuda"] = False
    acc.add_(torch.mm(a, b))


_FP32_OUT: dict[str, bool] = {}  # whether torch.addmm takes out_dtype=fp32 on a device type (tried once)


def logit_transform(config: Any) -> tuple[float | None, float] | None:
    """The final-logit softcap and scale a model applies after its LM head, or None for a transform
    this loss does not reproduce (those models use ``full``)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if any(getattr(text, key, None) is not None for key in ("logits_scaling", "lm_head_multiplier",
                                                             "output_multiplier")):
        return None
    scale = getattr(text, "logit_scale", None)
    return getattr(text, "final_logit_softcapping", None), 1.0 if scale is None else float(scale)


def resolve_kernel(kernel: str, model: Any, *, device: str, sharded: bool = False, liger: bool = False,
                   aux_loss: bool = False) -> str:
    """The loss kernel a stage runs. ``auto``: the first of ``device``'s defaults (the device the stage
    trains on, ``device_defaults.training_device``) that runs here: ``liger`` where liger-kernel is
    installed on a GPU, else ``chunked``.
    ``chunked`` (and ``liger``) where it reproduces the model's loss exactly (``chunked`` becomes
    ``liger`` with ``liger``, where no logit scale is needed); else ``trl`` for an LM head that FSDP or
    ZeRO-3 shards (``sharded``: TRL's kernel gathers it), and ``full`` for a mixture of experts'
    auxiliary loss (``aux_loss``: the stage's ``router_aux_loss_coef``; its model's forward computes it) or a
    logit transform this loss does not know. ``model`` may be PEFT-wrapped."""
    from ftcore_plugins.common.device_defaults import loss_kernel_for

    if kernel == "auto":
        kernel = loss_kernel_for(device)
    if kernel not in ("chunked", "liger"):
        return kernel
    if sharded:
        return "trl"
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    config = getattr(base, "config", None)
    transform = logit_transform(config) if config is not None else None
    if head is None or transform is None:
        return "full"
    if aux_loss:
        return "full"
    if not hasattr(base, getattr(base, "base_model_prefix", "") or "\0"):
        return "full"
    if (kernel == "liger" or liger) and transform[1] == 1.0:
        return "liger"
    return "chunked"


def add_chunked_head(model: Any, *, entropy: bool, liger: bool = False, chunk: int | None = None) -> None:
    """Patch the transformers model under ``model`` (PEFT's base model) so that
    ``model(..., labels=labels, chunked_loss=True)`` returns a ``ChunkedLoss`` (the summed loss
    of the shifted labels, the trained tokens, the correct ones, the entropy) instead of logits:
    from :func:`chunked_cross_entropy`, or with ``liger`` from Liger's fused linear cross-entropy
    (which gives no entropy). ``chunk``: logits per chunk (default: that of the device this process
    trains on).
    Without ``chunked_loss`` the forward is the original one: generation is unchanged.
    ``strip_forward_patches`` removes the patch, as it removes TRL's."""
    import types

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    original = base.forward
    softcap, scale = logit_transform(base.config)
    output = _output_class()
    prefix = base.base_model_prefix
    if not chunk:
        from ftcore_plugins.common.device_defaults import defaults, training_device

        chunk = defaults(training_device()).loss_chunk_elements
    if liger:
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

        fused = LigerFusedLinearCrossEntropyLoss(reduction="sum", softcap=softcap, return_token_accuracy=True)

    @functools.wraps(type(base).forward)  # generate() checks its kwargs against the signature
    def forward(self, *args, chunked_loss=False, labels=None, shift_labels=None, **kwargs):
        if not chunked_loss:
            if labels is not None:
                kwargs["labels"] = labels
            if shift_labels is not None:
                kwargs["shift_labels"] = shift_labels
            return original(*args, **kwargs)
        kwargs["use_cache"] = False
        hidden = getattr(self, prefix)(*args, **kwargs).last_hidden_state
        head = self.get_output_embeddings()
        # Sequence parallelism hands each process a slice of the row with its labels already shifted
        # (``shift_labels``): every position of the slice predicts one of them.
        if shift_labels is None:
            targets, hidden = labels[:, 1:].to(head.weight.device), hidden[:, :-1]
        else:
            targets = shift_labels.to(head.weight.device)
        mask = targets != -100
        # Only the trained positions are projected: prompts and padding cost no logits. Their indices are
        # found once (a host sync: the count decides the shapes); indexing by them needs none, nor does
        # its backward.
        where = mask.flatten().nonzero().squeeze(1)
        trained = hidden.to(head.weight.device).flatten(0, 1).index_select(0, where)
        wanted = targets.flatten().index_select(0, where)
        if liger and wanted.numel():  # no trained position: Liger divides by their count, the chunked loss gives 0
            out = fused(head.weight, trained, wanted, head.bias)
            nll, correct, entropy_sum = out.loss, (out.token_accuracy * wanted.numel()).round().long(), None
        else:
            nll, correct, entropy_sum = chunked_cross_entropy(trained, head.weight, head.bias, wanted,
                                                              softcap=softcap, scale=scale, entropy=entropy,
                                                              chunk_elements=chunk)
        return output(loss=nll, tokens=mask.sum(), correct=correct, entropy=entropy_sum)

    base.forward = types.MethodType(forward, base)


@functools.cache
def _output_class() -> type:
    """:class:`ChunkedLoss`, a ``ModelOutput`` (so DDP and accelerate can walk it), made on first use:
    importing this module must not import torch."""
    from dataclasses import dataclass

    import torch
    from transformers.utils import ModelOutput

    @dataclass
    class ChunkedLoss(ModelOutput):
        loss: torch.Tensor | None = None  # summed over the trained tokens
        tokens: torch.Tensor | None = None
        correct: torch.Tensor | None = None
        entropy: torch.Tensor | None = None  # summed; None unless asked for

    return ChunkedLoss


def across_ranks(trainer: Any, loss: Any, num_items_in_batch: Any) -> Any:
    """As TRL's loss: ``num_items_in_batch`` counts every rank's tokens, and DDP averages the
    gradients over ranks, so a loss divided by it is scaled back up by the number of ranks that average:
    the data-parallel ones (ranks that share a row under sequence parallelism add their gradients up)."""
    if trainer.args.average_tokens_across_devices and num_items_in_batch is not None:
        return loss * (trainer.accelerator.num_processes // trainer.get_tp_size() // trainer.get_sp_size())
    return loss


def sharded_head(run: Any) -> bool:
    """Whether the run's engine shards the LM head across processes (FSDP, ZeRO-3)."""
    d = getattr(getattr(run, "plan", None), "distributed", None)
    if d is None or getattr(run, "world_size", 1) == 1:
        return False
    return d.engine == "fsdp" or (d.engine == "deepspeed" and d.zero_stage == 3)


def record_token_metrics(trainer: Any, mode: str, inputs: dict[str, Any], tokens: Any, correct: Any,
                         entropy_sum: Any | None, aux_loss: Any | None = None) -> None:
    """The metrics TRL's ``SFTTrainer.compute_loss`` records, from a step's counts: token accuracy,
    entropy (when computed), the router's auxiliary loss (when added: ``aux_loss``, unweighted, as TRL
    logs it) and the real tokens seen (the stage's ``train_tokens``)."""
    import torch

    gather = trainer.accelerator.gather_for_metrics
    n = gather(tokens.detach()).sum().clamp(min=1)  # no trained token: accuracy and entropy 0, as TRL logs
    values = [gather(correct.detach()).sum() / n]
    if entropy_sum is not None:
        values.append(gather(entropy_sum.detach()).sum() / n)
    if aux_loss is not None:
        values.append(gather(aux_loss.detach().float().reshape(1).to(n.device)).mean())
    seen = None
    if mode == "train":
        if "attention_mask" in inputs:
            values.append(gather(inputs["attention_mask"].sum()).sum())
        else:  # padding-free packing: one row of position ids, its length known on the host
            ids = inputs["position_ids"]
            seen = ids.size(1) if trainer.accelerator.num_processes == 1 else \
                gather(torch.tensor(ids.size(1), device=ids.device)).sum()
            if not isinstance(seen, int):
                values.append(seen)
                seen = None
    # One host sync for every number of the step, not one each.
    host = torch.stack([v.double() for v in values]).tolist()
    trainer._metrics[mode]["mean_token_accuracy"].append(host[0])
    if entropy_sum is not None:
        trainer._metrics[mode]["entropy"].append(host[1])
    if aux_loss is not None:
        trainer._metrics[mode]["aux_loss"].append(host[1 + (entropy_sum is not None)])
    if mode == "train":
        seen = int(host[-1]) if seen is None else seen
        trainer._total_train_tokens += seen // trainer._tp_size
    trainer._metrics[mode]["num_tokens"] = [trainer._total_train_tokens]


def with_chunked_loss(trainer_cls: type, *, entropy: bool, liger: bool = False, chunk: int | None = None) -> type:
    """A subclass of the TRL ``SFTTrainer`` class ``trainer_cls`` whose loss is
    :func:`chunked_cross_entropy` (or Liger's, with ``liger``) through :func:`add_chunked_head`."""
    import torch

    from ftcore_plugins.trainers import _sequence_parallel as sequence_parallel

    class ChunkedLossTrainer(trainer_cls):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            add_chunked_head(self.model, entropy=entropy, liger=liger, chunk=chunk)

        def _get_num_items_in_batch(self, batch_samples, device):
            if sequence_parallel.enabled(self):
                return sequence_parallel.trained_tokens(self, batch_samples, device)
            return super()._get_num_items_in_batch(batch_samples, device)

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            mode = "train" if self.model.training else "eval"
            if sequence_parallel.enabled(self) and self.model.training:
                inputs = sequence_parallel.contiguous(inputs)
            out = model(**inputs, use_cache=False, chunked_loss=True)
            items = out.tokens.clamp(min=1) if num_items_in_batch is None else num_items_in_batch
            loss = out.loss / items
            loss = across_ranks(self, loss, num_items_in_batch)
            if sequence_parallel.enabled(self) and self.model.training:
                loss = sequence_parallel.whole_row_loss(loss)
            record_token_metrics(self, mode, inputs, out.tokens, out.correct, out.entropy)
            if return_outputs:  # logits asked for (compute_metrics): one more forward pass, as TRL does
                with torch.no_grad():
                    out = model(**{k: v for k, v in inputs.items() if k != "labels"})
                return loss, out
            return loss

    ChunkedLossTrainer.__name__ = ChunkedLossTrainer.__qualname__ = f"{trainer_cls.__name__}ChunkedLoss"
    return ChunkedLossTrainer


def full_cross_entropy(outputs: Any, labels: Any, num_items_in_batch: Any = None) -> Any:
    """The plain loss from the whole sequence's logits (``loss_kernel = "full"``): the mean over the
    trained tokens, or their sum over ``num_items_in_batch`` (all micro-batches' trained tokens)."""
    import torch

    logits = outputs.logits[:, -labels.size(1):-1].float()  # past the virtual tokens prompt tuning prepends
    targets = labels[:, 1:].to(logits.device)
    total = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1),
                                              ignore_index=-100, reduction="sum")
    items = (targets != -100).sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
    return total / items
