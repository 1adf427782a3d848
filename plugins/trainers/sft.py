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

from ftcore_plugins.common.estimate import TrainerMemory
from ftcore_plugins.trainers._training import TrainChecks, TrainOptions, data_origin, run_trl, tokenize_splits


class SFTOptions(TrainOptions):
    """The ``sft`` stage's options: the shared training options and these three."""

    train_on_inputs: bool = False  # also train on system/user tokens
    truncation: Literal["truncate_response", "truncate_prompt", "drop"] = "truncate_response"
    packing: bool = False  # best-fit packing, position ids reset per sample (no cross-sample attention)


class SFT(TrainChecks, TrainerMemory, Component):
    """Supervised fine-tuning (TRL SFTTrainer); loss on every assistant turn only."""

    name = "sft"
    Options = SFTOptions

    # Override point: set to a method ``compute_loss(self, outputs, labels, num_items_in_batch=None)``
    # to replace the loss. ``outputs`` is the model's output (``outputs.logits``: batch x length x
    # vocabulary), ``labels`` the unshifted labels (-100 where nothing is learnt: position i predicts
    # ``labels[:, i + 1]``), ``num_items_in_batch`` the trainable tokens of all the step's
    # micro-batches (divide by it, as gradient accumulation expects) or None. Returns a scalar tensor.
    # It is used for the training loss and the eval loss alike.
    compute_loss = None

    def train(self, ctx: Any) -> dict[str, Any]:
        train, evaluation = self.prepare_data(ctx)
        trainer_cls = self.trainer_class(ctx)
        if self.compute_loss is not None:
            trainer_cls = with_loss(trainer_cls, self.compute_loss)
        return run_trl(ctx, self.options, train, evaluation, packing=False, trainer_cls=trainer_cls,
                       config=self.trl_config(ctx))

    # -- override points ---------------------------------------------------------------------
    def prepare_data(self, ctx: Any) -> tuple[Any, Any]:
        """The tokenized train and eval datasets (eval None without ``eval_data``): rows with
        ``input_ids`` and ``labels`` (-100 on tokens not trained on). A subclass may change
        ``ctx.train_data``/``ctx.eval_data`` (chat rows) and call this, or build the datasets itself."""
        o = self.options
        ctx.train_data, ctx.eval_data = chosen_as_chat(ctx.train_data), chosen_as_chat(ctx.eval_data)
        columns = set(ctx.train_data.column_names)
        if "messages" not in columns and not {"prompt", "completion"} <= columns:
            raise FtcoreError(f"{data_origin(ctx, 'train')[0]}: trainer '{self.name}' (stage {ctx.stage}) needs "
                              "chat rows (messages, Alpaca, "
                              f"ShareGPT, ...) or prompt/completion rows; this data has {', '.join(sorted(columns))}"
                              + ("; for plain text use trainer = \"pretrain\"" if "text" in columns else ""))
        if "messages" in columns and not o.train_on_inputs:
            for label, rows in (("train", ctx.train_data), ("eval", ctx.eval_data)):
                unanswered(rows, data_origin(ctx, label)[0], self.name)
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


def with_loss(trainer_cls: type, loss: Any) -> type:
    """A subclass of the TRL ``SFTTrainer`` class ``trainer_cls`` whose loss is
    ``loss(outputs, labels, num_items_in_batch)``, computed from one forward pass with the full
    logits. It keeps the metrics TRL's own ``compute_loss`` records (token accuracy, entropy,
    tokens seen: the stage's ``train_tokens``), computed from the same logits. (TRL's
    ``compute_loss_func`` argument would do it with a second forward pass, and is deprecated.)"""
    import torch

    class CustomLoss(trainer_cls):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            mode = "train" if self.model.training else "eval"
            labels = inputs["labels"]
            inputs = {k: v for k, v in inputs.items() if k != "labels"}
            outputs = model(**inputs, use_cache=False)
            value = loss(outputs, labels, num_items_in_batch)
            # As TRL's loss: num_items_in_batch counts every rank's tokens, and DDP averages over ranks.
            if self.args.average_tokens_across_devices and num_items_in_batch is not None:
                value = value * (self.accelerator.num_processes // self.get_tp_size())
            with torch.no_grad():
                logits, targets = outputs.logits[:, :-1], labels[:, 1:].to(outputs.logits.device)
                mask = targets != -100
                logp = torch.log_softmax(logits.float(), dim=-1)
                entropy = -(logp.exp() * logp).sum(-1)
                gather = self.accelerator.gather_for_metrics
                n = gather(mask.sum()).sum()
                correct = gather(((logits.argmax(-1) == targets) & mask).sum()).sum()
                entropy_sum = gather((entropy * mask).sum()).sum()
                self._metrics[mode]["entropy"].append((entropy_sum / n).item() if n > 0 else 0.0)
                self._metrics[mode]["mean_token_accuracy"].append((correct / n).item() if n > 0 else 0.0)
                if mode == "train":
                    if "attention_mask" in inputs:
                        tokens = gather(inputs["attention_mask"].sum()).sum().item()
                    else:  # padding-free packing: one row of position ids
                        tokens = gather(torch.tensor(inputs["position_ids"].size(1),
                                                     device=logits.device)).sum().item()
                    self._total_train_tokens += tokens // self._tp_size
                self._metrics[mode]["num_tokens"] = [self._total_train_tokens]
            return (value, outputs) if return_outputs else value

    CustomLoss.__name__ = CustomLoss.__qualname__ = f"{trainer_cls.__name__}WithLoss"
    return CustomLoss


def chosen_as_chat(data):
    """Preference pairs train SFT on their chosen answers: prompt + chosen as one chat
    (the usual first stage of SFT -> reward model -> PPO)."""
    if data is None or not {"prompt", "chosen"} <= set(data.column_names) or \
            not isinstance(data[0]["prompt"], list):
        return data
    return data.map(lambda row: {"messages": row["prompt"] + row["chosen"]},
                    remove_columns=data.column_names)


def unanswered(rows: Any, where: str, trainer: str) -> None:
    """Refuse chat rows with no assistant turn: the data layer keeps them (generating trainers and
    evaluators take prompts alone), but trained on assistant turns only, they teach nothing."""
    if rows is None:
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
