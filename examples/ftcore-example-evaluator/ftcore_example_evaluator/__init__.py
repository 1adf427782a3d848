"""An example third-party ftcore plugin: the ``answer_length`` evaluator (and, in
:mod:`.target_length`, the ``target_length`` reward function).

It greedy-generates an answer to every held-out chat prompt and reports how long the
answers are and how many of them end on their own. After fine-tuning a chat model you
want short, terminated answers; a model that rambles until ``max_new_tokens`` has not
learned where a turn ends (a missing or mis-masked end-of-turn token is the usual
cause), which perplexity and exact match alone do not tell you.

Metrics:

* ``mean_tokens``: mean number of generated tokens per answer, not counting the token
  that ended it;
* ``stop_rate``: share of answers that ended with an end-of-turn/EOS token before
  ``max_new_tokens``;
* ``mean_reference_tokens``: mean length of the reference answers (the rows' last
  assistant turns), when the data has them, to compare ``mean_tokens`` with;
* ``n``: number of prompts.

Each answer is also written to ``answers.jsonl`` in the evaluation's folder.

Rows with images (a vision-language model's held-out questions about pictures) are answered from
their pictures: the class declares ``supports_images = True``, renders each ``<image>`` as an
image part, and makes the model's inputs with its processor, pixels and all
(docs/writing-plugins.md, "Rows with images").

Like every ftcore component, this module imports nothing heavy at import time: torch
is imported inside :meth:`AnswerLength.evaluate`, so ``ftcore plugins`` and
``ftcore validate`` stay fast.
"""

from __future__ import annotations

import json

from pydantic import Field

import ftcore
from ftcore.component import Component, Options

__version__ = "0.1.0"


class AnswerLength(Component):
    """Length of greedy answers to held-out prompts, and how often they stop before max_new_tokens."""

    name = "answer_length"
    # It reads rows with images (their pixels reach the model); an evaluator that does not declare this gets
    # a warning from ftcore when a plan gives it such rows.
    supports_images = True

    class Options(Options):
        max_new_tokens: int = Field(64, ge=1)  # an answer that reaches this did not stop
        limit: int | None = Field(None, ge=1)  # use at most this many rows
        batch_size: int = Field(16, ge=1)

    def check(self, plan) -> list[str]:
        # Runs at `ftcore validate`: find the [[evaluate]] entries that selected this very
        # component (same options object) and make sure each names its data.
        for ev in plan.evaluations:
            if ev.evaluator.options is self.options and ev.data is None:
                return ["evaluator 'answer_length' needs chat data: set data = \"<name>\""]
        return []

    def evaluate(self, ctx):
        import torch

        # ftcore's public helpers: the built-ins' stop tokens, and the image path of the built-in evaluators.
        from ftcore_plugins.common.chat import stop_token_ids
        from ftcore_plugins.common.vision import image_template, processor_of, prompt_inputs

        if ctx.data is None or "messages" not in ctx.data.column_names:
            raise ftcore.FtcoreError("evaluator 'answer_length' needs chat data (rows with 'messages')")
        # Rows with images have an "images" column: one reference per <image> in their text. The template
        # then renders each <image> as an image part (the model's image token), and the processor makes the
        # inputs; a text model has no processor.
        with_images = "images" in ctx.data.column_names
        if with_images and processor_of(ctx.tokenizer) is None:
            raise ftcore.FtcoreError("evaluator 'answer_length': the rows hold images, and the model is a text "
                                     "model (no processor)")
        template = image_template(ctx.template) if with_images else ctx.template
        prompts, references, images = [], [], []
        for row in ctx.data:
            messages = row["messages"]
            if not messages:
                continue
            if messages[-1]["role"] == "assistant":  # the last turn is the reference answer
                if len(messages) == 1:
                    continue
                prompt, reference = messages[:-1], messages[-1]["content"]
            else:  # a conversation waiting for its answer
                prompt, reference = messages, None
            prompts.append(template.render(prompt, ctx.tokenizer, add_generation_prompt=True))
            references.append(reference)
            images.append(list(row.get("images") or []))
            if self.options.limit and len(prompts) >= self.options.limit:
                break
        if not prompts:
            raise ftcore.FtcoreError("evaluator 'answer_length': the data has no prompt to answer")

        tok, model = ctx.tokenizer, ctx.model
        stops = stop_token_ids(tok, ctx.template)  # EOS and the template's end of turn, as the built-ins stop
        limit, size = self.options.max_new_tokens, self.options.batch_size
        device = next(model.parameters()).device
        pad = tok.pad_token_id if tok.pad_token_id is not None else (stops[0] if stops else 0)
        was_training = model.training
        model.eval()
        lengths, stopped, texts = [], [], []
        try:
            with ctx.reporter.progress(f"answer length ({ctx.phase})", len(prompts)) as bar, torch.no_grad():
                for start in range(0, len(prompts), size):
                    # Left-padded (decoder-only models generate at the right edge); with images, the
                    # processor's inputs: the pixels and the image tokens they stand for.
                    batch = prompt_inputs(tok, prompts[start:start + size],
                                          images[start:start + size] if with_images else None,
                                          where="evaluator 'answer_length'").to(device)
                    out = model.generate(**batch, do_sample=False, max_new_tokens=limit,
                                         eos_token_id=stops or None, pad_token_id=pad)
                    for seq in out[:, batch["input_ids"].shape[1]:].tolist():
                        # The answer ends at the first stop token; what follows it is padding.
                        end = next((i for i, t in enumerate(seq) if t in stops), None)
                        answer = seq if end is None else seq[:end]
                        lengths.append(len(answer))
                        stopped.append(end is not None)
                        texts.append(tok.decode(answer, skip_special_tokens=True))
                    bar.advance(len(out))
        finally:
            model.train(was_training)

        if ctx.run.is_main:  # under torchrun only rank 0 writes into the run directory
            with (ctx.output_dir / "answers.jsonl").open("w", encoding="utf-8") as fh:
                for text, n, ok, ref, refs in zip(texts, lengths, stopped, references, images):
                    record = {"answer": text, "tokens": n, "stopped": ok, "reference": ref}
                    if refs:
                        record["images"] = refs
                    fh.write(json.dumps(record) + "\n")
        result = {
            "mean_tokens": sum(lengths) / len(lengths),
            "stop_rate": sum(stopped) / len(stopped),
            "n": len(lengths),
        }
        refs = [r for r in references if r is not None]
        if refs:
            counts = [len(tok(r, add_special_tokens=False)["input_ids"]) for r in refs]
            result["mean_reference_tokens"] = sum(counts) / len(counts)
        return result


@ftcore.hookimpl
def register_evaluators(register):
    register(AnswerLength)


# The entry point names this module: a hook defined elsewhere is registered by importing it here.
from .target_length import TargetLength, register_reward_functions  # noqa: E402,F401
