"""Evaluator ``lm_eval``: EleutherAI's lm-evaluation-harness tasks on the model in memory.

The model and tokenizer are wrapped in lm-eval's ``HFLM`` and run by ``lm_eval.simple_evaluate``,
with tasks found among lm-eval's own and in ``include_path`` (a folder of task YAML files).
Reported: every numeric task metric as ``<task>/<metric>`` (``<task>/<metric>/<filter>`` for a
filter other than ``none``) and ``<task>/n``; the full results go to ``results.json``, and each
task's scored samples to ``samples_<task>.jsonl``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
from typing import Any

from pydantic import Field

import ftcore
from ftcore.component import Component, Options
from ftcore.errors import FtcoreError
from ftcore.types import InputPath

from ftcore_plugins.common.seq2seq import plan_encoder_decoder, refusal

PIP_LM_EVAL = "pip install 'ftcore[lm-eval]'"


@contextlib.contextmanager
def kept_random_state():
    """simple_evaluate seeds Python's, numpy's and torch's global generators; the run's own
    random state (e.g. training's data order after a before-evaluation) must not depend on it."""
    import random

    import numpy as np
    import torch

    python, numpy = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=[torch.cuda.current_device()] if torch.cuda.is_available() else []):
            yield
    finally:
        random.setstate(python)
        np.random.set_state(numpy)


def flatten(results: dict[str, Any]) -> dict[str, float]:
    """``{task: {"acc,none": 0.5, "alias": ...}}`` -> ``{"task/acc": 0.5, "task/n": ...}``: numbers only."""
    out: dict[str, float] = {}
    for task, values in results["results"].items():
        for key, value in values.items():
            metric, _, filter_name = key.partition(",")
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                out[f"{task}/{metric}" + (f"/{filter_name}" if filter_name not in ("", "none") else "")] = value
        if task in results.get("n-samples", {}):
            out[f"{task}/n"] = results["n-samples"][task]["effective"]
    return out


class LmEval(Component):
    """lm-evaluation-harness tasks (built-in or local YAML files) on the model in memory."""

    name = "lm_eval"

    class Options(Options):
        tasks: list[str] = Field(min_length=1)  # task (or group) names
        include_path: InputPath | None = None  # a folder of task YAML files, relative to the plan
        num_fewshot: int | None = Field(None, ge=0)  # None: each task's own default
        limit: int | None = Field(None, ge=1)  # at most this many documents per task
        batch_size: int = Field(8, ge=1)

    def check(self, plan) -> list[str]:
        if family := plan_encoder_decoder(plan):  # lm-eval's seq2seq path is not one ftcore has checked
            return [refusal(f"evaluator '{self.name}'", family, "ftcore runs lm-eval on causal LMs only",
                            "use \"perplexity\" or \"exact_match\"")]
        if importlib.util.find_spec("lm_eval") is None:
            return [f"use: evaluator 'lm_eval' needs lm-eval (lm-evaluation-harness), which is not installed: "
                    f"{PIP_LM_EVAL}"]
        return []

    def evaluate(self, ctx):
        try:
            import lm_eval
            from lm_eval.models.huggingface import HFLM
            from lm_eval.tasks import TaskManager
            from lm_eval.utils import handle_non_serializable
        except ImportError as exc:
            raise FtcoreError(f"evaluator 'lm_eval' needs lm-eval, which cannot be imported ({exc}): "
                              f"{PIP_LM_EVAL}") from None
        o = self.options
        include = str(o.include_path) if o.include_path else None
        # Indexing lm-eval's ~15,000 built-in tasks takes seconds: only when include_path lacks a task.
        manager = TaskManager(include_path=include, include_defaults=False) if include else None
        if manager is None or any(t not in manager.all_tasks for t in o.tasks):
            manager = TaskManager(include_path=include)
        unknown = [t for t in o.tasks if t not in manager.all_tasks]
        if unknown:
            where = f"lm-eval's tasks or {o.include_path}" if o.include_path else "lm-eval's tasks (set include_path " \
                "to a folder of task YAML files for your own)"
            raise FtcoreError(f"evaluator 'lm_eval': tasks: {', '.join(map(repr, unknown))} not found in {where}")
        was_training = ctx.model.training
        try:
            with kept_random_state():
                lm = HFLM(pretrained=ctx.model, tokenizer=ctx.tokenizer, batch_size=o.batch_size)
                results = lm_eval.simple_evaluate(model=lm, tasks=list(o.tasks), num_fewshot=o.num_fewshot,
                                                  limit=o.limit, task_manager=manager)
        finally:
            ctx.model.train(was_training)
        if ctx.run.is_main:
            samples = results.pop("samples", {})
            dump = json.dumps(results, indent=2, default=handle_non_serializable)
            (ctx.output_dir / "results.json").write_text(dump + "\n", encoding="utf-8")
            for task, rows in samples.items():
                with (ctx.output_dir / f"samples_{task}.jsonl").open("w", encoding="utf-8") as fh:
                    fh.writelines(json.dumps(r, default=handle_non_serializable) + "\n" for r in rows)
        return flatten(results)


@ftcore.hookimpl
def register_evaluators(register):
    register(LmEval)
