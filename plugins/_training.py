"""What the SFT and pre-training trainers share: options, the TRL run, progress and metrics."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal

from ftcore.component import Options


class TrainOptions(Options):
    epochs: float = 1.0
    max_steps: int = -1  # overrides epochs when > 0
    learning_rate: float = 2e-4
    batch_size: int = 8
    gradient_accumulation_steps: int = 1
    max_length: int = 512
    lr_scheduler: str = "linear"
    warmup_ratio: float = 0.0
    weight_decay: float = 0.0
    optimizer: str = "adamw_torch"
    gradient_checkpointing: bool = False
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"  # auto: bf16 on a GPU that has it, else fp32
    logging_steps: int = 10
    save_steps: int = 50  # checkpoint every N steps, for --resume
    save_total_limit: int = 2


def trainable_counts(model: Any) -> dict[str, Any]:
    """Trainable and total parameters, and the trainable share in percent (4-bit weights counted
    unpacked, as peft does)."""
    trainable = total = 0
    for p in model.parameters():
        n = p.numel()
        if p.__class__.__name__ == "Params4bit":  # two 4-bit values per stored byte
            n *= 2 * (p.element_size() if hasattr(p, "element_size") else 1)
        total += n
        trainable += n if p.requires_grad else 0
    return {"trainable_params": trainable, "total_params": total,
            "trainable_percent": 100.0 * trainable / total if total else 0.0}


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
            if self._cm is not None:
                self._cm.__exit__(None, None, None)
                self._cm = None

    return RichProgress()


def checkpoint_marker():
    """Writes ``COMPLETE.json`` into each checkpoint once the Trainer has saved all of it: resume
    (the runner's ``_last_checkpoint``) only picks marked checkpoints, so a killed save is skipped."""
    from transformers import TrainerCallback

    from ftcore import rundir

    class CheckpointMarker(TrainerCallback):
        def on_save(self, args, state, control, **kw):
            if state.is_world_process_zero:
                folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
                if folder.is_dir():
                    rundir.write_json(folder / rundir.COMPLETE, {"global_step": state.global_step,
                                                                 "finished_at": rundir.now()})

    return CheckpointMarker()


def resolve_precision(precision: str) -> str:
    """``auto``: bf16 on a GPU that has it, else fp32."""
    import torch

    if precision != "auto":
        return precision
    return "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "fp32"


def training_arguments(ctx: Any, o: TrainOptions, evaluation: Any | None) -> dict[str, Any]:
    """The TrainingArguments every trainer shares, from the stage's options."""
    import torch

    precision = resolve_precision(o.precision)
    return dict(
        output_dir=str(ctx.checkpoint_dir),
        num_train_epochs=o.epochs,
        max_steps=o.max_steps,
        per_device_train_batch_size=o.batch_size,
        per_device_eval_batch_size=o.batch_size,
        gradient_accumulation_steps=o.gradient_accumulation_steps,
        learning_rate=o.learning_rate,
        lr_scheduler_type=o.lr_scheduler,
        warmup_steps=o.warmup_ratio,  # a float below 1 is a ratio of the total steps
        weight_decay=o.weight_decay,
        optim=o.optimizer,
        activation_checkpointing=o.gradient_checkpointing,
        bf16=precision == "bf16",
        fp16=precision == "fp16",
        logging_steps=o.logging_steps,
        save_strategy="steps",
        save_steps=o.save_steps,
        save_total_limit=o.save_total_limit,
        eval_strategy="epoch" if evaluation is not None else "no",
        report_to="none",
        disable_tqdm=True,
        seed=ctx.seed,
        dataloader_pin_memory=torch.cuda.is_available(),
    )


def run_trainer(ctx: Any, o: TrainOptions, trainer_cls: type, config_cls: type, *, train: Any,
                evaluation: Any | None, config: dict[str, Any] | None = None,
                **trainer_kwargs: Any) -> tuple[Any, dict[str, Any]]:
    """Train ``ctx.model`` with a transformers/TRL ``trainer_cls`` configured by ``config_cls``
    (e.g. ``DPOTrainer``/``DPOConfig``): the shared arguments, callbacks, resume and metrics.
    ``config`` adds or overrides config fields; ``trainer_kwargs`` go to the trainer.
    Returns the trainer and the stage's final metrics."""
    import torch
    from transformers import PrinterCallback

    args = config_cls(**{**training_arguments(ctx, o, evaluation), **(config or {})})
    # An adapter that brings its own optimizer (loraplus) builds it: ``adapter.optimizer(model, args)``.
    # Passed as a factory, the Trainer builds it once the model is on its device.
    build = getattr(ctx.adapter, "optimizer", None)
    if build is not None:
        trainer_kwargs.setdefault("optimizer_cls_and_kwargs", ((lambda: lambda model: build(model, args)), {}))
    counts = trainable_counts(ctx.model)
    ctx.reporter.log(ctx.stage, counts, step=0)
    trainer = trainer_cls(model=ctx.model, args=args, train_dataset=train, eval_dataset=evaluation,
                          processing_class=ctx.tokenizer,
                          callbacks=[progress_callback(ctx.reporter, ctx.stage), checkpoint_marker()],
                          **trainer_kwargs)
    trainer.remove_callback(PrinterCallback)  # our progress bar and metrics.jsonl replace its prints
    # TRL casts the trainable weights of a quantized model to bf16 when it builds the trainer;
    # adapters train in fp32 (QLoRA keeps only the frozen base in low precision).
    if getattr(trainer.model, "is_quantized", False) or getattr(trainer.model, "is_loaded_in_4bit", False) \
            or getattr(trainer.model, "is_loaded_in_8bit", False):
        for p in trainer.model.parameters():
            if p.requires_grad and p.dtype != torch.float32:
                p.data = p.data.float()
    result = trainer.train(resume_from_checkpoint=str(ctx.resume_from) if ctx.resume_from else None)
    ctx.model = trainer.model
    metrics: dict[str, Any] = {"train_loss": result.training_loss, "global_step": result.global_step,
                               "train_seconds": result.metrics.get("train_runtime"), **counts}
    # Real (non-padding) tokens, as counted by TRL from the attention masks it trained on.
    tokens = [h["num_tokens"] for h in trainer.state.log_history if "num_tokens" in h]
    if tokens:
        metrics["train_tokens"] = int(tokens[-1])
        if metrics["train_seconds"]:
            metrics["tokens_per_second"] = tokens[-1] / metrics["train_seconds"]
    evals = [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h]
    if evals:
        metrics["eval_loss"] = evals[-1]
        metrics["eval_perplexity"] = math.exp(min(evals[-1], 50))
    return trainer, metrics


def run_trl(ctx: Any, o: TrainOptions, train: Any, evaluation: Any | None, *, packing: bool,
            packing_strategy: str = "bfd") -> dict[str, Any]:
    """Train ``ctx.model`` with TRL's SFTTrainer on pre-tokenized ``input_ids``/``labels``."""
    from trl import SFTConfig, SFTTrainer

    _, metrics = run_trainer(ctx, o, SFTTrainer, SFTConfig, train=train, evaluation=evaluation,
                             config=dict(max_length=o.max_length, packing=packing,
                                         packing_strategy=packing_strategy, dataset_num_proc=None))
    return metrics


def tokenize_splits(ctx: Any, *, max_length: int | None, truncation: str = "truncate_response",
                    train_on_inputs: bool = False, batch_size: int = 8,
                    packed_length: int | None = None) -> tuple[Any, Any]:
    """Tokenize the stage's train and eval rows (cached), and report what was kept,
    truncated and dropped, the length percentiles and, for ``packed_length``, packing."""
    from ftcore.errors import FtcoreError

    from ._prepare import packing_report, prepare

    out, shown = [], []
    for label, rows in (("train", ctx.train_data), ("eval", ctx.eval_data)):
        if rows is None:
            out.append(None)
            continue
        prepared = prepare(rows, ctx.tokenizer, ctx.template, max_length=max_length, truncation=truncation,
                           train_on_inputs=train_on_inputs, reporter=ctx.reporter,
                           description=f"tokenize {label}")
        stats = dict(prepared.stats, cache="hit" if prepared.cache_hit else "miss")
        if packed_length and stats["kept"]:
            stats.update(packing_report(prepared.dataset, packed_length, batch_size))
        ctx.reporter.data_report(f"{ctx.stage}/{label}", stats)
        ctx.reporter.log(ctx.stage, {f"data/{label}_{k}": v for k, v in stats.items() if k != "cache"})
        shown.append([label, stats["rows"], stats["kept"], stats["truncated"],
                      stats["dropped_too_long"] + stats["dropped_no_labels"], stats["tokens"],
                      stats["label_tokens"], f"{stats.get('length_p50', 0)}/{stats.get('length_p90', 0)}/"
                      f"{stats.get('length_max', 0)}", stats["cache"]])
        if not stats["kept"]:
            raise FtcoreError(f"stage {ctx.stage}: no {label} sample is left with a token to learn after "
                              f"masking and max_length={max_length} ({truncation}); see data_report.json")
        out.append(prepared.dataset)
    ctx.reporter.table(f"data for stage {ctx.stage} (data_report.json has more)",
                       ["split", "rows", "kept", "trunc.", "dropped", "tokens", "trained", "length", "cache"],
                       shown)
    return out[0], out[1]
