"""Evaluator ``perplexity``: token-weighted perplexity on held-out data.

exp(total negative log-likelihood / total scored tokens), over every scored token of
the data set, not a mean of per-batch or per-sample perplexities. Chat rows are scored
on assistant tokens (what SFT trains); text rows on every token. Optionally the same
sum is split by part (the prompt's tokens against the response's) and by row length.
An encoder-decoder (T5, BART) is scored on the answer its decoder writes (the last assistant
turn or the completion, and EOS); the prompt is its encoder's input, which it does not predict.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pydantic import Field, field_validator

import ftcore
from ftcore.component import Component, Options
from ftcore.errors import FtcoreError
from ftcore.types import Tokens

from ftcore_plugins.common.chat import IGNORE
from ftcore_plugins.common.prepare import prepare
from ftcore_plugins.common.seq2seq import is_encoder_decoder


@dataclass
class RowScore:
    """Summed NLL (nats) and token counts of one row: response = labelled tokens, prompt = the rest."""

    length: int
    nll: float
    tokens: int
    prompt_nll: float
    prompt_tokens: int


def batch_scores(model, batch: dict, labels, device, never=None) -> list[RowScore]:
    """The RowScore of each row of a right-padded ``batch`` (the model's inputs; ``labels`` apart): labelled
    tokens are the response, the other real tokens the prompt, less any token in ``never``."""
    import torch

    ids, mask = batch["input_ids"], batch["attention_mask"]
    logits = model(**{k: v.to(device) for k, v in batch.items()}, use_cache=False).logits.float()
    # Token t is predicted from position t-1: every real token but the first has an NLL.
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:].to(device),
                                            reduction="none").cpu()
    del logits
    response = labels[:, 1:] != IGNORE
    prompt = mask[:, 1:].bool() & ~response
    if never is not None:
        prompt &= ~torch.isin(ids[:, 1:], never)
    return [RowScore(int(mask[row].sum()), nll[row][response[row]].sum().item(), int(response[row].sum()),
                     nll[row][prompt[row]].sum().item(), int(prompt[row].sum())) for row in range(len(ids))]


def seq2seq_batch_scores(model, batch: dict, labels, device) -> list[RowScore]:
    """The RowScore of each row for an encoder-decoder: the answer's tokens (``labels``, right-padded with
    IGNORE) are scored from the decoder's logits, which the model aligns with them; its prompt is the
    encoder's input, which it does not predict (no prompt part)."""
    import torch

    labels = labels.to(device)
    logits = model(**{k: v.to(device) for k, v in batch.items()}, labels=labels, use_cache=False).logits.float()
    nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels, ignore_index=IGNORE,
                                            reduction="none").cpu()
    scored = (labels != IGNORE).cpu()
    return [RowScore(int(batch["attention_mask"][row].sum() + scored[row].sum()), nll[row][scored[row]].sum().item(),
                     int(scored[row].sum()), 0.0, 0) for row in range(len(labels))]


def score(model, tokenizer, columns, batch_size: int, progress=None) -> list[RowScore]:
    """Per-row NLL sums over right-padded batches, in the order of ``columns``; for an encoder-decoder the
    ids are its encoder's input and the labels the answer (``common/seq2seq.py``), padded apart."""
    import torch

    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids_col, labels_col = columns["input_ids"], columns["labels"]
    seq2seq = is_encoder_decoder(model)
    scores: list[RowScore | None] = [None] * len(ids_col)
    order = sorted(range(len(ids_col)), key=lambda i: len(ids_col[i]))  # similar lengths: little padding
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for start in range(0, len(order), batch_size):
            idx = order[start:start + batch_size]
            if seq2seq:
                ids, mask = _padded([ids_col[i] for i in idx], pad), _padded([[1] * len(ids_col[i]) for i in idx], 0)
                labels = _padded([labels_col[i] for i in idx], IGNORE)
                row_scores = seq2seq_batch_scores(model, {"input_ids": ids, "attention_mask": mask}, labels, device)
                for i, row_score in zip(idx, row_scores):
                    scores[i] = row_score
                if progress is not None:
                    progress.advance(len(idx))
                continue
            width = max(len(ids_col[i]) for i in idx)
            ids = torch.full((len(idx), width), pad, dtype=torch.long)
            labels = torch.full((len(idx), width), IGNORE, dtype=torch.long)
            mask = torch.zeros((len(idx), width), dtype=torch.long)
            for row, i in enumerate(idx):
                n = len(ids_col[i])
                ids[row, :n] = torch.tensor(ids_col[i])
                labels[row, :n] = torch.tensor(labels_col[i])
                mask[row, :n] = 1
            batch = {"input_ids": ids, "attention_mask": mask}
            for i, row_score in zip(idx, batch_scores(model, batch, labels, device)):
                scores[i] = row_score
            if progress is not None:
                progress.advance(len(idx))
    model.train(was_training)
    return scores  # type: ignore[return-value]


def _padded(rows: list[list[int]], value: int):
    import torch

    out = torch.full((len(rows), max(len(r) for r in rows)), value, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, :len(r)] = torch.tensor(r, dtype=torch.long)
    return out


def score_images(model, encoder, rows, batch_size: int, progress=None) -> list[RowScore]:
    """Per-row NLL sums for chat rows with images, in order: each batch rendered, labelled and processed
    by ``encoder`` (:class:`~ftcore_plugins.common.vision.VisionEncoder`, images decoded a batch at a time).
    Image and vision-placeholder tokens count in neither part."""
    import torch

    device = next(model.parameters()).device
    never = torch.tensor(sorted(encoder.never), dtype=torch.long)
    scores: list[RowScore] = []
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for start in range(0, len(rows), batch_size):
                indices = list(range(start, min(start + batch_size, len(rows))))
                batch = encoder([rows[i] for i in indices], indices)
                labels = batch.pop("labels")
                scores += batch_scores(model, batch, labels, device, never)
                if progress is not None:
                    progress.advance(len(indices))
    finally:
        model.train(was_training)
    return scores


def summarize(rows: list[RowScore], prefix: str = "") -> dict[str, float]:
    nll, tokens = sum(r.nll for r in rows), sum(r.tokens for r in rows)
    if tokens == 0:
        return {}
    return {f"{prefix}perplexity": math.exp(nll / tokens), f"{prefix}nll": nll / tokens, f"{prefix}tokens": tokens}


class Perplexity(Component):
    """Token-weighted perplexity on held-out data (assistant tokens for chat, all tokens for text)."""

    name = "perplexity"
    supports_images = True  # rows with images are scored as training sees them, pixels and all

    class Options(Options):
        batch_size: int = Field(8, ge=1, le=1 << 16)
        max_length: Tokens = 512
        by_part: bool = False  # also report the prompt's tokens and the response's separately
        length_buckets: list[Tokens] = []  # upper bounds in tokens, e.g. [64, 256]: perplexity per row-length bucket

        @field_validator("length_buckets")
        @classmethod
        def _ascending(cls, v: list[int]) -> list[int]:
            if any(b <= 0 for b in v) or v != sorted(set(v)):
                raise ValueError("must be positive token counts in ascending order, e.g. [64, 256]")
            return v

    def measure(self, ctx, data, model, label: str) -> dict[str, float]:
        """The metrics of ``model`` on ``data`` (``ctx`` gives tokenizer, template and reporter)."""
        from ftcore_plugins.common.vision import VisionEncoder, has_images, require_processor

        if has_images(data):
            where = f"evaluator '{self.name}'"
            try:
                encoder = VisionEncoder(require_processor(ctx.tokenizer, where), ctx.template,
                                        max_length=self.options.max_length, where=where)
            except FtcoreError as exc:
                raise FtcoreError(str(exc) if str(exc).startswith(where) else f"{where}: {exc}") from None
            with ctx.reporter.progress(f"{label} ({ctx.phase})", len(data)) as bar:
                rows = score_images(model, encoder, data, self.options.batch_size, bar)
        else:
            prepared = prepare(data, ctx.tokenizer, ctx.template, max_length=self.options.max_length,
                               reporter=ctx.reporter, description="tokenize", seq2seq=is_encoder_decoder(model))
            columns = prepared.dataset.to_dict()
            with ctx.reporter.progress(f"{label} ({ctx.phase})", len(columns["input_ids"])) as bar:
                rows = score(model, ctx.tokenizer, columns, self.options.batch_size, bar)
        metrics = summarize(rows)
        if not metrics:
            raise FtcoreError(f"evaluator '{self.name}': the data has no token to score")
        if self.options.by_part:
            prompt = [RowScore(r.length, r.prompt_nll, r.prompt_tokens, 0.0, 0) for r in rows]
            metrics |= summarize(rows, "response/") | summarize(prompt, "prompt/")
        low = 0
        for high in [*self.options.length_buckets, None]:
            inside = [r for r in rows if r.length > low and (high is None or r.length <= high)]
            name = f"length_{low + 1}-{high}/" if high is not None else f"length_{low + 1}+/"
            if self.options.length_buckets:
                metrics |= summarize(inside, name) | {f"{name}rows": len(inside)}
            low = high or low
        return metrics

    def evaluate(self, ctx):
        if ctx.data is None:
            raise FtcoreError(f"evaluator '{self.name}' needs data: set data = \"<name>\" in its [[evaluate]]")
        return self.measure(ctx, ctx.data, ctx.model, self.name)


@ftcore.hookimpl
def register_evaluators(register):
    register(Perplexity)
