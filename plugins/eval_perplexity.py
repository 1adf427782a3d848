"""Evaluator ``perplexity``: token-weighted perplexity on held-out data.

exp(total negative log-likelihood / total scored tokens), over every scored token of
the data set, not a mean of per-batch or per-sample perplexities. Chat rows are scored
on assistant tokens (what SFT trains); text rows on every token.
"""

from __future__ import annotations

import math

import ftcore
from ftcore.component import Component, Options
from ftcore.errors import FtcoreError

from ._chat import IGNORE
from ._prepare import prepare


def score(model, tokenizer, columns, batch_size: int, progress=None) -> tuple[float, int]:
    """Sum of NLL (nats) and number of scored tokens, over right-padded batches."""
    import torch

    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    total_nll, total_tokens = 0.0, 0
    order = sorted(range(len(columns["input_ids"])), key=lambda i: len(columns["input_ids"][i]))
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for start in range(0, len(order), batch_size):
            idx = order[start:start + batch_size]
            width = max(len(columns["input_ids"][i]) for i in idx)
            ids = torch.full((len(idx), width), pad, dtype=torch.long)
            labels = torch.full((len(idx), width), IGNORE, dtype=torch.long)
            mask = torch.zeros((len(idx), width), dtype=torch.long)
            for row, i in enumerate(idx):
                n = len(columns["input_ids"][i])
                ids[row, :n] = torch.tensor(columns["input_ids"][i])
                labels[row, :n] = torch.tensor(columns["labels"][i])
                mask[row, :n] = 1
            logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits.float()
            shift_logits, shift_labels = logits[:, :-1], labels[:, 1:].to(device)
            nll = torch.nn.functional.cross_entropy(shift_logits.reshape(-1, shift_logits.size(-1)),
                                                    shift_labels.reshape(-1), ignore_index=IGNORE, reduction="sum")
            total_nll += nll.item()
            total_tokens += int((shift_labels != IGNORE).sum())
            if progress is not None:
                progress.advance(len(idx))
    model.train(was_training)
    return total_nll, total_tokens


class Perplexity(Component):
    """Token-weighted perplexity on held-out data (assistant tokens for chat, all tokens for text)."""

    name = "perplexity"

    class Options(Options):
        batch_size: int = 8
        max_length: int = 512

    def evaluate(self, ctx):
        if ctx.data is None:
            raise FtcoreError("evaluator 'perplexity' needs data: set data = \"<name>\" in its [[evaluate]]")
        prepared = prepare(ctx.data, ctx.tokenizer, ctx.template, max_length=self.options.max_length,
                           reporter=ctx.reporter, description="tokenize")
        columns = prepared.dataset.to_dict()
        with ctx.reporter.progress(f"perplexity ({ctx.phase})", len(columns["input_ids"])) as bar:
            nll, tokens = score(ctx.model, ctx.tokenizer, columns, self.options.batch_size, bar)
        if tokens == 0:
            raise FtcoreError("evaluator 'perplexity': the data has no token to score")
        return {"perplexity": math.exp(nll / tokens), "nll": nll / tokens, "tokens": tokens}


@ftcore.hookimpl
def register_evaluators(register):
    register(Perplexity)
