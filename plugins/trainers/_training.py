"""What every trainer shares: options, the transformers/TRL run, checkpoints, progress and metrics."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator

from ftcore.component import Options
from ftcore.types import LearningRate, Tokens

from ftcore_plugins.common.device_defaults import training_device
from ftcore_plugins.common.memory import gpu_visible
from ftcore_plugins.common.seq2seq import plan_encoder_decoder, refusal
from ftcore_plugins.common.model import strip_forward_patches, trainable_counts
from ftcore_plugins.trainers._compile import compile_problem, compiled_blocks
from ftcore_plugins.trainers._optimizers import optimizer_arguments, optimizer_name, optimizer_problem
from ftcore_plugins.trainers._router import OPTION as ROUTER_AUX, apply_router_aux, router_problems
from ftcore_plugins.trainers._qat import fake_quantized
from ftcore_plugins.trainers._sequence_parallel import plan_problems as sequence_parallel_problems
from ftcore_plugins.trainers._tiled_mlp import plan_problems as tiled_mlp_problems, tiled_mlps


class TrainOptions(Options):
    epochs: float = Field(1.0, gt=0, le=10_000)
    max_steps: int = Field(-1, ge=-1, le=1 << 31)  # overrides epochs when > 0
    learning_rate: LearningRate = 2e-4
    batch_size: int = Field(8, ge=1, le=1 << 16)
    gradient_accumulation_steps: int = Field(1, ge=1, le=1 << 16)  # the loss is normalised by the tokens of all micro-batches
    max_length: Tokens = 512
    lr_scheduler: Literal["linear", "cosine", "constant"] = "linear"
    warmup_ratio: float = Field(0.0, ge=0, lt=1)  # share of the steps spent warming up
    warmup_steps: int = Field(0, ge=0)  # or a number of steps
    weight_decay: float = Field(0.0, ge=0)
    # a transformers optimizer name (adamw_8bit, adafactor, lion, galore_adamw, ...); auto: the device's AdamW
    optimizer: str = "auto"
    max_grad_norm: float = Field(1.0, ge=0)  # clip the gradient norm; 0: no clipping
    gradient_checkpointing: bool = False
    # with checkpointing, each layer's saved input in pinned host memory, not on the GPU (transformers'
    # offload): frees layers x tokens x hidden of GPU memory for a copy each way a step; a CPU has no
    # GPU memory to free, so there it changes nothing
    activation_offloading: bool = False
    compile: bool = False  # torch.compile the decoder blocks while training; off: on CPU it rarely pays (RESULTS.md)
    # each decoder layer's MLP run over ceil(tokens / hidden_size) shards of the row by DeepSpeed's TiledMLP
    # and recomputed shard by shard in backward: one shard's MLP activations at a time, for one more MLP
    # forward a step (long rows; needs DeepSpeed installed; docs/distributed.md, "Tiled MLP")
    tiled_mlp: bool = False
    # auto: bf16 on a GPU that has it, fp16 on one without, else fp32
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    logging_steps: int = Field(10, ge=1)
    save_steps: int = Field(50, ge=1)  # checkpoint every N steps, for --resume
    save_total_limit: int | None = Field(2, ge=1)  # marked checkpoints kept (the best one is kept on top); None: all
    eval_steps: int | None = Field(None, ge=1)  # evaluate eval_data every N steps; default: each epoch
    early_stopping_patience: int | None = Field(None, ge=1)  # stop after N evaluations without improvement
    early_stopping_threshold: float = Field(0.0, ge=0)  # an eval_loss drop no larger than this is no improvement
    load_best_at_end: bool | None = None  # end with the best checkpoint by eval_loss; default: with early stopping
    guard_nan: Literal["stop", "skip"] = "stop"  # on a NaN/inf loss or gradient norm
    guard_spike_factor: float | None = Field(3.0, gt=1)  # warn when a step's loss exceeds this x the recent mean
    guard_spike_window: int = Field(20, ge=2)  # steps in that mean
    guard_max_grad_norm: float | None = Field(None, gt=0)  # warn when the gradient norm (before clipping) exceeds it
    # a mixture of experts' router (load-balancing) loss, added to the loss with this weight and logged as
    # aux_loss; unset or 0: off, whatever the model's config says (docs/trainers.md, "The router's auxiliary loss")
    router_aux_loss_coef: float | None = Field(None, ge=0)

    @field_validator("optimizer")
    @classmethod
    def _known_optimizer(cls, value: str) -> str:
        return optimizer_name(value)


def training_problems(component: Any, plan: Any) -> list[str]:
    """``check(plan)`` problems of the shared training options, for the stages that use ``component``."""
    o = component.options
    stages = [s for s in plan.stages if s.trainer.options is o]
    problems = []
    # An encoder-decoder (T5, BART) trains with the trainers that say they can (sft); the others are causal.
    if stages and not getattr(component, "encoder_decoder", False) and (family := plan_encoder_decoder(plan)):
        problems.append(refusal(f"trainer '{component.name}'", family, "it trains causal language models",
                                "train this model with trainer \"sft\""))
    if o.warmup_ratio and o.warmup_steps:
        problems.append("warmup_steps: set warmup_ratio or warmup_steps, not both")
    d = getattr(plan, "distributed", None)
    if o.guard_nan == "skip" and d is not None and d.wanted and d.engine == "deepspeed":
        problems.append("guard_nan: \"skip\" cannot drop a step's gradients under DeepSpeed (they live in its "
                        "partitions until its optimizer step); use \"stop\" with engine = \"deepspeed\"")
    if o.compile and (problem := compile_problem()):
        problems.append(problem)
    if o.precision == "fp16" and not gpu_visible():
        problems.append("precision: fp16 needs a CUDA GPU and none is visible here; use \"auto\", \"bf16\" or \"fp32\"")
    problems += router_problems(component, plan)
    problems += sequence_parallel_problems(component, plan)
    problems += tiled_mlp_problems(component, plan)
    for stage in stages:
        problem = optimizer_problem(o.optimizer, adapter=stage.adapter.name)
        if problem and problem not in problems:
            problems.append(problem)
        source = plan.data.get(str(stage.data).split(":")[0])
        if source is not None and getattr(source.options, "streaming", False):
            if not getattr(component, "streams", False):
                problems.append(f"data: stage '{stage.name}' trains on data.{stage.data}, which streams, and trainer "
                                f"'{stage.trainer.name}' cannot train from a stream; set streaming = false there")
            elif o.max_steps <= 0:
                problems.append(f"max_steps: stage '{stage.name}' trains on data.{stage.data}, which streams and so "
                                "has no length to count epochs by; set max_steps")
        if stage.eval_data is not None:
            continue
        for key in ("eval_steps", "early_stopping_patience"):
            if getattr(o, key) is not None:
                problems.append(f"{key}: stage '{stage.name}' has no eval_data to evaluate; "
                                "set eval_data = \"<data name>\" on the stage")
        if o.load_best_at_end:
            problems.append(f"load_best_at_end: stage '{stage.name}' has no eval_data, so no checkpoint is "
                            "best by eval_loss; set eval_data on the stage")
    return problems


class TrainChecks:
    """Mixin for trainers built on ``TrainOptions``: ``ftcore validate`` checks the shared options."""

    def check(self, plan: Any) -> list[str]:
        return training_problems(self, plan)


def progress_callback(reporter: Any, stage: str):
    from transformers import TrainerCallback

    class RichProgress(TrainerCallback):
        """Draws the stage's progress bar and records the Trainer's logs as metrics."""

        def __init__(self):
            self._cm = self._bar = None

        def on_train_begin(self, args, state, control, **kw):
            self._cm = reporter.progress(f"train {stage}", state.max_steps)
            self._bar = self._cm.__enter__()
            self._bar.update(completed=state.global_step)

        def on_step_end(self, args, state, control, **kw):
            self._bar.update(completed=state.global_step)

        def on_log(self, args, state, control, logs=None, **kw):
            logs = {k: v for k, v in (logs or {}).items() if isinstance(v, (int, float))}
            reporter.log(stage, logs, step=state.global_step)
            if "loss" in logs and self._bar is not None:
                self._bar.update(note=f"loss {logs['loss']:.4f}")

        def on_train_end(self, args, state, control, **kw):
            self.close()

        def close(self):
            if self._cm is not None:
                self._cm.__exit__(None, None, None)
                self._cm = None

    return RichProgress()


def resolve_precision(precision: str) -> str:
    """``auto``: bf16 on a GPU that has it, fp16 on a GPU without, else fp32."""
    import torch

    if precision != "auto":
        return precision
    if not torch.cuda.is_available():
        return "fp32"
    return "bf16" if torch.cuda.is_bf16_supported() else "fp16"


def training_arguments(ctx: Any, o: TrainOptions, evaluation: Any | None) -> dict[str, Any]:
    """The TrainingArguments every trainer shares, from the stage's options."""
    import torch

    from ftcore.errors import FtcoreError

    precision = resolve_precision(o.precision)
    if precision == "fp16" and not torch.cuda.is_available():
        raise FtcoreError(f"stage {ctx.stage}: precision = \"fp16\" needs a CUDA GPU; "
                          "use \"auto\", \"bf16\" or \"fp32\"")
    scheduler = "constant_with_warmup" if o.lr_scheduler == "constant" and (o.warmup_ratio or o.warmup_steps) \
        else o.lr_scheduler
    evaluating = evaluation is not None
    return dict(
        output_dir=str(ctx.checkpoint_dir),
        num_train_epochs=o.epochs,
        max_steps=o.max_steps,
        per_device_train_batch_size=o.batch_size,
        per_device_eval_batch_size=o.batch_size,
        gradient_accumulation_steps=o.gradient_accumulation_steps,
        learning_rate=o.learning_rate,
        lr_scheduler_type=scheduler,
        warmup_steps=o.warmup_steps or o.warmup_ratio,  # a float below 1 is a ratio of the total steps
        weight_decay=o.weight_decay,
        **optimizer_arguments(o.optimizer, training_device()),
        max_grad_norm=o.max_grad_norm,
        **checkpointing_arguments(o),
        bf16=precision == "bf16",
        fp16=precision == "fp16",
        logging_steps=o.logging_steps,
        # The stability guard checks every step's loss (one host sync a step): the Trainer's own check
        # would add one a micro-batch, on the zeros the guard hands it.
        logging_nan_inf_filter=False,
        save_strategy="steps",
        save_steps=o.save_steps,
        save_total_limit=None,  # rotated by our checkpoint keeper, only after the new checkpoint is marked
        eval_strategy=("steps" if o.eval_steps else "epoch") if evaluating else "no",
        eval_steps=o.eval_steps,
        # The best checkpoint is tracked by eval loss; the keeper saves at each evaluation so it is on disk.
        metric_for_best_model="eval_loss" if evaluating else None,
        greater_is_better=False if evaluating else None,
        report_to="none",
        disable_tqdm=True,
        seed=ctx.seed,
        dataloader_pin_memory=torch.cuda.is_available(),
        **distributed_arguments(ctx.run, ctx.model),
    )


def checkpointing_arguments(o: TrainOptions) -> dict[str, Any]:
    """TrainingArguments for gradient checkpointing and, on a GPU, activation offloading (which turns
    checkpointing on: only the checkpointed layers' inputs are offloaded)."""
    import torch

    if o.activation_offloading and torch.cuda.is_available():
        return {"activation_checkpointing": True,
                "activation_checkpointing_kwargs": {"use_reentrant": False, "offload": True}}
    return {"activation_checkpointing": o.gradient_checkpointing}


def distributed_arguments(run: Any, model: Any = None) -> dict[str, Any]:
    """TrainingArguments for the plan's ``[distributed]`` engine when the run has several processes, and
    its sequence-parallel axis (Ulysses, on ``model``'s attention kernel)."""
    d = getattr(run.plan, "distributed", None)
    if run.world_size == 1 or d is None or d.accelerate_config is not None:
        return {}  # an accelerate config: `accelerate launch` passed its engine to the workers' environment
    import torch

    args: dict[str, Any] = {"ddp_backend": d.resolved_backend()}
    if not torch.cuda.is_available() and d.engine != "deepspeed":
        args["use_cpu"] = True  # accelerate treats several CPU processes as distributed only when told
    if d.engine == "deepspeed":
        args["deepspeed"] = str(d.deepspeed_config) if d.deepspeed_config else deepspeed_config(d)
        if not torch.cuda.is_available():
            _deepspeed_state_on_cpu(args["ddp_backend"])
            args["accelerator_config"] = {"use_configured_state": True}
        if d.sp_size > 1:
            from ftcore_plugins.trainers._sequence_parallel import parallelism_config

            args["parallelism_config"] = parallelism_config(d.sp_size, model)
    elif d.engine == "fsdp":
        from ftcore_plugins.common.launch import FSDP2_SHARDING

        args["fsdp"] = True
        if d.cp_size > 1:  # torch's context parallel: rows split over cp_size processes, FSDP over all of them
            from accelerate.parallelism_config import ParallelismConfig

            args["parallelism_config"] = ParallelismConfig(cp_size=d.cp_size, cp_backend="torch",
                                                           dp_shard_size=d.processes // d.cp_size)
        args["fsdp_config"] = {
            "version": 2, "reshard_after_forward": FSDP2_SHARDING[d.fsdp_sharding], "cpu_offload": d.offload_params,
            # every rank writes its shard (torch.distributed.checkpoint); a full state dict is gathered
            # once, at the end of the stage, for the stage output and exports
            "state_dict_type": "SHARDED_STATE_DICT",
            # transformer_layer wraps each of the model's _no_split_modules (its decoder layers)
            "auto_wrap_policy": "TRANSFORMER_BASED_WRAP" if d.fsdp_wrap == "transformer_layer" else "SIZE_BASED_WRAP"}
    return args


def deepspeed_config(d: Any) -> dict[str, Any]:
    """A DeepSpeed config from the plan; "auto" values are filled by transformers from the stage's options."""
    zero: dict[str, Any] = {"stage": d.zero_stage}
    if d.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu"}
    if d.offload_params:
        zero["offload_param"] = {"device": "cpu"}
    if d.zero_stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = True  # checkpoints and exports get full weights
    # No train_batch_size: DeepSpeed derives it from these and the world size it sees.
    return {"zero_optimization": zero, "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
            "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"}}


def _deepspeed_state_on_cpu(backend: str) -> None:
    """transformers starts accelerate's state for DeepSpeed without a backend, and accelerate picks one
    only for accelerator devices: on CPU it then counts one process, and the first gather fails. A state
    started here with the backend (kept by ``use_configured_state``) counts every process. It is started
    afresh for each stage, so each stage's Trainer gets its own DeepSpeed plugin."""
    import os

    from accelerate.state import AcceleratorState, PartialState

    AcceleratorState._reset_state(reset_partial_state=True)
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"  # as TrainingArguments sets it around the same call
    try:
        PartialState(backend=backend)
    finally:
        del os.environ["ACCELERATE_USE_DEEPSPEED"]


def _fsdp_on_cpu(trainer: Any) -> None:
    """accelerate turns FSDP on only for accelerator devices and keeps several CPU processes on DDP,
    though torch's FSDP2 shards over gloo; CPU runs (the tests' parity runs) get the FSDP they asked for."""
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    state = trainer.accelerator.state
    if trainer.args.fsdp_plugin_args is None or state.distributed_type != DistributedType.MULTI_CPU:
        return
    state.fsdp_plugin = FullyShardedDataParallelPlugin(**trainer.args.fsdp_plugin_args)
    state.distributed_type = DistributedType.FSDP
    trainer.is_fsdp_enabled = True


def meta_copy(model: Any) -> Any:
    """The model's structure with its weights on the meta device (no memory): a plain model to load
    consolidated weights into once a sharding engine has taken the trained one apart."""
    import copy

    import torch

    memo = {id(p): torch.nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
            for p in model.parameters()}
    return copy.deepcopy(model, memo)


def consolidated(trainer: Any, skeleton: Any) -> Any | None:
    """The trained model as a plain, whole model on every rank, when FSDP or ZeRO-3 sharded its weights
    (None when they are whole already: DDP, ZeRO-2), so evaluations, the stage output and exports see
    the full weights."""
    ds = trainer.accelerator.state.deepspeed_plugin if trainer.is_deepspeed_enabled else None
    if trainer.is_fsdp_enabled:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True))
    elif ds is not None and ds.zero_stage == 3:
        import deepspeed
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        module = trainer.model_wrapped.module if hasattr(trainer.model_wrapped, "module") else trainer.model
        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
            state = {k: v.detach().clone() for k, v in module.state_dict().items()}
        unset_hf_deepspeed_config()  # later from_pretrained calls must not partition their models
    else:
        return None
    skeleton.load_state_dict(state, assign=True)
    if hasattr(skeleton, "tie_weights"):
        skeleton.tie_weights()  # assign=True gave tied weights separate tensors
    return skeleton.to(next(iter(state.values())).device)


def run_trainer(ctx: Any, o: TrainOptions, trainer_cls: type, config_cls: type, *, train: Any,
                evaluation: Any | None, config: dict[str, Any] | None = None, strip_patches: bool = True,
                router_aux: bool = True, **trainer_kwargs: Any) -> tuple[Any, dict[str, Any]]:
    """Train ``ctx.model`` with a transformers/TRL ``trainer_cls`` configured by ``config_cls``
    (e.g. ``DPOTrainer``/``DPOConfig``): the shared arguments, callbacks, resume and metrics.
    ``strip_patches=False`` leaves TRL's forward patches on the model, for a caller that still uses
    the returned trainer; it must call ``strip_forward_patches`` itself afterwards.
    ``config`` adds or overrides config fields; ``trainer_kwargs`` go to the trainer (``callbacks``
    are added to ours). Every trainer built here gets: checkpoints marked and rotated, the best by
    eval loss kept, early stopping, the stability guard, and SIGINT/SIGTERM handling (a checkpoint
    at the end of the current step, then :class:`ftcore.errors.Interrupted`).
    The router's auxiliary loss follows the stage's ``router_aux_loss_coef`` (``_router.py``): the model's
    config is set for the stage (put back after training) and the coefficient, 0.0 when off, goes to a TRL
    config that takes one; ``router_aux=False``: a trainer whose loss cannot take it (off, an option ignored).
    Returns the trainer and the stage's final metrics."""
    import dataclasses

    import torch
    from transformers import EarlyStoppingCallback, PrinterCallback

    from ftcore_plugins.trainers._callbacks import GracefulStop, StabilityGuard, StageTotals, attach_guard, \
        checkpoint_keeper, newest_checkpoint, stop_on_signal

    class EarlyStopping(EarlyStoppingCallback):
        def on_train_begin(self, args, state, control, **kw):
            pass  # its warning about load_best_model_at_end does not apply: we load the best ourselves

    # A TRL config with the field takes the coefficient (and TRL asks for router logits itself); another
    # trainer (TRL's ORPO) reads the model's config.
    takes = ROUTER_AUX in {f.name for f in dataclasses.fields(config_cls)}
    coef, restore_router = apply_router_aux(ctx, o, supported=router_aux, in_config=not takes)
    router = {ROUTER_AUX: coef} if takes else {}
    args = config_cls(**{**training_arguments(ctx, o, evaluation), **router, **(config or {})})
    # An adapter that brings its own optimizer (loraplus) builds it: ``adapter.optimizer(model, args)``.
    # Passed as a factory, the Trainer builds it once the model is on its device.
    build = getattr(ctx.adapter, "optimizer", None)
    if build is not None:
        trainer_kwargs.setdefault("optimizer_cls_and_kwargs", ((lambda: lambda model: build(model, args)), {}))
    counts = trainable_counts(ctx.model)
    ctx.reporter.log(ctx.stage, counts, step=0)
    skeleton = meta_copy(ctx.model) if ctx.run.world_size > 1 else None
    evaluating = evaluation is not None
    progress = progress_callback(ctx.reporter, ctx.stage)
    stop = GracefulStop(ctx.stage, ctx.checkpoint_dir, getattr(getattr(ctx.run, "plan", None), "path", None))
    # TRL's trainers count real tokens (attention masks) in _total_train_tokens, from 0 in each process.
    totals = StageTotals(tokens=lambda: getattr(trainer, "_total_train_tokens", None))
    totals.resume(ctx.resume_from)
    callbacks = [progress, checkpoint_keeper(o.save_total_limit, save_each_evaluation=evaluating, totals=totals),
                 stop_on_signal(stop), *trainer_kwargs.pop("callbacks", [])]
    early = EarlyStopping(o.early_stopping_patience, o.early_stopping_threshold) \
        if evaluating and o.early_stopping_patience else None
    if early is not None:
        callbacks.append(early)
    trainer = trainer_cls(model=ctx.model, args=args, train_dataset=train, eval_dataset=evaluation,
                          processing_class=trainer_kwargs.pop("processing_class", ctx.tokenizer), callbacks=callbacks,
                          **trainer_kwargs)
    trainer.remove_callback(PrinterCallback)  # our progress bar and metrics.jsonl replace its prints
    _fsdp_on_cpu(trainer)
    guard = StabilityGuard(ctx.reporter, ctx.stage, nan=o.guard_nan, spike_factor=o.guard_spike_factor,
                           window=o.guard_spike_window, max_grad_norm=o.guard_max_grad_norm)
    totals.guard = guard
    trainer.add_callback(attach_guard(trainer, guard, totals))
    # TRL casts the trainable weights of a quantized model to bf16 when it builds the trainer;
    # adapters train in fp32 (QLoRA keeps only the frozen base in low precision).
    if getattr(trainer.model, "is_quantized", False) or getattr(trainer.model, "is_loaded_in_4bit", False) \
            or getattr(trainer.model, "is_loaded_in_8bit", False):
        for p in trainer.model.parameters():
            if p.requires_grad and p.dtype != torch.float32:
                p.data = p.data.float()
    totals.start()
    try:
        # Fake-quantized and tiled before compiling, so that the compiled blocks run them; all undone after training.
        with stop, fake_quantized(trainer.model, getattr(o, "qat", None), stage=ctx.stage,
                                  reporter=ctx.reporter) as qat_layers, \
                tiled_mlps(trainer.model, o.tiled_mlp, stage=ctx.stage, reporter=ctx.reporter,
                           distributed_engine=ctx.run.world_size == 1 or trainer.is_deepspeed_enabled) as tiled, \
                compiled_blocks(trainer.model, o.compile) as compiled:
            if o.compile:
                ctx.reporter.log(ctx.stage, {"compiled_blocks": compiled}, step=0)
            if qat_layers:
                ctx.reporter.log(ctx.stage, {"qat_layers": qat_layers}, step=0)
            result = trainer.train(resume_from_checkpoint=str(ctx.resume_from) if ctx.resume_from else None)
        if o.tiled_mlp:  # the most shards a training forward used (1: every row no longer than hidden_size)
            ctx.reporter.log(ctx.stage, {"tiled_mlp_layers": tiled["layers"], "tiled_mlp_shards": tiled["shards"]},
                             step=trainer.state.global_step)
    except (MemoryError, torch.OutOfMemoryError):
        # Nothing half-written stays behind: the stage saves its output only after training, and a
        # checkpoint counts only once marked. The step is the one that did not finish.
        raise out_of_memory(ctx, o, trainer.state.global_step + 1) from None
    finally:
        progress.close()  # also when the guard or an error ends training
        restore_router()  # the model's config as it came: the option holds for this stage only
    if stop.requested:
        raise stop.interrupted(ctx.stage, trainer.state.global_step, newest_checkpoint(ctx.checkpoint_dir),
                               getattr(getattr(ctx.run, "plan", None), "path", None))
    best = trainer.state.best_model_checkpoint
    load_best = o.load_best_at_end if o.load_best_at_end is not None else bool(o.early_stopping_patience)
    if evaluating and load_best and best:
        trainer._load_best_model()  # the Trainer's own loader: full weights or adapter, as it saved them
    # The next stage gets the model without the trainer's per-instance forward patches.
    ctx.model = strip_forward_patches(trainer.model) if strip_patches else trainer.model
    if skeleton is not None:
        ctx.model = consolidated(trainer, skeleton) or ctx.model
    # Over the whole stage, a resumed one too: the mean loss of the trained steps (skipped ones added
    # none), the real (non-padding) tokens TRL counted from the attention masks, the seconds training.
    whole = totals.metrics()
    metrics: dict[str, Any] = {"train_loss": whole.pop("train_loss"), "global_step": result.global_step, **counts,
                               **whole}
    evals = [(h["step"], h["eval_loss"]) for h in trainer.state.log_history if "eval_loss" in h]
    if evals:
        metrics["eval_step"], metrics["eval_loss"] = evals[-1]  # the last evaluation
        metrics["eval_perplexity"] = math.exp(min(evals[-1][1], 50))
        if best and trainer.state.best_metric is not None:
            metrics["best_step"] = int(Path(best).name.rpartition("-")[2])
            metrics["best_eval_loss"] = trainer.state.best_metric
            metrics["best_checkpoint"] = best
        metrics["final_model"] = "best" if load_best and best else "last"
        if early is not None:
            metrics["stopped_early"] = early.early_stopping_patience_counter >= early.early_stopping_patience
    return trainer, metrics


def out_of_memory(ctx: Any, o: TrainOptions, step: int) -> Exception:
    """The one-line error for a stage that ran out of memory at ``step``: the measured peak and the
    cheapest changes to the plan, those that keep the training the same first."""
    from ftcore import memory
    from ftcore.errors import FtcoreError

    peak = memory.snapshot()
    measured = ", ".join(f"{k.replace('_mib', '')} {v:,.0f} MiB" for k, v in peak.items() if "peak" in k) or "not measured"
    plan = getattr(ctx.run, "plan", None)
    fixes = []
    if o.batch_size > 1:
        fixes.append(f"batch_size = {max(o.batch_size // 2, 1)} with gradient_accumulation_steps = "
                     f"{o.gradient_accumulation_steps * 2} (the same batch, about half the activations)")
    if not o.gradient_checkpointing:
        fixes.append("gradient_checkpointing = true (activations recomputed, not kept)")
    adapter = getattr(ctx.adapter, "peft", False)
    if adapter and plan is not None and plan.quantizer.name == "none":
        fixes.append('[quantizer] use = "bnb-4bit" (QLoRA: the frozen weights in 4 bits)')
    elif not adapter:
        fixes.append('adapter = "lora" (only the adapter trains: no gradients or optimizer state for the rest)')
    fixes.append(f"a shorter max_length (now {o.max_length})")
    where = f"ftcore estimate {plan.shown or plan.path}" if plan is not None else "ftcore estimate PLAN"
    return FtcoreError(f"stage {ctx.stage}: out of memory at step {step} (measured peak: {measured}); try "
                       f"{'; or '.join(fixes)}; `{where}` shows what each needs")


def run_trl(ctx: Any, o: TrainOptions, train: Any, evaluation: Any | None, *, packing: bool,
            packing_strategy: str = "bfd", trainer_cls: type | None = None, config: dict[str, Any] | None = None,
            **trainer_kwargs: Any) -> dict[str, Any]:
    """Train ``ctx.model`` with TRL's SFTTrainer on pre-tokenized ``input_ids``/``labels``.
    ``trainer_cls`` replaces ``trl.SFTTrainer`` (a subclass of it), ``config`` adds or overrides
    ``SFTConfig`` fields and ``trainer_kwargs`` go to the trainer, as in :func:`run_trainer`."""
    from trl import SFTConfig, SFTTrainer

    from ftcore_plugins.trainers._sequence_parallel import row_multiple

    # Sequence parallelism gives each process an equal slice of every row's columns. Its dataloader gathers
    # every process's batch, which gloo does only for batches of one shape: on it, rows are padded to max_length.
    size = row_multiple(ctx.run.plan)
    columns = {} if size == 1 else {"pad_to_multiple_of": size if ctx.run.plan.distributed.resolved_backend()
                                    != "gloo" or not o.max_length else o.max_length}
    _, metrics = run_trainer(ctx, o, trainer_cls or SFTTrainer, SFTConfig, train=train, evaluation=evaluation,
                             config={"max_length": o.max_length, "packing": packing, **columns,
                                     "packing_strategy": packing_strategy, "dataset_num_proc": None, **(config or {})},
                             **trainer_kwargs)
    return metrics


def tokenize_splits(ctx: Any, *, max_length: int | None, truncation: str = "truncate_response",
                    train_on_inputs: bool = False, batch_size: int = 8,
                    packed_length: int | None = None, packing: bool = True, seq2seq: bool = False) -> tuple[Any, Any]:
    """Tokenize the stage's train and eval rows (cached), and report what was kept,
    truncated and dropped, the length percentiles and, for ``packed_length``, the padding batches of
    ``batch_size`` rows carry and, with ``packing``, how packing into ``packed_length`` blocks fills them.
    ``seq2seq``: for an encoder-decoder model (``common/seq2seq.py``)."""
    from ftcore.errors import FtcoreError

    from ftcore_plugins.common.prepare import data_origin, is_stream, packing_report, prepare, stream_tokenized

    out, shown = [], []
    for label, rows in (("train", ctx.train_data), ("eval", ctx.eval_data)):
        if rows is None:
            out.append(None)
            continue
        where, on_error = data_origin(ctx, label)
        if is_stream(rows):
            out.append(stream_tokenized(rows, ctx.tokenizer, ctx.template, max_length=max_length,
                                        truncation=truncation, train_on_inputs=train_on_inputs, on_error=on_error,
                                        where=where, seq2seq=seq2seq))
            ctx.reporter.info(f"stage [bold]{ctx.stage}[/] {label} data streams: tokenized as training reads it, "
                              "not cached")
            continue
        prepared = prepare(rows, ctx.tokenizer, ctx.template, max_length=max_length, truncation=truncation,
                           train_on_inputs=train_on_inputs, reporter=ctx.reporter,
                           description=f"tokenize {label}", on_error=on_error, where=where, seq2seq=seq2seq)
        stats = dict(prepared.stats, cache="hit" if prepared.cache_hit else "miss")
        if packed_length and stats["kept"]:
            stats.update(packing_report(prepared.dataset, packed_length, batch_size, packed=packing))
        ctx.reporter.data_report(f"{ctx.stage}/{label}", stats)
        ctx.reporter.log(ctx.stage, {f"data/{label}_{k}": v for k, v in stats.items() if k != "cache"})
        shown.append([label, stats["rows"], stats["kept"], stats["truncated"],
                      stats["dropped_too_long"] + stats["dropped_no_labels"] + stats.get("skipped_unrenderable", 0),
                      stats["tokens"],
                      stats["label_tokens"], f"{stats.get('length_p50', 0)}/{stats.get('length_p90', 0)}/"
                      f"{stats.get('length_max', 0)}", stats["cache"]])
        if not stats["kept"]:
            raise FtcoreError(f"{where}: no {label} sample of stage {ctx.stage} is left with a token to learn "
                              f"after masking and max_length={max_length} ({truncation})"
                              + ("; see data_report.json" if ctx.reporter.metrics_path else ""))
        out.append(prepared.dataset)
    if shown:
        more = " (data_report.json has more)" if ctx.reporter.metrics_path else ""
        ctx.reporter.table(f"data for stage {ctx.stage}{more}",
                           ["split", "rows", "kept", "trunc.", "dropped", "tokens", "trained", "length", "cache"],
                           shown)
    return out[0], out[1]
