"""Evaluator ``generation``: answers generated for held-out prompts, scored against the references.

Rows are chat rows (the reference is the last assistant turn, the prompt the turns before it,
rendered by the plan's template with its generation prompt) or prompt/completion rows (the prompt
as it is, the completion as reference). Metrics, each a number over all scored rows:

* ``exact_match``: the answer equals the reference (both stripped of surrounding whitespace);
* ``exact_match_normalized``: equal after the SQuAD normalisation (:func:`squad_normalize`);
* ``rouge_l``: mean ROUGE-L F-measure, Google's ``rouge_score`` (its tokenizer, no stemming);
* ``bleu``: corpus BLEU by ``sacrebleu`` (its default ``13a`` tokenizer), on sacrebleu's 0-100 scale;
* ``format``: share of answers that ``re.fullmatch`` the option ``pattern``.

Each gets a percentile bootstrap interval over rows (``<metric>/ci_low``, ``<metric>/ci_high``):
rows are resampled with replacement and the metric recomputed; corpus BLEU is recomputed from the
resampled rows' n-gram statistics, as sacrebleu's own bootstrap does.
"""

from __future__ import annotations

import importlib.util
import json
import re
import string
from typing import Any, Literal

from pydantic import Field

import ftcore
from ftcore.component import Component, Options
from ftcore.errors import FtcoreError
from ftcore.types import Tokens

from ftcore_plugins.common.chat import prompt_text, stop_token_ids

Metric = Literal["exact_match", "exact_match_normalized", "rouge_l", "bleu", "format"]
LIBRARY_METRICS = {"rouge_l": ("rouge_score", "rouge-score"), "bleu": ("sacrebleu", "sacrebleu")}
PIP_EVAL = "pip install 'ftcore[eval]'"


def squad_normalize(text: str) -> str:
    """SQuAD v1.1's answer normalisation: lowercase, drop ASCII punctuation, drop the articles
    a/an/the, collapse whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in string.punctuation)
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


def rouge_l(predictions: list[str], references: list[str]) -> list[float]:
    """Per-row ROUGE-L F-measure."""
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(["rougeL"])
    return [scorer.score(ref, pred)["rougeL"].fmeasure for pred, ref in zip(predictions, references)]


def row_metrics(predictions: list[str], references: list[str], metrics: list[str],
                pattern: str | None = None) -> dict[str, list[float]]:
    """Every selected metric that is a mean over rows, per row (corpus BLEU is not one)."""
    out: dict[str, list[float]] = {}
    if "exact_match" in metrics:
        out["exact_match"] = [float(p.strip() == r.strip()) for p, r in zip(predictions, references)]
    if "exact_match_normalized" in metrics:
        out["exact_match_normalized"] = [float(squad_normalize(p) == squad_normalize(r))
                                         for p, r in zip(predictions, references)]
    if "rouge_l" in metrics:
        out["rouge_l"] = rouge_l(predictions, references)
    if "format" in metrics:
        compiled = re.compile(pattern or "")
        out["format"] = [float(compiled.fullmatch(p.strip()) is not None) for p in predictions]
    return out


def percentile_interval(samples: Any, confidence: float) -> tuple[float, float]:
    import numpy as np

    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(samples, [tail, 100 - tail])
    return float(low), float(high)


def resample(n: int, resamples: int, seed: int) -> Any:
    """Row indices of ``resamples`` bootstrap samples, shape (resamples, n)."""
    import numpy as np

    return np.random.default_rng(seed).integers(0, n, size=(resamples, n))


def corpus_bleu(predictions: list[str], references: list[str], indices: Any = None) -> tuple[Any, list[float]]:
    """sacrebleu's corpus BLEU (its ``BLEUScore``), and the score of each bootstrap sample of rows in
    ``indices``. The samples reuse the rows' n-gram statistics, as ``sacrebleu.significance`` does."""
    import numpy as np
    import sacrebleu

    bleu = sacrebleu.BLEU()
    point = bleu.corpus_score(predictions, [references])
    if indices is None:
        return point, []
    stats = np.asarray(bleu._extract_corpus_statistics(predictions, [references]), dtype=np.int64)
    return point, [bleu._compute_score_from_stats(s).score for s in stats[indices].sum(axis=1)]


def summarize(per_row: dict[str, list[float]], bleu_of: tuple[list[str], list[str]] | None,
              resamples: int, confidence: float, seed: int, warn: Any = None) -> dict[str, float]:
    """Point values and, when ``resamples`` > 0, percentile intervals, for the per-row metrics
    and (when ``bleu_of`` gives predictions and references) corpus BLEU."""
    import numpy as np

    n = len(next(iter(per_row.values()))) if per_row else len(bleu_of[0])
    indices = resample(n, resamples, seed) if resamples else None
    out: dict[str, float] = {}
    for name, values in per_row.items():
        values = np.asarray(values, dtype=np.float64)
        out[name] = float(values.mean())
        if indices is not None:
            out[f"{name}/ci_low"], out[f"{name}/ci_high"] = percentile_interval(values[indices].mean(axis=1),
                                                                                 confidence)
    if bleu_of is not None:
        score, samples = corpus_bleu(*bleu_of, indices)
        out["bleu"] = score.score
        if score.totals[-1] == 0 and warn is not None:
            warn("bleu: no answer has 4 tokens, so corpus BLEU (up to 4-grams) is 0 whatever they say; "
                 "rouge_l and exact match score short answers")
        if indices is not None:
            out["bleu/ci_low"], out["bleu/ci_high"] = percentile_interval(samples, confidence)
    return out


def reference_rows(data: Any, evaluator: str, limit: int | None, reporter: Any) -> list[dict]:
    """Rows with a reference answer: chat rows ending in an assistant turn (others are left out,
    with a warning), or prompt/completion rows."""
    columns = set(data.column_names) if data is not None else set()
    if "messages" in columns:
        rows = [r for r in data if r["messages"] and r["messages"][-1]["role"] == "assistant"]
        if len(rows) < len(data):
            reporter.warn(f"evaluator '{evaluator}': {len(data) - len(rows)} of {len(data)} chat rows do not end "
                          "with an assistant answer and are left out")
    elif {"prompt", "completion"} <= columns and len(data) and isinstance(data[0]["prompt"], str):
        rows = list(data)
    else:
        raise FtcoreError(f"evaluator '{evaluator}' needs chat rows whose last turn is the reference answer, or "
                          "prompt/completion rows: set data = \"<name>\" in its [[evaluate]]"
                          + (f" (this data has {', '.join(sorted(columns))})" if columns else ""))
    if not rows:
        raise FtcoreError(f"evaluator '{evaluator}': no row ends with an assistant answer to compare with")
    return rows[:limit] if limit else rows


def reference_text(row: dict) -> str:
    return row["messages"][-1]["content"] if row.get("messages") else row["completion"]


def generate_answers(ctx: Any, prompts: list[str], *, max_new_tokens: int, batch_size: int, label: str,
                     seed: int | None = None, images: list[list] | None = None, **sampling: Any) -> list[str]:
    """The model's answers to rendered ``prompts``, in batches, stopping at EOS or the template's
    end-of-turn tokens. ``images`` (each prompt's image references) go through the processor, decoded a
    batch at a time. ``sampling`` goes to ``generate``; with a ``seed`` it samples from its own
    random state, so the run's random state is left as it was."""
    import contextlib

    import torch

    from ftcore_plugins.common.generate import batched_answers

    device = next(ctx.model.parameters()).device
    encode = None
    if images is not None:
        from ftcore_plugins.common.vision import prompt_inputs

        def encode(start: int, texts: list[str]) -> Any:
            return prompt_inputs(ctx.tokenizer, texts, images[start:start + len(texts)]).to(device)
    rng = torch.random.fork_rng(devices=[device] if device.type == "cuda" else []) \
        if seed is not None else contextlib.nullcontext()
    with rng, ctx.reporter.progress(f"{label} ({ctx.phase})", len(prompts)) as bar:
        return batched_answers(ctx.model, ctx.tokenizer, prompts, batch_size=batch_size, progress=bar, seed=seed,
                               encode=encode, max_new_tokens=max_new_tokens,
                               eos_token_id=stop_token_ids(ctx.tokenizer, ctx.template),
                               pad_token_id=ctx.tokenizer.pad_token_id, **sampling)


def image_prompts(ctx: Any, rows: list[dict], evaluator: str) -> tuple[Any, list[list] | None]:
    """The template that renders the rows' prompts and, for rows with images, each row's image references
    (None for text rows). Rows with images need the model's processor and a template that renders image
    parts (``native`` or ``jinja``), each refused in one line otherwise."""
    from ftcore_plugins.common.vision import has_images, image_template, require_processor

    if not has_images(ctx.data):
        return ctx.template, None
    where = f"evaluator '{evaluator}'"
    require_processor(ctx.tokenizer, where)
    try:
        template = image_template(ctx.template)
    except FtcoreError as exc:
        raise FtcoreError(f"{where}: {exc}") from None
    return template, [list(r.get("images") or []) for r in rows]


def write_predictions(ctx: Any, prompts: list[str], references: list[str], predictions: list[str],
                      per_row: dict[str, list[float]], images: list[list] | None = None) -> None:
    if not ctx.run.is_main:
        return
    with (ctx.output_dir / "predictions.jsonl").open("w", encoding="utf-8") as fh:
        for i, (prompt, reference, prediction) in enumerate(zip(prompts, references, predictions)):
            record = {"prompt": prompt, "reference": reference, "prediction": prediction}
            if images and images[i]:
                record["images"] = [ref if not ref.startswith("data:") else ref[:ref.index(",")] + ",..."
                                    for ref in images[i]]
            record.update({name: values[i] for name, values in per_row.items()})
            fh.write(json.dumps(record, ensure_ascii=False) + "\n")


class Generation(Component):
    """Generated answers to held-out prompts: exact match, normalised exact match, ROUGE-L, BLEU and
    format compliance, with bootstrap confidence intervals; predictions.jsonl for inspection."""

    name = "generation"
    supports_images = True  # rows with images are answered through the model's processor

    class Options(Options):
        max_new_tokens: Tokens = 64
        batch_size: int = Field(16, ge=1)
        limit: int | None = Field(None, ge=1)  # score at most this many rows
        do_sample: bool = False  # greedy (or beam search) unless true
        temperature: float | None = Field(None, gt=0)  # these three need do_sample; unset: the model's
        top_p: float | None = Field(None, gt=0, le=1)  # generation config
        top_k: int | None = Field(None, ge=0)
        num_beams: int = Field(1, ge=1)
        seed: int = Field(0, ge=0)  # for sampling
        metrics: list[Metric] | None = None  # None: every metric, format only with a pattern
        pattern: str | None = None  # format compliance: the share of answers that re.fullmatch it
        bootstrap: int = Field(1000, ge=0)  # resamples for the confidence intervals; 0: none
        confidence: float = Field(0.95, gt=0, lt=1)
        bootstrap_seed: int = Field(0, ge=0)

    def selected_metrics(self) -> list[str]:
        if self.options.metrics is not None:
            return list(dict.fromkeys(self.options.metrics))
        return [m for m in Metric.__args__ if m != "format" or self.options.pattern is not None]

    def check(self, plan) -> list[str]:
        o, problems = self.options, []
        metrics = self.selected_metrics()
        for metric in metrics:
            if metric in LIBRARY_METRICS and importlib.util.find_spec(LIBRARY_METRICS[metric][0]) is None:
                problems.append(f"metrics: {metric} needs the package {LIBRARY_METRICS[metric][1]}, which is not "
                                f"installed: {PIP_EVAL}" + ("" if o.metrics else "; or choose metrics = [...]"))
        if o.pattern is not None:
            try:
                re.compile(o.pattern)
            except re.error as exc:
                problems.append(f"pattern: not a valid regular expression: {exc} (got {o.pattern!r})")
            if "format" not in metrics:
                problems.append("pattern: is used by the metric 'format' only, which metrics leaves out")
        elif "format" in metrics:
            problems.append("metrics: 'format' needs pattern = \"<regular expression>\" that every answer should match")
        if not o.do_sample:
            problems += [f"{key}: applies only when sampling; set do_sample = true"
                         for key in ("temperature", "top_p", "top_k") if getattr(o, key) is not None]
        return problems

    def sampling(self) -> dict[str, Any]:
        o = self.options
        args: dict[str, Any] = {"do_sample": o.do_sample, "num_beams": o.num_beams}
        if o.do_sample:
            args.update({k: v for k in ("temperature", "top_p", "top_k") if (v := getattr(o, k)) is not None})
            args["seed"] = o.seed
        return args

    def score(self, predictions: list[str], references: list[str], reporter: Any) -> tuple[dict[str, list[float]],
                                                                                            dict]:
        """Per-row metrics (written with the predictions) and the reported values."""
        o, metrics = self.options, self.selected_metrics()
        per_row = row_metrics(predictions, references, metrics, o.pattern)
        report = summarize(per_row, (predictions, references) if "bleu" in metrics else None,
                           o.bootstrap, o.confidence, o.bootstrap_seed, reporter.warn)
        return per_row, report

    def evaluate(self, ctx):
        o = self.options
        rows = reference_rows(ctx.data, self.name, o.limit, ctx.reporter)
        template, images = image_prompts(ctx, rows, self.name)
        prompts = [prompt_text(r, ctx.tokenizer, template) for r in rows]
        references = [reference_text(r) for r in rows]
        predictions = generate_answers(ctx, prompts, max_new_tokens=o.max_new_tokens, batch_size=o.batch_size,
                                       label=self.name.replace("_", " "), images=images, **self.sampling())
        per_row, report = self.score(predictions, references, ctx.reporter)
        write_predictions(ctx, prompts, references, predictions, per_row, images)
        return {**report, "n": len(rows)}


@ftcore.hookimpl
def register_evaluators(register):
    register(Generation)
