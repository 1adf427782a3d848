"""Trainer ``sft``: supervised fine-tuning on chat rows with TRL's SFTTrainer, assistant-only loss.

``SFT`` is also the public base for trainers built on it (import it from
``ftcore_plugins.trainers.base``; docs/trainers.md, "Extending sft"): a subclass changes the
options, the data preparation, the TRL config, the TRL trainer class or the loss, and keeps what
``run_trl`` gives every stage (checkpoints, ``--resume``, the stability guard, progress, metrics,
signal handling) and the memory estimate.
"""

from __future__ import annotations

from typing import Any, Literal

import ftcore
from ftcore.component import Component
from ftcore.errors import FtcoreError

from ftcore_plugins.common.chat import chosen_as_chat
from ftcore_plugins.common.estimate import TrainerMemory
from ftcore_plugins.common.prepare import data_origin, is_stream
from ftcore_plugins.common.seq2seq import is_encoder_decoder, plan_encoder_decoder
from ftcore_plugins.trainers._hybrid import packing_model_problem
from ftcore_plugins.trainers._loss import LossOptions, across_ranks, full_cross_entropy, \
    loss_problems, record_token_metrics, resolve_kernel, sharded_head, with_chunked_loss
from ftcore_plugins.common.device_defaults import defaults, device_type, optimizer_for, training_device
from ftcore_plugins.common.qat import QatOptions
from ftcore_plugins.trainers._packing import BINNED, PACKED_PATHS, choose_path, fixed_width, passed_over, \
    path_problem, with_packed_attention
from ftcore_plugins.trainers._qat import activation_bytes as qat_activation_bytes, plan_problems as qat_problems
from ftcore_plugins.trainers._router import stage_coefficient
from ftcore_plugins.trainers._training import TrainChecks, TrainOptions, run_trl, tokenize_splits
from ftcore_plugins.trainers._vision import image_rows, save_processor, vision_splits, vision_trl


class SFTOptions(TrainOptions, LossOptions):
    """The ``sft`` stage's options: the shared training options, the loss's, and these."""

    train_on_inputs: bool = False  # also train on system/user tokens
    truncation: Literal["truncate_response", "truncate_prompt", "drop"] = "truncate_response"
    packing: bool = False  # best-fit packing, position ids reset per sample (no cross-sample attention)
    # the attention of packed batches; auto: the device's fastest that runs (docs/trainers.md)
    packed_attention: Literal[("auto", *PACKED_PATHS)] = "auto"  # type: ignore[valid-type]
    # quantization-aware training (torchao): the linear layers train fake-quantized to this scheme
    qat: QatOptions | None = None


class SFT(TrainChecks, TrainerMemory, Component):
    """Supervised fine-tuning (TRL SFTTrainer); loss on every assistant turn only."""

    name = "sft"
    Options = SFTOptions
    streams = True  # trains from a streaming source (tokenized as it reads, max_steps required)
    supports_images = True  # trains on chat rows with images (trainers/_vision.py)
    # Also trains encoder-decoder models (T5, BART: trainers/_seq2seq.py); a trainer that is False is refused one.
    encoder_decoder = True

    # Override point: set to a method ``compute_loss(self, outputs, labels, num_items_in_batch=None)``
    # to replace the loss. ``outputs`` is the model's output (``outputs.logits``: batch x length x
    # vocabulary), ``labels`` the unshifted labels (-100 where nothing is learnt: position i predicts
    # ``labels[:, i + 1]``), ``num_items_in_batch`` the trainable tokens of all the step's
    # micro-batches (divide by it, as gradient accumulation expects) or None. Returns a scalar tensor.
    # It is used for the training loss and the eval loss alike.
    compute_loss = None
    loss_chunk_elements: int | None = None  # logits per chunk of the chunked loss; None: the device's (device_defaults)

    def check(self, plan: Any) -> list[str]:
        o = self.options
        problems = [*super().check(plan), *loss_problems(o), *qat_problems(self, plan)]
        path = getattr(o, "packed_attention", "auto")
        if path != "auto" and (problem := path_problem(path, device_type())):
            problems.append(f"packed_attention: {problem}; use \"auto\" (the fastest path this machine runs)")
        family = plan_encoder_decoder(plan) if any(s.trainer.options is o for s in plan.stages) else None
        if family is not None and self.encoder_decoder:
            from ftcore_plugins.trainers._seq2seq import seq2seq_problems

            problems += seq2seq_problems(self, family)  # packing among them
        elif getattr(o, "packing", False) and (problem := packing_model_problem(plan)):
            problems.append(problem)
        return problems

    def activation_bytes(self, model_config: Any, batch_size: int, seq_len: int, checkpointing: bool, *,
                         model: Any = None, device: str = "cpu", precision: str = "fp32", row_split: int = 1,
                         tp_size: int = 1) -> int:
        """The shared estimate (``TrainerMemory``), plus what ``qat`` keeps for backward."""
        return super().activation_bytes(model_config, batch_size, seq_len, checkpointing, model=model, device=device,
                                         precision=precision, row_split=row_split, tp_size=tp_size) + \
            qat_activation_bytes(getattr(self.options, "qat", None), model, checkpointing)

    def train(self, ctx: Any) -> dict[str, Any]:
        self.collator = None  # set by prepare_data for rows with images (trainers/_vision.py)
        train, evaluation = self.prepare_data(ctx)
        o = self.options
        if self.encoder_decoder and is_encoder_decoder(ctx.model):
            from ftcore_plugins.trainers._seq2seq import run_seq2seq

            ctx.reporter.log(ctx.stage, {"optimizer": optimizer_for(o.optimizer, training_device())}, step=0)
            return run_seq2seq(ctx, o, train, evaluation, {"neftune_noise_alpha": o.neftune_noise_alpha})
        trainer_cls = self.trainer_class(ctx)
        # Liger's layer kernels through TRL (which leaves the loss to us); NEFTune through transformers.
        config = {"use_liger_kernel": o.liger, "neftune_noise_alpha": o.neftune_noise_alpha, **self.trl_config(ctx)}
        chosen = self.device_choices(ctx, training_device(), config)
        ctx.reporter.log(ctx.stage, {k: v for k, v in chosen.items()
                                     if k in ("loss_kernel", "packed_attention", "optimizer") and v is not None}, step=0)
        if chosen.get("packed_attention_note"):
            ctx.reporter.info(f"stage {ctx.stage}: packed_attention {chosen['packed_attention']}: "
                              f"{chosen['packed_attention_note']}")
        kernel = chosen["loss_kernel"]
        if self.compute_loss is not None:
            trainer_cls = with_loss(trainer_cls, self.compute_loss)
        elif kernel in ("chunked", "liger"):
            trainer_cls = with_chunked_loss(trainer_cls, entropy=o.log_entropy, liger=kernel == "liger",
                                            chunk=chosen["loss_chunk_elements"])
        elif kernel == "full":
            trainer_cls = with_loss(trainer_cls, full_cross_entropy, entropy=o.log_entropy)
        if (path := chosen["packed_attention"]) is not None:
            width = chosen["packed_width"]
            if self.collator is not None:  # rows with images: their collator packs (trainers/_vision.py)
                self.collator.binned, self.collator.width = path in BINNED, width
            trainer_cls = with_packed_attention(trainer_cls, path, collator=self.collator is None, width=width)
        extra: dict[str, Any] = {}
        if self.collator is not None:
            vision_config, extra = vision_trl(self.collator)
            config.update(vision_config)
        metrics = run_trl(ctx, o, train, evaluation, packing=False, trainer_cls=trainer_cls, config=config, **extra)
        if self.collator is not None:
            save_processor(ctx, self.collator.encoder.processor)
        return metrics

    def device_choices(self, ctx: Any, device: str, config: dict[str, Any] | None = None) -> dict[str, Any]:
        """What the stage runs when it trains on ``device`` (``"cuda"``, ``"cpu"``: the device the Trainer
        will put the model on, never where the loaded model sits now), each ``auto`` option resolved from
        that device's defaults (``common/device_defaults.py``): ``loss_kernel`` (``compute_loss`` for a
        subclass's own), ``loss_chunk_elements``, ``optimizer``, ``packed_attention`` (None unless
        samples are packed into bins), ``packed_attention_note`` (why the device's first path was passed
        over, or None) and ``packed_width`` (the fixed width of a binned batch's rows, or None)."""
        o = self.options
        config = self.trl_config(ctx) if config is None else config
        if self.compute_loss is not None:
            kernel = "compute_loss"
        else:
            kernel = resolve_kernel(o.loss_kernel, ctx.model, device=device, sharded=sharded_head(ctx.run),
                                    liger=o.liger, aux_loss=stage_coefficient(ctx.model, o) > 0)
        chosen: dict[str, Any] = {
            "loss_kernel": kernel,
            "loss_chunk_elements": self.loss_chunk_elements or defaults(device).loss_chunk_elements,
            "optimizer": optimizer_for(o.optimizer, device),
            "packed_attention": None, "packed_attention_note": None, "packed_width": None}
        # Packed batches of samples (not pretrain's wrapped blocks, which have no sample boundaries).
        if config.get("packing") and config.get("packing_strategy") != "wrapped":
            option = getattr(o, "packed_attention", "auto")
            path = choose_path(option, ctx.model, device)
            chosen["packed_attention"] = path
            chosen["packed_attention_note"] = passed_over(option, ctx.model, device, path)
            chosen["packed_width"] = fixed_width(path, o.max_length)
        return chosen

    # -- override points ---------------------------------------------------------------------
    def prepare_data(self, ctx: Any) -> tuple[Any, Any]:
        """The tokenized train and eval datasets (eval None without ``eval_data``): rows with
        ``input_ids`` and ``labels`` (-100 on tokens not trained on). A subclass may change
        ``ctx.train_data``/``ctx.eval_data`` (chat rows) and call this, or build the datasets itself."""
        o = self.options
        ctx.train_data, ctx.eval_data = chosen_as_chat(ctx.train_data), chosen_as_chat(ctx.eval_data)
        if image_rows(ctx):
            train, evaluation, self.collator = vision_splits(ctx, o, self.name)
            return train, evaluation
        columns = set(ctx.train_data.column_names)
        if "messages" not in columns and not {"prompt", "completion"} <= columns:
            raise FtcoreError(f"{data_origin(ctx, 'train')[0]}: trainer '{self.name}' (stage {ctx.stage}) needs "
                              "chat rows (messages, Alpaca, "
                              f"ShareGPT, ...) or prompt/completion rows; this data has {', '.join(sorted(columns))}"
                              + ("; for plain text use trainer = \"pretrain\"" if "text" in columns else ""))
        if "messages" in columns and not o.train_on_inputs:
            for label, rows in (("train", ctx.train_data), ("eval", ctx.eval_data)):
                unanswered(rows, data_origin(ctx, label)[0], self.name)
        if self.encoder_decoder and is_encoder_decoder(ctx.model):  # the prompt as encoder input, the answer as labels
            return tokenize_splits(ctx, max_length=o.max_length, truncation=o.truncation, batch_size=o.batch_size,
                                   seq2seq=True)
        return tokenize_splits(ctx, max_length=o.max_length, truncation=o.truncation,
                               train_on_inputs=o.train_on_inputs, batch_size=o.batch_size,
                               packed_length=o.max_length, packing=o.packing)

    def trl_config(self, ctx: Any) -> dict[str, Any]:
        """``trl.SFTConfig`` fields on top of those the shared options set (``training_arguments``).
        A subclass extends it: ``{**super().trl_config(ctx), "loss_type": "dft"}``."""
        return {"packing": self.options.packing, "packing_strategy": "bfd"}

    def trainer_class(self, ctx: Any) -> type:
        """The TRL trainer class: ``trl.SFTTrainer`` or a subclass of it."""
        from trl import SFTTrainer as TrlSFTTrainer

        return TrlSFTTrainer


SFTTrainer = SFT  # the name before SFT became public; kept for existing imports


def with_loss(trainer_cls: type, loss: Any, *, entropy: bool = True) -> type:
    """A subclass of the TRL ``SFTTrainer`` class ``trainer_cls`` whose loss is
    ``loss(outputs, labels, num_items_in_batch)``, computed from one forward pass with the full
    logits. It keeps the metrics TRL's own ``compute_loss`` records (token accuracy, entropy unless
    ``entropy`` is False, tokens seen: the stage's ``train_tokens``), computed from the same logits.
    (TRL's ``compute_loss_func`` argument would do it with a second forward pass, and is deprecated.)"""
    import torch

    class CustomLoss(trainer_cls):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            mode = "train" if self.model.training else "eval"
            labels = inputs["labels"]
            inputs = {k: v for k, v in inputs.items() if k != "labels"}
            # The router's loss, where the stage turned it on (TRL's SFTTrainer read its coefficient).
            router = getattr(self, "aux_loss_enabled", False)
            outputs = model(**inputs, use_cache=False, **({"output_router_logits": True} if router else {}))
            value = loss(outputs, labels, num_items_in_batch)
            value = across_ranks(self, value, num_items_in_batch)
            aux = outputs.aux_loss if router else None
            if aux is not None:  # as TRL adds it: a micro-batch's mean, spread over the accumulated steps
                steps = self.current_gradient_accumulation_steps if num_items_in_batch is not None else 1
                value = value + self.router_aux_loss_coef * aux.to(value.device) / steps
            with torch.no_grad():
                # Past the virtual tokens prompt tuning prepends to the logits.
                logits = outputs.logits[:, -labels.size(1):-1]
                targets = labels[:, 1:].to(logits.device)
                mask = targets != -100
                entropy_sum = None
                if entropy:
                    logp = torch.log_softmax(logits.float(), dim=-1)
                    entropy_sum = (-(logp.exp() * logp).sum(-1) * mask).sum()
                record_token_metrics(self, mode, inputs, mask.sum(), ((logits.argmax(-1) == targets) & mask).sum(),
                                     entropy_sum, aux)
            return (value, outputs) if return_outputs else value

    CustomLoss.__name__ = CustomLoss.__qualname__ = f"{trainer_cls.__name__}WithLoss"
    return CustomLoss


def unanswered(rows: Any, where: str, trainer: str) -> None:
    """Refuse chat rows with no assistant turn: the data layer keeps them (generating trainers and
    evaluators take prompts alone), but trained on assistant turns only, they teach nothing."""
    if rows is None or is_stream(rows):  # a stream is not read ahead: such rows are dropped as they come (nothing to learn)
        return
    index = 0
    for batch in rows.select_columns(["messages"]).iter(batch_size=1000):
        for messages in batch["messages"]:
            index += 1
            if not any(m.get("role") == "assistant" for m in messages or []):
                roles = ", ".join(str(m.get("role")) for m in messages or []) or "none"
                raise FtcoreError(f"{where}, row {index}: 'messages' has no assistant turn, so trainer '{trainer}' "
                                  f"has nothing to train on (roles: {roles}); add the answer, or set "
                                  "train_on_inputs = true to train on the whole conversation")


@ftcore.hookimpl
def register_trainers(register):
    register(SFT)
