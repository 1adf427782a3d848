"""``ftcore estimate``: each stage's peak memory, predicted without loading any weights.

The model is built on PyTorch's ``meta`` device (shapes and dtypes, no storage), the stage's
adapter is applied to it, and the total is the sum of

- **weights**: the base model as the quantizer stores it, plus what the adapter adds;
- **gradients**: one per trainable parameter, in its dtype;
- **optimizer**: the optimizer's state for the trainable parameters, plus its step's
  temporaries where they exceed the activations (the step runs once those are freed);
- **activations**: what one training step keeps for backward, at the stage's batch size and
  sequence length, with or without gradient checkpointing;
- **overhead**: the process and framework. On CPU, the memory of this very process once it
  has imported what the run imports (``ftcore estimate`` runs in the same kind of process as
  ``ftcore run``), plus what the trainer says a run adds beyond that, plus checkpoint pages the
  model loader says stay mapped; on CUDA, what the trainer says the CUDA context and
  allocator take.

On CPU the total predicts the run's peak RSS (``summary.json`` ``memory`` ->
``"<stage>: trained"`` ``peak_rss_mib``); on CUDA, the GPU memory in use.

Components answer through **optional** methods; each has a fallback here, and every number
says where it came from (``sources``) and what the estimate does not model (``notes``):

=============  ================================================  ==================================
component      optional method                                   fallback
=============  ================================================  ==================================
model loader   ``meta_model() -> (model, config)``               ``options.path`` holding a
                                                                 ``config.json``: transformers'
                                                                 ``from_config`` on ``meta``
model loader   ``checkpoint_residue_bytes(quantized) -> int``    0
quantizer      ``prepare_meta(model, *, device) -> model``       the model unchanged; checkpointing
                                                                 from an option named
                                                                 ``gradient_checkpointing``
quantizer      ``weight_bytes(model) -> int``                    ``load_kwargs()``'s
                                                                 ``quantization_config`` sized by
                                                                 transformers, else numel x dtype
quantizer      ``step_bytes(model, *, device, tokens) -> int``   0: what a training step needs for
                                                                 the quantized weights, beyond the
                                                                 activations
quantizer      ``weight_notes(model) -> list[str]``              none: what its weights count that a
                                                                 reader may not expect
adapter        ``apply_meta(model, ctx)``, else ``apply``        every parameter trainable (an
                                                                 upper bound, with a note)
trainer        ``memory_settings(*, device) -> dict``            options named ``batch_size``,
                                                                 ``max_length``, ...
trainer        ``activation_bytes(config, batch_size, seq_len,   a generic decoder formula
               checkpointing, *, model, device, precision)``
trainer        ``optimizer_bytes(params, *, device)`` ->         Adam: two fp32 values per
               ``(state, step temporaries)`` or an int           parameter
trainer        ``runtime_bytes(*, device) -> int``               nothing beyond this process
=============  ================================================  ==================================

Keyword arguments a component's method does not declare are not passed. Nothing here imports
torch (or the built-in plugins) at module import.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import logging
import os
import re
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import ftcore
from ftcore.command import Command
from ftcore.errors import FtcoreError

MiB = 2**20
GiB = 2**30
# The GPU types --gpu knows (their rates: plugins/commands/_compute.py); listed here so that
# `ftcore estimate --help` needs no import beyond the standard library.
GPUS = ("b200", "h200", "h100-sxm", "h100-pcie", "mi300x", "a100", "l40s", "a10", "l4", "rtx4090", "rtx3090")
TERMS = ("weights", "gradients", "optimizer", "activations", "overhead")
DEFAULTS = {"batch_size": 8, "seq_len": 512, "gradient_checkpointing": False, "optimizer": "adamw_torch",
            "precision": "auto"}
_CPU_FALLBACK_PROCESS = 600 * MiB  # when /proc cannot be read
_CUDA_FALLBACK_RUNTIME = 768 * MiB


@dataclass
class Settings:
    batch_size: int
    seq_len: int
    gradient_checkpointing: bool
    optimizer: str
    precision: str  # resolved for the device: fp32, bf16 or fp16


@dataclass
class Parallel:
    """The plan's ``[distributed]`` axes as one rank sees them (``plugins/common/launch.py``'s ``Distributed``)."""

    processes: int
    engine: str  # ddp, deepspeed, fsdp
    sp: int = 1  # DeepSpeed's Ulysses: a slice of each row's columns per rank
    cp: int = 1  # torch's context parallelism (FSDP2): the same split of the row
    tp: int = 1  # transformers' tp_plan: the sharded projections' weights and widths
    zero_stage: int = 2
    fsdp_sharding: str = "full_shard"
    offload_optimizer: bool = False

    @property
    def data_parallel(self) -> int:
        return max(1, self.processes // (self.sp * self.cp * self.tp))

    @property
    def row_split(self) -> int:
        return self.sp * self.cp

    @property
    def shards(self) -> int:
        """Ranks the engine partitions parameters, gradients and optimizer state over: DeepSpeed's ZeRO over its
        ``seq_data_parallel`` group (every rank but the tensor-parallel axis: data parallel x sp), FSDP2 over
        its data-parallel-shard x cp mesh."""
        return max(1, self.processes // self.tp)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "data_parallel": self.data_parallel, "shards": self.shards}


@dataclass
class StageEstimate:
    stage: str
    trainer: str
    adapter: str
    settings: Settings
    total_params: int
    trainable_params: int
    weights: int
    gradients: int
    optimizer: int
    activations: int
    overhead: int = 0
    sources: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    residue: int = 0  # checkpoint pages the loader leaves resident (host memory; part of overhead on CPU)
    compute_params: int = 0  # the weights a token multiplies: all but the input embedding (a tied head once)
    moe: dict[str, int] | None = None  # a mixture of experts' total and active parameters (common/estimate.py)
    axes: list[str] = field(default_factory=list)  # the [distributed] axes applied, each as it was counted

    @property
    def total(self) -> int:
        return sum(getattr(self, t) for t in TERMS)


@dataclass
class Estimate:
    plan: str
    model: str
    quantizer: str
    device: str
    stages: list[StageEstimate]
    budget: int | None = None
    notes: list[str] = field(default_factory=list)
    parallel: Parallel | None = None  # per rank under [distributed]; None: one process

    @property
    def peak(self) -> int:
        return max((s.total for s in self.stages), default=0)

    def fits(self, stage: StageEstimate | None = None) -> bool | None:
        if self.budget is None:
            return None
        return (stage.total if stage else self.peak) <= self.budget

    def to_json(self) -> dict[str, Any]:
        stages = []
        for s in self.stages:
            terms = {t: getattr(s, t) for t in TERMS}
            stages.append({
                "stage": s.stage, "trainer": s.trainer, "adapter": s.adapter, **asdict(s.settings),
                "params": {"total": s.total_params, "trainable": s.trainable_params,
                           **({"model": s.moe["total"], "active": s.moe["active"], "experts_per_token":
                               s.moe["per_token"], "experts": s.moe["experts"]} if s.moe else {})},
                "bytes": {**terms, "total": s.total},
                "mib": {k: round(v / MiB, 1) for k, v in {**terms, "total": s.total}.items()},
                "fits": self.fits(s), "sources": s.sources, "notes": s.notes, "axes": s.axes,
            })
        return {"plan": self.plan, "model": self.model, "quantizer": self.quantizer, "device": self.device,
                "per": "rank" if self.parallel else "process",
                "parallel": self.parallel.to_json() if self.parallel else None,
                "budget_bytes": self.budget, "peak_bytes": self.peak, "peak_mib": round(self.peak / MiB, 1),
                "fits": self.fits(), "stages": stages, "notes": self.notes}


# -- sizes ------------------------------------------------------------------------------------
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.I)


def parse_size(text: str) -> int:
    """``16GB``, ``16 GiB``, ``16g``, ``800MB``, ``1.5T`` -> bytes. Binary units whatever the
    spelling, as GPU memory is quoted (a "16GB" card has 16 GiB); a bare number is GB."""
    m = _SIZE.match(str(text))
    if not m:
        raise ValueError(f"not a memory size: {text!r} (e.g. 16GB, 800MB)")
    unit = (m.group(2) or "g").lower()
    return int(float(m.group(1)) * {"k": 2**10, "m": MiB, "g": GiB, "t": 2**40}[unit])


def human(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if abs(n) >= GiB else f"{n / MiB:.0f} MiB"


# -- calling components -----------------------------------------------------------------------
def _optional(component: Any, method: str) -> Callable | None:
    fn = getattr(component, method, None)
    return fn if callable(fn) else None


def _call(fn: Callable, *args: Any, **kwargs: Any) -> Any:
    """Call ``fn`` with the keyword arguments its signature takes (third-party methods may
    take fewer than the core offers)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return fn(*args, **kwargs)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return fn(*args, **kwargs)
    return fn(*args, **{k: v for k, v in kwargs.items() if k in params})


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Library warnings and component log lines are not the estimate's output."""
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(previous)


# -- the estimate -----------------------------------------------------------------------------
def resolve_device(device: str) -> str:
    if device in ("cpu", "cuda"):
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def estimate_plan(plan: Any, *, device: str = "auto", budget: int | None = None) -> Estimate:
    """Estimate every stage of a loaded plan (:func:`ftcore.plan.load_plan`)."""
    from ftcore.runner import calling

    device = resolve_device(device)
    loader = plan.model.create()
    quantizer = plan.quantizer.create()
    parallel = parallel_axes(plan)
    result = Estimate(str(plan.path), plan.model.name, plan.quantizer.name, device, [], budget, parallel=parallel)

    with _quiet():
        for stage in plan.stages:
            result.stages.append(_stage(plan, stage, loader, quantizer, device, calling, parallel))
        runtime: list[tuple[int, str]] = []
        for stage in plan.stages:
            trainer = stage.trainer.create()
            fn = _optional(trainer, "runtime_bytes")
            if fn is not None:
                with calling(stage.trainer, "runtime_bytes"):
                    runtime.append((int(_call(fn, device=device)), f"trainer '{stage.trainer.name}'"))
            else:
                runtime.append((0 if device == "cpu" else _CUDA_FALLBACK_RUNTIME, "fallback"))
    # Measured after the components have imported what they run with.
    process = _process_bytes() if device == "cpu" else 0
    for s, (extra, source) in zip(result.stages, runtime):
        if device == "cpu":
            s.overhead = (process or _CPU_FALLBACK_PROCESS) + extra + s.residue
            s.sources["overhead"] = ("this process's RSS" if process else "fallback (no /proc)") + (
                f" + {human(extra)} training runtime ({source})" if extra else "") + (
                f" + {human(s.residue)} checkpoint pages the model loader leaves mapped" if s.residue else "")
            if source == "fallback":
                s.notes.append(f"trainer '{s.trainer}' has no runtime_bytes(): the overhead is only this process's "
                               "memory, without what the training loop adds")
        else:
            s.overhead = extra
            s.sources["overhead"] = f"CUDA context and allocator reserve ({source})"
        if s.activations > 0.4 * s.total and device == "cpu":
            s.notes.append(f"activations are {100 * s.activations / s.total:.0f}% of the total: on CPU, how much "
                           "of the memory freed during a step glibc's malloc keeps in its heap depends on tensor "
                           "sizes and order, and only the trainer's known cases are modeled; gradient "
                           "checkpointing keeps activations small")
    if len(plan.stages) > 1:
        result.notes.append("stages run in one process: memory a stage leaves allocated (the allocator's "
                            "retained blocks) is counted in the next stage's measured peak, not here")
    data = _data_bytes(plan)
    if data > 0.05 * max(result.peak, 1):
        result.notes.append(f"the plan reads {human(data)} of data files; memory-mapped Arrow pages count toward "
                            "RSS as they are read (not modeled)")
    if device == "cuda":
        result.notes.append("CUDA figures follow the same accounting with CUDA kernels' dtypes; they were not "
                            "compared with a measured run here")
    return result


def parallel_axes(plan: Any) -> Parallel | None:
    """The plan's ``[distributed]`` table as one rank sees it, or None for one process (the table absent, one
    process, or an accelerate config, which decides the engine and the axes itself)."""
    d = getattr(plan, "distributed", None)
    if d is None or d.processes < 2 or d.accelerate_config is not None:
        return None
    return Parallel(d.processes, d.engine, d.sp_size, d.cp_size, d.tp_size, d.zero_stage, d.fsdp_sharding,
                    d.offload_optimizer)


def _stage(plan: Any, stage: Any, loader: Any, quantizer: Any, device: str, calling: Callable,
           parallel: Parallel | None = None) -> StageEstimate:
    sources: dict[str, str] = {}
    notes: list[str] = []
    trainer = stage.trainer.create()
    settings = _settings(stage, trainer, device, calling, sources, notes)

    model, config = _meta_model(plan, loader, calling, sources)
    from ftcore_plugins.common.estimate import moe_parameters

    moe = moe_parameters(model, config)
    compute_params = _compute_params(model, moe)
    notes += _vision_notes(model)
    prepare = _optional(quantizer, "prepare_meta")
    if prepare is not None:
        with calling(plan.quantizer, "prepare_meta"):
            model = _call(prepare, model, device=device)
    weights = _weight_bytes(plan, quantizer, model, loader, calling, sources, notes)
    fn = _optional(quantizer, "weight_notes")
    if fn is not None:
        with calling(plan.quantizer, "weight_notes"):
            notes += [str(n) for n in fn(model) or []]
    step = 0
    fn = _optional(quantizer, "step_bytes")
    if fn is not None:
        with calling(plan.quantizer, "step_bytes"):
            step = int(_call(fn, model, device=device, tokens=settings.batch_size * settings.seq_len))
    before = _param_bytes(model)
    residue = 0
    fn = _optional(loader, "checkpoint_residue_bytes")
    if fn is not None:
        with calling(plan.model, "checkpoint_residue_bytes"):
            residue = int(fn(weights < 0.9 * before))
    total_before = sum(p.numel() for p in model.parameters())

    adapter = stage.adapter.create()
    try:
        from ftcore.context import AdapterContext, RunInfo
        from ftcore.reporter import Reporter

        ctx = AdapterContext(RunInfo(plan, plan.run_dir), Reporter(None, None, None, None), quantizer)
        how = "apply_meta" if _optional(adapter, "apply_meta") else "apply"
        model = getattr(adapter, how)(model, ctx)
        sources["trainable"] = f"adapter '{stage.adapter.name}' {how}() on the meta model"
    except FtcoreError:
        raise
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [""])[0]
        notes.append(f"adapter '{stage.adapter.name}' could not be applied to the meta model "
                     f"({type(exc).__name__}: {first}); counted as training every parameter, an upper bound")
        sources["trainable"] = "fallback: every parameter"
        for p in model.parameters():
            p.requires_grad_(True)
    added = _param_bytes(model) - before
    weights += max(added, 0)
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    checkpointing = settings.gradient_checkpointing or _checkpointing_on(model)
    if not settings.gradient_checkpointing and checkpointing:
        notes.append(f"gradient checkpointing is on: quantizer '{plan.quantizer.name}' turns it on")
    elif not settings.gradient_checkpointing and prepare is None and \
            getattr(getattr(quantizer, "options", None), "gradient_checkpointing", False):
        checkpointing = True
        notes.append(f"gradient checkpointing is on: quantizer '{plan.quantizer.name}' option")
    settings.gradient_checkpointing = checkpointing

    gradients = sum(p.numel() * p.element_size() for p in trainable)
    fn = _optional(trainer, "optimizer_bytes")
    if fn is not None:
        with calling(stage.trainer, "optimizer_bytes"):
            out = _call(fn, trainable, device=device)
        state, temporaries = (int(out[0]), int(out[1])) if isinstance(out, (tuple, list)) else (int(out), 0)
        sources["optimizer"] = f"trainer '{stage.trainer.name}' ({settings.optimizer})"
    else:
        state, temporaries = 8 * sum(p.numel() for p in trainable), 0
        sources["optimizer"] = "fallback: Adam, two fp32 values per trainable parameter"

    row_split, tp = (parallel.row_split, parallel.tp) if parallel is not None else (1, 1)
    fn = _optional(trainer, "activation_bytes")
    if fn is not None:
        declared = _declares(fn, "row_split")
        with calling(stage.trainer, "activation_bytes"):
            activations = int(_call(fn, config, settings.batch_size,
                                    settings.seq_len if declared else -(-settings.seq_len // row_split),
                                    checkpointing, model=model, device=device, precision=settings.precision,
                                    row_split=row_split, tp_size=tp))
        sources["activations"] = f"trainer '{stage.trainer.name}'"
        if (row_split > 1 and not declared) or (tp > 1 and not _declares(fn, "tp_size")):
            notes.append(f"trainer '{stage.trainer.name}' activation_bytes() takes no row_split/tp_size: counted "
                         "at the rank's slice of the row, every layer at full width")
    else:
        activations = generic_activation_bytes(config, settings.batch_size, -(-settings.seq_len // row_split),
                                               checkpointing, settings.precision)
        sources["activations"] = "fallback: generic decoder formula"
        if not activations:
            notes.append("activations not modeled: the model config has no hidden_size/num_hidden_layers")
    if step:
        activations += step
        sources["activations"] += f" + quantizer '{plan.quantizer.name}' step_bytes() {human(step)}"
    axes: list[str] = []
    if parallel is not None:
        weights, gradients, state, temporaries = _shard(parallel, model, config, trainable, weights, gradients,
                                                        state, temporaries, device, settings, axes, sources)
    # The optimizer step's temporaries and the activations never coexist: count the larger.
    optimizer = state + max(0, temporaries - activations)
    if temporaries > activations:
        sources["optimizer"] += (f": state {human(state)} + step temporaries {human(temporaries)} beyond the "
                                 "activations (the step runs after they are freed)")
    return StageEstimate(stage.name, stage.trainer.name, _adapter_label(stage.adapter), settings,
                         sum(p.numel() for p in params) if params else total_before,
                         sum(p.numel() for p in trainable), weights, gradients, optimizer, activations,
                         sources=sources, notes=notes, residue=residue, compute_params=compute_params, moe=moe,
                         axes=axes)


def _declares(fn: Callable, name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


# DeepSpeed's default reduce_bucket_size (elements), which ftcore's config leaves as it is: ZeRO copies the
# gradients into a bucket this large (allocated whole on CUDA; on CPU only the pages written count).
_ZERO_BUCKET = 500_000_000


def _tp_sharded(model: Any, config: Any) -> set[int]:
    """Ids of the parameters transformers' tensor-parallel plan shards (the config's ``base_model_tp_plan``:
    ``layers.*.self_attn.q_proj`` ...); with no plan, every linear layer inside the decoder layers."""
    get = getattr(config, "get_text_config", None)
    text = get() if callable(get) else config
    plan = getattr(text, "base_model_tp_plan", None) or {}
    patterns = [re.compile(r"(^|\.)" + re.escape(k).replace(r"\*", r"\d+") + r"$") for k in plan]
    out: set[int] = set()
    for name, module in model.named_modules():
        if patterns:
            hit = any(p.search(name) for p in patterns)
        else:
            hit = type(module).__name__ == "Linear" and ".layers." in f".{name}."
        if hit:
            out |= {id(p) for p in module.parameters(recurse=False)}
    return out


def _shard(parallel: Parallel, model: Any, config: Any, trainable: list, weights: int, gradients: int, state: int,
           temporaries: int, device: str, settings: Settings, axes: list[str],
           sources: dict[str, str]) -> tuple[int, int, int, int]:
    """One rank's weights, gradients, optimizer state and step temporaries under the plan's axes and engine,
    and ``axes``: what was applied, each as it was counted."""
    p = parallel
    seq = settings.seq_len
    kept = 1.0
    if p.sp > 1:
        axes.append(f"sequence parallel sp_size {p.sp} (DeepSpeed Ulysses): activations per rank for "
                    f"{-(-seq // p.sp):,} of each row's {seq:,} columns, attention for 1/{p.sp} of the heads over "
                    "the whole row (measured: benchmarks/RESULTS.md, \"Sequence parallelism: per-rank activation "
                    "memory\")")
    if p.cp > 1:
        axes.append(f"context parallel cp_size {p.cp}: activations per rank for {-(-seq // p.cp):,} of each "
                    f"row's {seq:,} columns (computed as for sp_size, unmeasured)")
    if p.tp > 1:
        sharded = _tp_sharded(model, config)
        cut = sum(q.numel() * q.element_size() for q in model.parameters() if id(q) in sharded)
        weights -= cut * (p.tp - 1) // p.tp
        own = sum(q.numel() * q.element_size() for q in trainable)
        share = sum(q.numel() * q.element_size() for q in trainable if id(q) in sharded) / max(own, 1)
        kept = 1 - share * (p.tp - 1) / p.tp  # what stays of the trainable parameters' bytes
        gradients, state, temporaries = int(gradients * kept), int(state * kept), int(temporaries * kept)
        axes.append(f"tensor parallel tp_size {p.tp}: the tp_plan's projections (weights, gradients, optimizer "
                    f"state, and their activations) / {p.tp}, norms, embeddings and the head whole (computed, "
                    "unmeasured)")
    n = p.shards
    elements = int(sum(q.numel() for q in trainable) * kept)  # this rank's (tp's share of the sharded ones)
    size = trainable[0].element_size() if trainable else 4
    if p.engine == "deepspeed":
        # ZeRO (runtime/zero/stage_1_and_2.py, stage3.py) over every rank but tp's: the fp32 master weights
        # (a copy, whatever the model's dtype) and the optimizer state of this rank's 1/n partition, the gradients
        # of its partition in fp32, and the bucket they are reduced through.
        bucket = (_ZERO_BUCKET if device == "cuda" else min(elements, _ZERO_BUCKET)) * size
        master = elements * 4 // n
        state, temporaries = state // n, temporaries // n
        if p.offload_optimizer and device == "cuda":
            state = master = temporaries = 0
        gradients = elements * 4 // n + bucket
        if p.zero_stage == 3:
            weights //= n
        sources["optimizer"] += f", ZeRO-{p.zero_stage}: state and fp32 master weights / {n}"
        sources["gradients"] = f"ZeRO-{p.zero_stage}: this rank's fp32 partition (1/{n}) + the reduce bucket"
        axes.append(f"DeepSpeed ZeRO-{p.zero_stage} over {n} ranks (data parallel {p.data_parallel} x sp {p.sp}"
                    f"{f' x cp {p.cp}' if p.cp > 1 else ''}): "
                    + ("weights, " if p.zero_stage == 3 else "")
                    + f"gradients, fp32 master weights and optimizer state / {n}, plus the gradient reduce bucket "
                      f"({human(bucket)})" + (", the optimizer in host memory" if p.offload_optimizer else ""))
        state += master
    elif p.engine == "fsdp":
        full = p.fsdp_sharding == "full_shard"
        gradients, state, temporaries = gradients // n, state // n, temporaries // n
        if full:
            weights //= n
        axes.append(f"FSDP2 {p.fsdp_sharding} over {n} ranks: {'weights, ' if full else ''}gradients and optimizer "
                    f"state / {n} (computed, unmeasured)")
    else:
        axes.append(f"DDP over {p.processes} processes: every rank holds the whole model, its gradients and "
                    "optimizer state")
    return weights, gradients, state, temporaries


def _vision_notes(model: Any) -> list[str]:
    """For a vision-language model: what its vision tower and projector weigh (counted in the weights),
    and that their activations are not modeled (the language model's are, at max_length, image tokens
    included)."""
    from ftcore_plugins.common.vision import vision_parts

    tower, projector = vision_parts(model)
    if not tower and not projector:
        return []
    count = {path: sum(p.numel() for p in model.get_submodule(path).parameters()) for path in (*tower, *projector)}
    inside = sum(count[p] for p in projector if any(p.startswith(t + ".") for t in tower))  # Qwen's visual.merger
    tower_n, projector_n = sum(count[t] for t in tower) - inside, sum(count[p] for p in projector)
    return [f"vision-language model: the vision tower ({', '.join(tower)}: {tower_n:,} parameters) and the projector "
            f"({', '.join(projector)}: {projector_n:,}) are counted in the weights; the language model's activations "
            "are counted at max_length, its image tokens included, and the vision tower's own activations (each "
            "image's patches through its layers) are not modeled"]


def _compute_params(model: Any, moe: dict[str, int] | None = None) -> int:
    """Parameters a token's forward multiplies: all but the input embedding (a lookup), with an
    output head tied to it counted once; of a mixture of experts (``moe``), the active ones only."""
    total = moe["active"] if moe else sum(p.numel() for p in model.parameters())
    inputs = model.get_input_embeddings()
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if inputs is None:
        return total
    tied = output is not None and output.weight is inputs.weight
    return total - (0 if tied else inputs.weight.numel())


def _adapter_label(sel: Any) -> str:
    r = getattr(sel.options, "r", None)
    return f"{sel.name} (r={r})" if isinstance(r, int) else sel.name


def _settings(stage: Any, trainer: Any, device: str, calling: Callable, sources: dict, notes: list) -> Settings:
    fn = _optional(trainer, "memory_settings")
    if fn is not None:
        with calling(stage.trainer, "memory_settings"):
            raw = dict(_call(fn, device=device))
        notes.extend(str(n) for n in raw.pop("notes", None) or [])
        sources["settings"] = f"trainer '{stage.trainer.name}'"
    else:
        o = trainer.options
        raw = {"batch_size": getattr(o, "batch_size", None), "seq_len": getattr(o, "max_length", None),
               "gradient_checkpointing": getattr(o, "gradient_checkpointing", None),
               "optimizer": getattr(o, "optimizer", None), "precision": getattr(o, "precision", None)}
        missing = [k for k, v in raw.items() if v is None]
        if missing:
            notes.append(f"trainer '{stage.trainer.name}' has no memory_settings() nor options "
                         f"{', '.join(missing)}: assumed " + ", ".join(f"{k} {DEFAULTS[k]}" for k in missing))
        sources["settings"] = "fallback: the trainer's options"
    raw = {k: (DEFAULTS[k] if raw.get(k) is None else raw[k]) for k in DEFAULTS}
    precision = raw["precision"]
    if precision == "auto":  # as the built-in trainers: bf16 on a GPU that has it, else fp32
        precision = "bf16" if device == "cuda" else "fp32"
    return Settings(int(raw["batch_size"]), int(raw["seq_len"]), bool(raw["gradient_checkpointing"]),
                    str(raw["optimizer"]), str(precision))


def _meta_model(plan: Any, loader: Any, calling: Callable, sources: dict) -> tuple[Any, Any]:
    fn = _optional(loader, "meta_model")
    if fn is not None:
        with calling(plan.model, "meta_model"):
            out = fn()
        sources["model"] = f"model loader '{plan.model.name}' meta_model()"
    else:
        out = _meta_from_path(plan, loader)
        sources["model"] = "fallback: config.json at the loader's path"
    model, config = out if isinstance(out, tuple) else (out, getattr(out, "config", None))
    return model, config


def _meta_from_path(plan: Any, loader: Any) -> tuple[Any, Any]:
    path = getattr(loader.options, "path", None)
    if not isinstance(path, (str, Path)) or not (Path(path) / "config.json").is_file():
        raise FtcoreError(f"model loader '{plan.model.name}' cannot be estimated: it has no meta_model() and "
                          "its options name no local folder with a config.json")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    dtype = getattr(config, "dtype", None) or torch.float32
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype), config


def _param_bytes(model: Any) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _checkpointing_on(model: Any) -> bool:
    for attr in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        value = getattr(model, attr, None)
        if isinstance(value, bool):
            return value
    return False


def _weight_bytes(plan: Any, quantizer: Any, model: Any, loader: Any, calling: Callable, sources: dict,
                  notes: list) -> int:
    fn = _optional(quantizer, "weight_bytes")
    if fn is not None:
        with calling(plan.quantizer, "weight_bytes"):
            value = int(fn(model))
        sources["weights"] = f"quantizer '{plan.quantizer.name}' weight_bytes()"
        return value
    plain = _param_bytes(model) + sum(b.numel() * b.element_size() for b in model.buffers())
    kwargs_fn = _optional(quantizer, "load_kwargs")
    qconfig = None
    if kwargs_fn is not None:
        try:
            qconfig = (kwargs_fn() or {}).get("quantization_config")
        except Exception:
            qconfig = None
    if qconfig is None:
        sources["weights"] = "parameters x their dtype size"
        return plain
    try:
        value = _transformers_quantized_bytes(plan, loader, qconfig)
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [""])[0]
        notes.append(f"quantizer '{plan.quantizer.name}' has no weight_bytes() and transformers could not size its "
                     f"quantization_config ({type(exc).__name__}: {first}): weights counted unquantized")
        sources["weights"] = "fallback: parameters x their dtype size (unquantized)"
        return plain
    notes.append(f"quantizer '{plan.quantizer.name}' has no weight_bytes(): quantized weights sized by transformers' "
                 "element size, without quantization constants or dtype changes its prepare() makes")
    sources["weights"] = "fallback: transformers' quantizer element sizes"
    return value


def _transformers_quantized_bytes(plan: Any, loader: Any, qconfig: Any) -> int:
    """The weights as transformers' own quantizer for ``qconfig`` would store them, on a fresh
    meta model (its quantized layers are not what the adapter should see)."""
    from transformers.quantizers import AutoHfQuantizer

    model, _ = _meta_model(plan, loader, lambda *a: contextlib.nullcontext(), {})
    hf_quantizer = AutoHfQuantizer.from_config(qconfig)
    hf_quantizer.preprocess_model(model, device_map=None, keep_in_fp32_modules=[])
    total = 0.0
    for name, p in model.named_parameters():
        total += p.numel() * hf_quantizer.param_element_size(model, name, p)
    return int(total)


def generic_activation_bytes(config: Any, batch_size: int, seq_len: int, checkpointing: bool,
                             precision: str = "fp32") -> int:
    """A decoder-only transformer, when the trainer does not say: per layer about 16 hidden-width
    and 4 MLP-width tensors saved for backward, and three full fp32 logits tensors (the logits,
    their log-softmax and its gradient)."""
    get = getattr(config, "get_text_config", None)
    c = get() if callable(get) else config
    h = getattr(c, "hidden_size", None)
    layers = getattr(c, "num_hidden_layers", None)
    if not h or not layers:
        return 0
    inter = getattr(c, "intermediate_size", None) or 4 * h
    vocab = getattr(c, "vocab_size", 0) or 0
    act = 2 if precision in ("bf16", "fp16") else 4
    tokens = batch_size * seq_len
    per_layer = tokens * (16 * h + 4 * inter) * act
    logits = 3 * tokens * vocab * 4
    if checkpointing:
        return int(layers * tokens * h * act + 2 * per_layer + logits)
    return int(layers * per_layer + logits)


def _process_bytes() -> int:
    from ftcore.memory import snapshot

    mib = snapshot().get("rss_mib")
    return int(mib * MiB) if mib else 0


def _data_bytes(plan: Any) -> int:
    total = 0
    for sel in plan.data.values():
        try:
            for path in sel.create().inputs():
                path = Path(path)
                if path.is_file():
                    total += path.stat().st_size
        except Exception:
            continue
    return total


# -- output -----------------------------------------------------------------------------------
def stage_line(result: Estimate, s: StageEstimate) -> str:
    from ftcore_plugins.common.estimate import moe_line

    st = s.settings
    fits = result.fits(s)
    verdict = "" if fits is None else (
        f"; fits {human(result.budget)}" if fits else f"; does NOT fit {human(result.budget)}")
    terms = " + ".join(f"{t} {human(getattr(s, t))}" for t in TERMS)
    where = result.device if result.parallel is None else f"{result.device}, per rank of {result.parallel.processes}"
    return (f"stage {s.stage}: {human(s.total)} peak ({where}) = {terms}; {s.trainer}, {s.adapter}, "
            f"quantizer {result.quantizer}, batch {st.batch_size} x {st.seq_len} tokens, checkpointing "
            f"{'on' if st.gradient_checkpointing else 'off'}, {st.optimizer}, {st.precision}, "
            f"{s.trainable_params:,} of {s.total_params:,} parameters trainable{verdict}"
            + (f"; mixture of experts: {moe_line(s.moe)}" if s.moe else ""))


def print_estimate(result: Estimate, console: Any) -> None:
    from rich.markup import escape
    from rich.table import Table

    for s in result.stages:
        console.print(escape(stage_line(result, s)), highlight=False, soft_wrap=True)
    if not result.stages:
        console.print(f"{result.plan}: the plan has no stages: nothing trains", highlight=False)
        return
    per = "" if result.parallel is None else " per rank"
    table = Table(title=f"Estimated peak memory{per} ({'RSS' if result.device == 'cpu' else 'GPU'}, "
                        f"{result.device}), GiB", title_justify="left")
    table.add_column("stage")
    for t in (*TERMS, "total"):
        table.add_column(t, justify="right")
    if result.budget is not None:
        table.add_column(f"fits {human(result.budget)}")
    for s in result.stages:
        row = [escape(s.stage), *(f"{getattr(s, t) / GiB:.2f}" for t in TERMS), f"[bold]{s.total / GiB:.2f}[/]"]
        if result.budget is not None:
            row.append("[green]yes[/]" if result.fits(s) else "[red]no[/]")
        table.add_row(*row)
    console.print(table)
    if result.parallel is not None:
        p = result.parallel
        console.print(escape(f"parallel: {p.processes} processes, engine {p.engine}, data parallel {p.data_parallel}; "
                             "every figure is one rank's"), highlight=False, soft_wrap=True)
        for axis in dict.fromkeys(a for s in result.stages for a in s.axes):
            console.print(f"  applied: {escape(axis)}", highlight=False, soft_wrap=True)
    notes = [*result.notes, *dict.fromkeys(n for s in result.stages for n in s.notes)]
    for note in notes:
        console.print(f"note: {escape(note)}", highlight=False, soft_wrap=True, style="dim")


def main_estimate(plan: Any, *, device: str, budget: str | None, as_json: bool, console: Any,
                  compute: dict[str, Any] | None = None, pm: Any = None) -> int:
    """The CLI command's body: 0 fits (or no budget), 1 does not fit. ``compute`` (gpu, gpus, mfu,
    price, peak_flops) adds each stage's tokens, FLOPs, hours and cost."""
    import json

    try:
        budget_bytes = parse_size(budget) if budget is not None else None
    except ValueError as exc:
        raise FtcoreError(f"--budget: {exc}") from None
    # Never the network: a hub id is read from the local cache only (the built-in loaders also
    # pass local_files_only); set before anything imports huggingface_hub.
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    result = estimate_plan(plan, device=device, budget=budget_bytes)
    times = estimate_time(plan, pm, result, **compute) if compute else None
    if as_json:
        out = result.to_json()
        if times is not None:
            out["compute"] = times
        sys.stdout.write(json.dumps(out, indent=2) + "\n")
    else:
        print_estimate(result, console)
        if times is not None:
            print_time(times, console)
    return 1 if result.fits() is False else 0


def estimate_time(plan: Any, pm: Any, result: Estimate, *, gpu: str, gpus: int, mfu: float | None,
                  price: float | None, peak_flops: float | None) -> dict[str, Any]:
    """Tokens, FLOPs, hours and cost of every stage (plugins/commands/_compute.py)."""
    from ftcore.runner import Runner

    from ftcore_plugins.commands import _compute as C
    from ftcore_plugins.common.run_data import data_tokenizer

    peak, peak_source = C.peak_flops(gpu, peak_flops)
    mfu = mfu if mfu is not None else (1.0 if gpu == "cpu" else C.MFU)
    runner = Runner(plan, pm, None)
    with _quiet():
        _, tokenizer = data_tokenizer(runner)
        config = _meta_model(plan, plan.model.create(), lambda *a: contextlib.nullcontext(), {})[1]
        stages = [C.stage_compute(s, runner, stage, tokenizer, config, peak=peak, mfu=mfu, gpus=gpus, price=price,
                                  compute_params=s.compute_params)
                  for s, stage in zip(result.stages, plan.stages)]
    hours = sum(s.hours for s in stages)
    return {"gpu": gpu, "gpus": gpus, "peak_flops": peak, "peak_flops_source": peak_source, "mfu": mfu,
            "price_per_gpu_hour": price, "stages": [s.to_json() for s in stages], "hours": hours,
            "cost": hours * gpus * price if price is not None else None,
            "formula": "hours = tokens x FLOPs per token / (GPUs x peak FLOP/s x MFU) / 3600; "
                       "cost = hours x GPUs x price per GPU-hour"}


def print_time(times: dict[str, Any], console: Any) -> None:
    from rich.markup import escape
    from rich.table import Table

    where = f"{times['gpus']} x {times['gpu']}"
    table = Table(title=f"Estimated time and cost on {where} ({times['peak_flops'] / 1e12:,.1f} TFLOP/s peak each, "
                        f"{times['peak_flops_source']}; MFU {times['mfu']:g})", title_justify="left")
    for column in ("stage", "tokens / epoch", "tokens trained", "GFLOPs / token", "hours", "cost"):
        table.add_column(column, justify="left" if column == "stage" else "right")
    for s in times["stages"]:
        table.add_row(escape(s["stage"]), "stream" if s["tokens_per_epoch"] is None else f"{s['tokens_per_epoch']:,}",
                      f"{s['tokens']:,}", f"{s['flops_per_token'] / 1e9:,.4g}", f"{s['hours']:,.3g}",
                      "" if s["cost"] is None else f"{s['cost']:,.4g}")
    console.print(table)
    total = f"total: {times['hours']:,.3g} hours" + (
        f", cost {times['cost']:,.4g} ({times['hours']:,.3g} h x {times['gpus']} GPUs x "
        f"{times['price_per_gpu_hour']:g} per GPU-hour)" if times["cost"] is not None else "")
    console.print(total, highlight=False)
    console.print(f"formula: {times['formula']}", highlight=False, style="dim")
    for s in times["stages"]:
        console.print(f"stage {escape(s['stage'])}: tokens: {escape(s['tokens_source'])}; FLOPs per token = "
                      f"{escape(s['flops_formula'])}", highlight=False, soft_wrap=True, style="dim")


class EstimateCommand(Command):
    """Predict each stage's peak memory, loading no weights.

    Predict each stage's peak memory (weights, gradients, optimizer state, activations, overhead)
    from the model's config, on the meta device: no weights are loaded and nothing is downloaded.
    Exits 2 for a bad plan, 1 when --budget is given and a stage does not fit.
    """

    name = "estimate"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("plan", help="path to plan.toml")
        parser.add_argument("--budget", help="memory available, e.g. 16GB or 800MB (binary units: 16GB = 16 GiB)")
        parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                            help="where the run would train (default: cuda if this machine has one, else cpu)")
        parser.add_argument("--json", action="store_true", help="machine-readable output")
        time = parser.add_argument_group("time and cost (tokens the data holds x FLOPs per token / GPU rate)")
        time.add_argument("--gpu", choices=(*GPUS, "cpu"),
                          help="the GPU type to time the run on (cpu: this machine, its matmul rate measured)")
        time.add_argument("--gpus", type=int, default=1, help="how many of them (default 1)")
        time.add_argument("--mfu", type=float, help="model FLOPs utilisation, 0-1 (default 0.35; 1 for cpu)")
        time.add_argument("--price", type=float, help="price per GPU-hour, for the cost")
        time.add_argument("--peak-flops", type=float, help="peak FLOP/s per GPU, instead of the table's")

    def run(self, args: argparse.Namespace) -> int:
        from rich.console import Console

        if args.gpu is None and any(v is not None for v in (args.mfu, args.price, args.peak_flops)):
            raise FtcoreError("--mfu, --price and --peak-flops time the run on a GPU: add --gpu TYPE")
        if args.gpus < 1 or (args.mfu is not None and not 0 < args.mfu <= 1) or (args.price or 0) < 0:
            raise FtcoreError("--gpus must be at least 1, --mfu between 0 and 1, --price not negative")
        plan, pm = self.load_plan(args.plan)
        compute = None if args.gpu is None else {"gpu": args.gpu, "gpus": args.gpus, "mfu": args.mfu,
                                                  "price": args.price, "peak_flops": args.peak_flops}
        return main_estimate(plan, device=args.device, budget=args.budget, as_json=args.json, console=Console(),
                             compute=compute, pm=pm)


@ftcore.hookimpl
def register_commands(register):
    register(EstimateCommand)
