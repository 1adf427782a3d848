"""``sft`` on an encoder-decoder model (T5, Flan-T5, mT5, BART): transformers' ``Seq2SeqTrainer`` with its
``DataCollatorForSeq2Seq`` on rows made by ``common/seq2seq.py`` (the prompt as the encoder's input, the
answer and EOS as labels), through ``run_trainer`` like every stage (checkpoints, resume, the stability
guard, progress, metrics). The loss is the model's own cross-entropy over the answer's tokens.

What the causal path offers and an encoder-decoder cannot use is refused by ``ftcore validate``, in one
line each (:func:`seq2seq_problems`): packing (it concatenates samples into one causal row), the loss
kernels (they shift the labels of one causal sequence), ``train_on_inputs`` (the prompt is never a target:
the decoder does not write it), a loss or TRL trainer of a subclass's own.
"""

from __future__ import annotations

from typing import Any

from ftcore_plugins.common.seq2seq import refusal


def seq2seq_problems(trainer: Any, family: str) -> list[str]:
    """``check(plan)`` problems of an ``sft`` (or subclass) stage's options on an encoder-decoder model."""
    from ftcore_plugins.trainers.sft import SFT

    o, name = trainer.options, trainer.name
    problems = []
    if getattr(o, "packing", False):
        why = "it joins samples into one causal sequence, and an encoder-decoder reads each prompt in its encoder"
        problems.append(f"packing: {refusal('packing', family, why, 'set packing = false')}")
    if getattr(o, "train_on_inputs", False):
        problems.append(f"train_on_inputs: the {family} model's decoder writes the answer alone, so its prompt "
                        "cannot be trained on; remove train_on_inputs")
    key = "liger" if getattr(o, "liger", False) else "loss_kernel" if getattr(o, "loss_kernel", "auto") != "auto" \
        else None
    if key is not None:
        why = "the loss kernels compute a causal LM head over shifted labels"
        problems.append(f"{key}: {refusal(key, family, why, 'remove it: the model computes its own loss')}")
    if getattr(o, "log_entropy", False):
        why = "the entropy is measured by the causal loss kernels"
        problems.append(f"log_entropy: {refusal('log_entropy', family, why, 'remove it')}")
    own = [k for k in ("compute_loss", "trainer_class", "trl_config")
           if getattr(type(trainer), k) is not getattr(SFT, k)]
    if own:
        problems.append(refusal(f"trainer '{name}'", family, f"it replaces {', '.join(own)}, which the encoder-decoder "
                                "path (transformers' Seq2SeqTrainer) does not use"))
    return problems


def run_seq2seq(ctx: Any, o: Any, train: Any, evaluation: Any | None, config: dict[str, Any]) -> dict[str, Any]:
    """Train ``ctx.model`` on tokenized ``input_ids``/``labels`` rows with ``Seq2SeqTrainer``; ``config``
    adds ``Seq2SeqTrainingArguments`` fields. Returns the stage's metrics."""
    from transformers import DataCollatorForSeq2Seq, Seq2SeqTrainer, Seq2SeqTrainingArguments

    from ftcore_plugins.common.chat import IGNORE
    from ftcore_plugins.trainers._training import run_trainer

    class CountingTrainer(Seq2SeqTrainer):
        """Counts the real tokens it trains on (the prompts' and the answers'), as TRL's trainers do, for
        the stage's ``train_tokens``."""

        _total_train_tokens = 0

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            if model.training:
                real = inputs["attention_mask"].sum() + (inputs["labels"] != IGNORE).sum()
                self._total_train_tokens += int(self.accelerator.gather_for_metrics(real.reshape(1)).sum())
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)

    tokenizer = ctx.tokenizer
    # The model shifts the labels right itself; the collator pads them with IGNORE and the prompts on the
    # right (BART's learned positions count from the first token).
    collator = DataCollatorForSeq2Seq(tokenizer, model=ctx.model, label_pad_token_id=IGNORE)
    side, tokenizer.padding_side = tokenizer.padding_side, "right"
    try:
        _, metrics = run_trainer(ctx, o, CountingTrainer, Seq2SeqTrainingArguments, train=train,
                                 evaluation=evaluation, config=config, data_collator=collator)
    finally:
        tokenizer.padding_side = side
    return metrics
