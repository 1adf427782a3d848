"""Evaluator ``exact_match``: greedy answers to held-out prompts, compared with the reference."""

from __future__ import annotations

import json
import re

import ftcore
from ftcore.component import Component, Options
from ftcore.errors import FtcoreError

from ._chat import stop_token_ids, template_messages


def normalize(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().lower()


class ExactMatch(Component):
    """Share of held-out chat prompts whose greedy answer equals the reference (last assistant turn)."""

    name = "exact_match"

    class Options(Options):
        max_new_tokens: int = 32
        batch_size: int = 16
        normalize: bool = True  # compare case- and whitespace-insensitively
        limit: int | None = None  # score at most this many rows

    def evaluate(self, ctx):
        import torch

        if ctx.data is None or "messages" not in ctx.data.column_names:
            raise FtcoreError("evaluator 'exact_match' needs chat data whose last turn is the reference answer")
        rows = [r for r in ctx.data if r["messages"] and r["messages"][-1]["role"] == "assistant"]
        rows = rows[: self.options.limit] if self.options.limit else rows
        if not rows:
            raise FtcoreError("evaluator 'exact_match': no row ends with an assistant answer to compare with")
        tok, model = ctx.tokenizer, ctx.model
        prompts = [ctx.template.render(template_messages(r["messages"][:-1]), tok, add_generation_prompt=True)
                   for r in rows]
        device = next(model.parameters()).device
        stops = stop_token_ids(tok, ctx.template)
        side, tok.padding_side = tok.padding_side, "left"  # decoder-only models generate from the right edge
        was_training = model.training
        model.eval()
        answers = []
        try:
            with ctx.reporter.progress(f"exact match ({ctx.phase})", len(rows)) as bar, torch.no_grad():
                for start in range(0, len(prompts), self.options.batch_size):
                    batch = tok(prompts[start:start + self.options.batch_size], return_tensors="pt",
                                padding=True, add_special_tokens=False).to(device)
                    out = model.generate(**batch, do_sample=False, max_new_tokens=self.options.max_new_tokens,
                                         eos_token_id=stops, pad_token_id=tok.pad_token_id)
                    new = out[:, batch["input_ids"].shape[1]:]
                    answers += tok.batch_decode(new, skip_special_tokens=True)
                    bar.advance(len(new))
        finally:
            tok.padding_side = side
            model.train(was_training)
        norm = normalize if self.options.normalize else (lambda s: s.strip())
        records = [{"prompt": row["messages"][-2]["content"] if len(row["messages"]) > 1 else "",
                    "reference": row["messages"][-1]["content"], "prediction": answer.strip(),
                    "match": norm(answer) == norm(row["messages"][-1]["content"])}
                   for row, answer in zip(rows, answers)]
        if ctx.run.is_main:
            with (ctx.output_dir / "predictions.jsonl").open("w", encoding="utf-8") as fh:
                fh.writelines(json.dumps(r) + "\n" for r in records)
        hits = sum(r["match"] for r in records)
        return {"exact_match": hits / len(rows), "n": len(rows)}


@ftcore.hookimpl
def register_evaluators(register):
    register(ExactMatch)
