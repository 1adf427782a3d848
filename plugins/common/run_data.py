"""A plan's data outside a run, through the runner that would run it: ``ftcore prepare``, ``ftcore
estimate``, ``ftcore check`` and ``ftcore validate --data``. The tokenizer is the run's (the loader's,
with the template's tokens added to a model built on the meta device), so no weights are read, and
nothing is written in the run folder. Heavy libraries come in through the components alone."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from ftcore.context import LoadContext, StageContext
from ftcore.errors import FtcoreError
from ftcore.runner import calling


def data_tokenizer(runner: Any) -> tuple[Any, Any]:
    """``(model, tokenizer)`` for work on the data alone: the run's tokenizer, with the template's tokens
    added to the model built on the meta device, so no weights are read. The reporter writes nothing to
    the run folder."""
    runner._ensure_reporter()
    plan, loader = runner.plan, runner.plan.model.create()
    with tempfile.TemporaryDirectory(prefix="ftcore-data-") as work:
        ctx = LoadContext(runner.info, runner.reporter, runner.quantizer, plan.seed, Path(work), runner._load_data)
        with calling(plan.model, "load"):
            if hasattr(loader, "load_tokenizer") and hasattr(loader, "meta_model"):
                tokenizer, model = loader.load_tokenizer(ctx), loader.meta_model()[0]
            else:  # a loader that cannot give its tokenizer alone: the whole model
                model, tokenizer = loader.load(ctx)
    prepare = getattr(runner.template, "prepare", None)
    if prepare is not None:
        with calling(plan.template, "prepare"):
            model, tokenizer = prepare(model, tokenizer)
    return model, tokenizer


def data_context(runner: Any, stage: Any, model: Any, tokenizer: Any) -> StageContext:
    """A stage's context for work on its data outside a run (``ftcore prepare``, ``ftcore check``): its
    train and eval rows, no checkpoint to resume from; nothing is written in its folders."""
    load = runner._load_data
    return StageContext(runner.info, runner.reporter, stage.name, model, tokenizer, runner.template,
                        load(stage.data), load(stage.eval_data) if stage.eval_data else None,
                        runner.stage_dir(stage), runner.stage_dir(stage) / "checkpoints", None, runner.plan.seed,
                        adapter=stage.adapter.create())


def prepare_data(runner: Any, only: list[str] | None = None) -> list[tuple[str, str]]:
    """Only the data preparation (``ftcore prepare``): each stage's trainer ``prepare_data(ctx)`` fills
    the shared tokenized-data cache, so that a run starts from it. Returns ``(stage, what happened)``
    per stage."""
    stages = [s for s in runner.plan.stages if only is None or s.name in only]
    missing = sorted(set(only or ()) - {s.name for s in stages})
    if missing:
        raise FtcoreError(f"no stage named {', '.join(map(repr, missing))}; stages: "
                          f"{', '.join(s.name for s in runner.plan.stages)}")
    model, tokenizer = data_tokenizer(runner)
    done = []
    for stage in stages:
        trainer = stage.trainer.create()
        if not hasattr(trainer, "prepare_data"):
            done.append((stage.name, f"trainer '{stage.trainer.name}' tokenizes its data as it trains"))
            continue
        if not hasattr(runner._load_data(stage.data), "__len__"):  # a streaming source: read as it trains
            done.append((stage.name, f"data '{stage.data}' streams as the stage trains: nothing to prepare"))
            continue
        with calling(stage.trainer, "prepare_data"):
            trainer.prepare_data(data_context(runner, stage, model, tokenizer))
        done.append((stage.name, "prepared"))
    return done
