"""A plan's data outside a run, through the runner that would run it: ``ftcore prepare``, ``ftcore
estimate``, ``ftcore check`` and ``ftcore validate --data``. The tokenizer is the run's (the loader's,
with the template's tokens added to a model built on the meta device), so no weights are read, and
nothing is written in the run folder. Heavy libraries come in through the components alone. And the
same preparation in a run, before the model loads (:func:`prepare_before_load`)."""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Any

from ftcore.context import LoadContext, StageContext
from ftcore.errors import FtcoreError
from ftcore.reporter import Reporter
from ftcore.runner import calling

log = logging.getLogger("ftcore")

# A run's tokenizer, read once and handed on (the pre-flight's to the data check, the data check's to the
# load): run folder -> (the plan's [model] options, tokenizer). Reading one is seconds (Llama 3's: its
# tokenizer.json in Rust and again in Python), and a run read it three times before its first step.
_LENT: dict[Path, tuple[Any, Any]] = {}


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
    return _stage_context(runner.info, runner.reporter, runner.template, runner._load_data, stage, model, tokenizer)


def _stage_context(run: Any, reporter: Any, template: Any, load: Any, stage: Any, model: Any,
                   tokenizer: Any) -> StageContext:
    folder = run.run_dir / "stages" / stage.name
    return StageContext(run, reporter, stage.name, model, tokenizer, template, load(stage.data),
                        load(stage.eval_data) if stage.eval_data else None, folder, folder / "checkpoints", None,
                        run.plan.seed, adapter=stage.adapter.create())


def prepare_before_load(run: Any, stages: list[Any], load_data: Any) -> None:
    """``ftcore run``'s data preparation, before the model loads (``ftcore_prepare_data``): each stage still
    to train has its trainer prepare its rows as ``ftcore prepare`` does, with the run's tokenizer and
    template on a model built on the meta device (no weights read). A bad row, or data a trainer refuses,
    stops the run here, not after the model loaded; the prepared rows wait in the cache of tokenized data,
    where the stage finds them. A loader that cannot give its tokenizer without the weights skips this
    (and so does a distributed run, whose ranks prepare their data as they train)."""
    plan, loader = run.plan, run.plan.model.create()
    preparing = [s for s in stages if hasattr(s.trainer.reg.cls, "prepare_data")
                 and hasattr(load_data(s.data), "__len__")]  # a streaming source is read as it trains
    if not preparing or run.world_size > 1 or not (hasattr(loader, "load_tokenizer") and hasattr(loader, "meta_model")):
        return
    try:
        model = loader.meta_model()[0]
    except Exception as exc:  # noqa: BLE001 - not buildable here (a hub id not downloaded): the load says why
        log.debug("data check before loading skipped: %s", exc)
        return
    work = run.run_dir / "model"  # where the loader keeps what it makes (a trained tokenizer), for the load
    work.mkdir(parents=True, exist_ok=True)
    quantizer, template = plan.quantizer.create(), plan.template.create()
    with calling(plan.model, "load"):
        tokenizer = loader.load_tokenizer(LoadContext(run, run.reporter, quantizer, plan.seed, work, load_data))
    loaded = _shape(tokenizer)
    prepare = getattr(template, "prepare", None)
    if prepare is not None:
        with calling(plan.template, "prepare"):
            model, tokenizer = prepare(model, tokenizer)
    silent = Silent()  # the stage reports its data when it trains
    for stage in preparing:
        ctx = _stage_context(run, silent, template, load_data, stage, model, tokenizer)
        with calling(stage.trainer, "prepare_data"):
            stage.trainer.create().prepare_data(ctx)
    # Lent only as it loaded: a template that added tokens grew the meta model, and the load's own
    # prepare must add them again to grow the real one.
    if _shape(tokenizer) == loaded:
        lend_tokenizer(run.run_dir, plan.model.options, tokenizer)


def lend_tokenizer(run_dir: Path, options: Any, tokenizer: Any) -> None:
    """Keep ``tokenizer``, read for the run in ``run_dir`` from the ``[model]`` ``options``, for the next
    :func:`borrow_tokenizer` of that run: the model loader's pre-flight lends the one it read, and
    :func:`prepare_before_load` the one it prepared the data with, where preparing left it as it loaded."""
    _LENT[Path(run_dir)] = (options, tokenizer)


def borrow_tokenizer(run_dir: Path, options: Any) -> Any | None:
    """For a loader's ``load_tokenizer``: the tokenizer lent for the run in ``run_dir`` from the same
    ``[model]`` options, handed over once; None: read it from the files."""
    lent = _LENT.pop(Path(run_dir), None)
    return lent[1] if lent is not None and lent[0] == options else None


def _shape(tokenizer: Any) -> tuple:
    """What preparing could change in a tokenizer that a second preparation must see again."""
    return (len(tokenizer), tuple(map(str, getattr(tokenizer, "all_special_tokens", ()))),
            getattr(tokenizer, "padding_side", None), getattr(tokenizer, "truncation_side", None))


def warn_unread_images(run: Any, stages: list[Any], load_data: Any) -> None:
    """``ftcore run``, before the model loads: one line for each trainer of a stage still to train, and each
    evaluator, that gets rows with images (an ``images`` column) and whose class does not declare what it does
    with them (``supports_images``: True, it reads them; False, it refuses them itself): it may use their text
    alone. The data is the run's, loaded already (``load_data`` caches it)."""
    uses = [(f"stage {s.name}", s.trainer, (s.data, s.eval_data)) for s in stages]
    uses += [(f"evaluation '{e.name}'", e.evaluator, (e.data,)) for e in run.plan.evaluations]
    for where, sel, refs in uses:
        if getattr(sel.reg.cls, "supports_images", None) is not None:
            continue
        for ref in dict.fromkeys(r for r in refs if r):
            if "images" in (getattr(load_data(ref), "column_names", None) or ()):
                run.reporter.warn(f"{where}: data '{ref}' holds rows with images, and {sel.reg.kind} '{sel.name}' "
                                  f"from {sel.reg.who()} does not declare that it reads them (supports_images): it "
                                  "may use their text alone (docs/writing-plugins.md)")


class Silent(Reporter):
    """A reporter that says nothing, not even in ``run.log``: what a stage's data preparation says before the
    model loads it says again when it trains (a run's log holds each line once)."""

    def __init__(self) -> None:
        super().__init__(None, None, None, None)

    def info(self, message: str) -> None:
        pass

    def warn(self, message: str) -> None:
        pass


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
