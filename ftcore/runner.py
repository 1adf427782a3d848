"""The stage runner: plan -> model -> before-evaluation -> stages -> after-evaluation -> exports. It only
calls components. Each step leaves a marker in the run directory so ``--resume`` can skip what is done
and rebuild the model a later step needs from the saved stage outputs."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import memory, rundir
from .context import AdapterContext, DataContext, EvalContext, ExportContext, LoadContext, RunInfo, StageContext
from .errors import ComponentError, FtcoreError, PlanError, one_line
from .plan import Plan, Selected, Stage, phase_order, subkey
from .plugins import PluginManager
from .reporter import Reporter


@dataclass
class ModelState:
    model: Any
    tokenizer: Any
    adapter: Selected | None  # the adapter whose weights are live on the model
    adapter_from: int  # index of the stage where that adapter was first applied


@dataclass
class StepTime:
    name: str
    seconds: float
    skipped: bool = False


class Runner:
    def __init__(self, plan: Plan, pm: PluginManager, console: Any, *, resume: bool = False, force: bool = False):
        self.plan = plan
        self.keeps_models = True  # False while a model is built that no later run may reuse (see _kept)
        self.pm = pm
        self.resume = resume
        self.force = force
        self.run_dir = plan.run_dir
        rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
        self.info = RunInfo(plan, self.run_dir, rank, world)
        self.console = console if self.info.is_main else None
        self.reporter: Reporter | None = None
        self.quantizer = plan.quantizer.create()
        self.template = plan.template.create()
        self._data: dict[str, Any] = {}
        self._base: tuple[Any, Any] | None = None
        self._live: ModelState | None = None  # the model the exports read, while they run
        self.steps: list[StepTime] = []
        self.evaluations: dict[str, dict[str, Any]] = {}
        self.stage_metrics: dict[str, dict[str, Any]] = {}
        self.exports: dict[str, str] = {}
        self.memory: dict[str, dict[str, Any]] = {}
        self._trackers: list[str] = []  # plugin names of the trackers registered for this run

    # -- paths ---------------------------------------------------------------------------
    def stage_dir(self, stage: Stage) -> Path:
        return self.run_dir / "stages" / stage.name

    def export_path(self, export: Any) -> Path:
        return export.path or self.run_dir / "exports" / export.name

    # -- the run -------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        # The plugins' checks of the model (ftcore_preflight), before the run folder is made or a weight is read.
        problems = self._checks("ftcore_preflight", plan=self.plan)
        if problems:
            raise PlanError([self.plan.problem(*subkey("", m)) for m in problems])
        # Rank 0 alone applies the run-directory rules; the others wait for its decision before they read
        # ([distributed]'s on_main shares it).
        decide = self._prepare
        for section in self.plan.sections.values():
            decide = functools.partial(section.on_main, decide)
        note = decide()
        handler = self._log_to_file()
        self.reporter = Reporter(self.console, self.run_dir / "metrics.jsonl" if self.info.is_main else None,
                                 self.pm if self.info.is_main else None, self.info)
        self.info.reporter = self.reporter
        if note:
            self.reporter.info(note)
        manifest = self._write_manifest(status="running")
        self.reporter.attempt = 1 + len(manifest.get("resumed_at", []))
        error: BaseException | None = None
        try:
            self._start_trackers()
            self._notify("ftcore_run_start", run=self.info)
            memory.reset_peak()
            self._measure("baseline")
            self._steps()
            summary = self._summary()
            if self.info.is_main:
                rundir.write_json(self.run_dir / "summary.json", summary)
        except BaseException as exc:
            error = exc
            raise
        finally:
            if self.info.is_main:  # complete: the hardware again, as accelerators are known once torch is imported
                ended = {"error": str(error)[:500]} if error is not None else {"hardware": rundir.hardware()}
                rundir.write_json(self.run_dir / rundir.MANIFEST, {**manifest, "status": rundir.run_status(error),
                                                                   "ended_at": rundir.now(), **ended})
            self._notify("ftcore_run_end", run=self.info, error=error)
            self._stop_trackers()
            self._close_log(handler)
        return summary

    def _checks(self, hook: str, **kwargs: Any) -> list[str]:
        """Each plugin's ``hook`` in registration order, the problems they return together; a plugin
        that raises stops the run, its bug named as such."""
        problems = []
        for impl in reversed(getattr(self.pm.hook, hook).get_hookimpls()):
            try:
                problems += impl.function(**kwargs) or []
            except (FtcoreError, ComponentError, KeyboardInterrupt):
                raise
            except Exception as exc:
                raise ComponentError(f"plugin '{impl.plugin_name}' failed in {hook}: {one_line(exc)}") from exc
        return problems

    def _prepare(self) -> str:
        self._check_exports_free()
        return rundir.prepare(self.run_dir, self.plan.fingerprint(), self.resume, self.force)

    def _kept(self, key: list[Any], build: Any) -> tuple[Any, Any]:
        """``build()`` the base model (``key``: "base", ...) or a finished stage's ("stage", ...); ``ftcore
        sweep``'s runner returns a copy of what an earlier run built, while ``keeps_models`` holds."""
        return build()

    def _steps(self) -> None:
        plan = self.plan
        done = [self._marker(s) for s in plan.stages]
        # Stages complete in order; one after an unfinished stage is redone, whatever its marker says.
        last_done = -1
        while last_done + 1 < len(done) and done[last_done + 1]:
            last_done += 1
        pending = plan.stages[last_done + 1:]
        before = self._phase_pending("before")
        # An evaluation right after a stage is stale once that stage trains again; one after
        # training, and every export, once any stage does.
        between = {s.name: self._phase_pending(s.name, stale=s in pending) for s in plan.stages[:-1]}
        after = self._phase_pending("after", stale=bool(pending))
        exports = [e for e in plan.exports if pending or not self._export_done(e)]
        for stage in plan.stages[: last_done + 1]:
            self.steps.append(StepTime(stage.name, 0.0, skipped=True))
            self.stage_metrics[stage.name] = (done[stage.index] or {}).get("metrics", {})
        if not (before or pending or after or exports or any(between.values())):
            self.reporter.info("nothing left to do: every stage, evaluation and export is complete")
            return

        if pending:
            # The data first, each source once (the stages and evaluations reuse it): a bad row stops the run
            # before the model loads, and so does data a trainer refuses to prepare (ftcore_prepare_data).
            refs = [ref for s in pending for ref in (s.data, s.eval_data) if ref]
            for ref in dict.fromkeys([*refs, *(e.data for e in plan.evaluations if e.data)]):
                self._load_data(ref)
            self._checks("ftcore_prepare_data", run=self.info, stages=pending, load_data=self._load_data)
        if before:
            # No local name for the model: one here would hold it (trained and merged in place) through
            # the exports, after an exporter releases it.
            self._evaluate("before", *self._load_base())
        for stage in plan.stages[:max(last_done, 0)]:  # finished stages whose evaluation did not (killed between)
            if between[stage.name]:
                self._evaluate(stage.name, *self.model_at(stage.name))
        last_between = last_done >= 0 and between.get(plan.stages[last_done].name)
        # Only exports that read other exports' folders left (a registry after a kill): no model needed.
        if pending or after or any(map(_needs_model, exports)) or last_between:
            state = self._materialize(last_done)
        else:
            state = ModelState(None, None, None, last_done)
        if last_between:
            self._evaluate(plan.stages[last_done].name, state.model, state.tokenizer)
        for stage in pending:
            state = self._train(stage, state)
            if between.get(stage.name):
                self._evaluate(stage.name, state.model, state.tokenizer)
        if after:
            self._evaluate("after", state.model, state.tokenizer)
        # Exports that read the adapter model as it is go first; then those that merge it (``merges =
        # True``), which may merge it in place and hand the merged model on, so no export holds two
        # copies of the model.
        # Exports that only read the others' folders (``reads_exports``) come last and get no model.
        exports.sort(key=lambda e: (not _needs_model(e), bool(getattr(e.exporter.reg.cls, "merges", False))))
        using = [e for e in exports if _needs_model(e)]
        self._live, state = state, None
        for export in exports:
            self._export(export, last=not using or export is using[-1])
        self._live = None
        if exports:
            self._measure("exported")

    # -- steps -----------------------------------------------------------------------------
    @contextlib.contextmanager
    def _step(self, name: str) -> Iterator[dict[str, Any]]:
        self._notify("ftcore_stage_start", run=self.info, stage=name)
        start = time.perf_counter()
        metrics: dict[str, Any] = {}
        yield metrics
        seconds = time.perf_counter() - start
        self.steps.append(StepTime(name, seconds))
        self._notify("ftcore_stage_end", run=self.info, stage=name, metrics=metrics, seconds=seconds)

    def _load_base(self) -> tuple[Any, Any]:
        if self._base is not None:
            return self._base
        with self._step("load"):
            work = self.run_dir / "model"
            work.mkdir(parents=True, exist_ok=True)
            plan = self.plan
            key = ["base", plan.seed, plan.raw.get("model"), plan.raw.get("template")]
            memory.keep_alive_objects()
            model, tokenizer = self._kept(key, lambda: self.load_model(work))
        memory.release()  # loading's conversions (a dtype, quantizing) leave freed heap behind
        if "model loaded" not in self.memory:  # a reload (a QLoRA merge's full-precision base) is its export's
            self._measure("model loaded")
        self._base = (model, tokenizer)
        return self._base

    def load_model(self, work_dir: Path) -> tuple[Any, Any]:
        """The plan's model and tokenizer as a run starts from them: loaded, quantized, with the template's
        tokens added; the loader's files go in ``work_dir`` (outside a run: a temporary folder)."""
        plan = self.plan
        self._ensure_reporter()
        ctx = LoadContext(self.info, self.reporter, self.quantizer, plan.seed, work_dir, self._load_data)
        loader = plan.model.create()
        with calling(plan.model, "load"):
            model, tokenizer = loader.load(ctx)
        with calling(plan.quantizer, "prepare"):
            model = self.quantizer.prepare(model)
        prepare = getattr(self.template, "prepare", None)
        if prepare is not None:
            with calling(plan.template, "prepare"):
                model, tokenizer = prepare(model, tokenizer)
        return model, tokenizer

    def _ensure_reporter(self) -> None:
        """Outside a run (no run folder): a reporter that prints and writes nothing."""
        if self.reporter is None:
            self.reporter = Reporter(self.console, None, None, self.info)
            self.info.reporter = self.reporter

    def _materialize(self, index: int, output: Path | None = None) -> ModelState:
        """The model as it was after stage ``index`` (-1: the base model), rebuilt from saved outputs;
        ``output`` replaces stage ``index``'s own output folder (an adapter export of it)."""
        if index < 0:
            model, tokenizer = self._load_base()
            self._base = None  # training changes it in place from here on
            return ModelState(model, tokenizer, None, -1)
        stage = self.plan.stages[index]
        if not stage.trains_policy:  # its product is a separate model; the policy is the one before it
            return self._materialize(index - 1, output)
        marker = self._marker(stage) or {}
        started = int(marker.get("adapter_from", index))
        folder = output or self.stage_dir(stage) / "output"

        def restore() -> tuple[Any, Any]:
            state = self._materialize(started - 1)
            model = self._merged(state)
            with calling(stage.adapter, "restore"):
                model = stage.adapter.create().restore(model, folder, self.adapter_context())
            return model, state.tokenizer

        model, tokenizer = self._kept(["stage", stage.name, str(folder.resolve()), marker.get("finished_at")],
                                      restore) if output is None else restore()
        self.reporter.info(f"stage [bold]{stage.name}[/] is complete: restored its output")
        return ModelState(model, tokenizer, stage.adapter, started)

    def _train(self, stage: Stage, state: ModelState) -> ModelState:
        folder = self.stage_dir(stage)
        checkpoints = folder / "checkpoints"
        if self.info.is_main:
            checkpoints.mkdir(parents=True, exist_ok=True)
        model, adapter_from = state.model, state.adapter_from
        same = state.adapter is not None and state.adapter.reg is stage.adapter.reg \
            and state.adapter.options == stage.adapter.options
        # A stage that trains a separate model (a reward model) gets the policy to start from and its
        # adapter unapplied; the policy passes on to the next stage as it was.
        if stage.trains_policy and not same:
            model = self._merged(state)
            with calling(stage.adapter, "apply"):
                model = stage.adapter.create().apply(model, self.adapter_context())
            adapter_from = stage.index
            self._measure(f"{stage.name}: adapter applied")
        resume_from = _last_checkpoint(checkpoints) if self.resume else None
        with self._step(stage.name) as metrics:
            self.reporter.info(f"stage [bold]{stage.name}[/]: trainer '{stage.trainer.shown}', "
                               f"adapter '{stage.adapter.shown}', data '{stage.data}'"
                               + (f", resuming from {resume_from.name}" if resume_from else ""))
            ctx = StageContext(self.info, self.reporter, stage.name, model, state.tokenizer, self.template,
                               self._load_data(stage.data),
                               self._load_data(stage.eval_data) if stage.eval_data else None,
                               folder, checkpoints, resume_from, self.plan.seed,
                               adapter=stage.adapter.create(),
                               rewards={name: sel.create() for name, sel in self.plan.rewards.items()},
                               outputs={s.name: self.stage_dir(s) / "output" for s in self.plan.stages[:stage.index]},
                               continues_adapter=stage.trains_policy and same)
            memory.reset_peak()
            with calling(stage.trainer, "train"):
                metrics.update(stage.trainer.create().train(ctx) or {})
            memory.release()  # what training freed leaves the resident set: later phases start lean
            metrics.update(self._measure(f"{stage.name}: trained"))
            if stage.trains_policy:
                with calling(stage.adapter, "save"):
                    if self.info.is_main:
                        stage.adapter.create().save(ctx.model, ctx.output)
                        # With its tokenizer a stage's output loads on its own, e.g. as the base of a
                        # later stage's adapter export.
                        state.tokenizer.save_pretrained(ctx.output)
        self.stage_metrics[stage.name] = dict(metrics)
        if self.info.is_main:
            rundir.write_json(folder / rundir.COMPLETE, {
                "stage": stage.name, "trainer": stage.trainer.reg.qualified,
                "adapter": stage.adapter.reg.qualified, "adapter_from": adapter_from,
                "metrics": metrics, "seconds": round(self.steps[-1].seconds, 2), "finished_at": rundir.now()})
        if not stage.trains_policy:
            return state
        return ModelState(ctx.model, state.tokenizer, stage.adapter, adapter_from)

    def _evaluate(self, phase: str, model: Any, tokenizer: Any) -> None:
        results: dict[str, Any] = {}
        order = self._phase_order()
        earlier = order[: order.index(phase)]
        outputs = {s.name: self.stage_dir(s) / "output" for s in self.plan.stages if self._marker(s)}
        with self._step(f"evaluate:{phase}") as metrics:
            for ev in self.plan.evaluations:
                if phase not in ev.when:
                    continue
                out = self.run_dir / "evaluations" / phase / ev.name
                if self.info.is_main:
                    out.mkdir(parents=True, exist_ok=True)
                ctx = EvalContext(self.info, self.reporter, phase, model, tokenizer, self.template,
                                  self._load_data(ev.data) if ev.data else None, out,
                                  earlier={p: self.evaluations[p][ev.name] for p in earlier
                                           if ev.name in self.evaluations.get(p, {})},
                                  outputs=outputs, load_model=self.model_at, load_data=self._load_data,
                                  name=ev.name)
                with calling(ev.evaluator, "evaluate", f"evaluation '{ev.name}', {ev.evaluator.key}"):
                    values = ev.evaluator.create().evaluate(ctx) or {}
                results[ev.name] = values
                self.reporter.log(f"evaluate:{phase}", {f"{ev.name}/{k}": v for k, v in values.items()})
                metrics.update({f"{ev.name}/{k}": v for k, v in values.items()})
        self.evaluations[phase] = results
        memory.release()  # an evaluation's logits and activations
        if self.info.is_main:
            rundir.write_json(self.run_dir / "evaluations" / f"{phase}.json", results)

    def _release_live(self) -> None:
        """Drop the runner's references to the live model (an exporter that owns it now asks)."""
        self._live, self._base = None, None
        memory.release()  # the trainers' objects hold it in reference cycles; the heap keeps freed pages

    def _export(self, export: Any, last: bool) -> None:
        state = self._live if _needs_model(export) else ModelState(None, None, None, -1)
        merges = bool(getattr(export.exporter.reg.cls, "merges", False))
        memory.reset_peak()
        before = memory.snapshot().get("rss_mib")
        path = self.export_path(export)
        # Written under a hidden name next to its place and renamed into place once complete: a killed
        # export leaves no partial folder under the final name (a leftover partial is replaced next time).
        partial = path.with_name(f".{path.name}.partial")
        # What the callbacks need of the state, without the model: the context holds that now, and
        # release_model() drops the runner's own reference.
        where = ModelState(None, state.tokenizer, state.adapter, state.adapter_from)
        with self._step(f"export:{export.name}"):
            ctx = ExportContext(self.info, self.reporter, state.model, state.tokenizer, self.template,
                                state.adapter.create() if state.adapter else None, partial, export.name,
                                provenance=self._provenance(), quantized=self.plan.quantizer.name != "none",
                                load_full_precision_base=lambda: self._full_precision_base(where),
                                final_path=path, adapter_from=where.adapter_from, load_model=self.model_at,
                                consume=merges, last=last, release_model=self._release_live if merges else None,
                                exports={k: Path(v) for k, v in self.exports.items()}, load_data=self._load_data)
            state = None
            if self.info.is_main:
                rundir.remove(partial)  # a killed export's leftover
                path.parent.mkdir(parents=True, exist_ok=True)
                with calling(export.exporter, "export"):
                    artifact = Path(export.exporter.create().export(ctx) or partial)
                if not (partial.exists() or partial.is_symlink()):
                    raise ComponentError(f"exporter '{export.exporter.name}' from {export.exporter.reg.who()} wrote "
                                         f"nothing at the path it was given [{export.exporter.key}]")
                rundir.replace_atomically(partial, path)
                if artifact == partial or partial in artifact.parents:
                    artifact = path / artifact.relative_to(partial)
                self.exports[export.name] = str(artifact)
                done = rundir.read_json(self.run_dir / "exports.json") or {}
                rundir.write_json(self.run_dir / "exports.json",
                                  {**done, export.name: rundir.stored_path(self.run_dir, artifact)})
                self.reporter.info(f"exported [bold]{export.name}[/] to {artifact}")
            if ctx.merged is not None:  # the exports after this one get the merged model
                self._live = ModelState(ctx.merged, where.tokenizer, None, where.adapter_from)
            elif self._live is None and not last and _needs_model(export):
                raise ComponentError(f"exporter '{export.exporter.name}' from {export.exporter.reg.who()} released the "
                                     f"model and handed no merged model on to the exports after it [{export.exporter.key}]")
        self._measure(f"export:{export.name}", rss_before_mib=before)

    def _phase_order(self) -> list[str]:
        return phase_order([s.name for s in self.plan.stages])

    def model_at(self, which: str, output: Path | None = None) -> tuple[Any, Any]:
        """``(model, tokenizer)`` as they were at ``which`` ("base" or a finished stage's name), rebuilt
        from the run's files; the live model is left alone. ``output``: restore that stage's adapter from
        this folder instead of the stage's own output (an adapter export of it)."""
        names = [s.name for s in self.plan.stages]
        if which != "base" and which not in names:
            raise FtcoreError(f"no stage named {which!r} to load; stages: {', '.join(names) or 'none'}")
        index = -1 if which == "base" else names.index(which)
        if index >= 0 and not self._marker(self.plan.stages[index]):
            raise FtcoreError(f"stage {which!r} has not finished yet, so its model cannot be loaded")
        cached, self._base = self._base, None
        try:
            state = self._materialize(index, output)
        finally:
            self._base = cached
        return state.model, state.tokenizer

    def _full_precision_base(self, state: ModelState) -> Any:
        """The model ``state``'s adapter was applied to, rebuilt with the quantizer skipped."""
        none = self.pm.registry().resolve("quantizer", "none").cls
        quantizer, cached = self.quantizer, self._base
        # Built for this export alone: not kept across a sweep's runs (a full-precision copy per process).
        self.quantizer, self._base, self.keeps_models = none(none.Options()), None, False
        try:
            return self._merged(self._materialize(state.adapter_from - 1))
        finally:
            self.quantizer, self._base, self.keeps_models = quantizer, cached, True

    def _merged(self, state: ModelState) -> Any:
        """``state``'s model with its live adapter, if it has one, merged in."""
        if state.adapter is None:
            return state.model
        with calling(state.adapter, "merge"):
            return state.adapter.create().merge(state.model)

    def _provenance(self) -> dict[str, Any]:
        manifest = rundir.read_json(self.run_dir / rundir.MANIFEST) or {}
        plan = self.plan.redacted()
        # Data files by their path relative to the plan's folder: a card travels, this machine's paths do not.
        files = {_relative(Path(f), self.plan.base_dir): d for f, d in manifest.get("data_files", {}).items()}
        return {"base_model": plan.get("model", {}), "quantizer": plan.get("quantizer", "none"),
                "plan_fingerprint": self.plan.fingerprint(), "data_files": files, "metrics": self.evaluations,
                "stages": manifest.get("resolved", {}).get("stages", []),
                "ftcore_version": manifest.get("ftcore_version")}

    # -- helpers ---------------------------------------------------------------------------
    def _start_trackers(self) -> None:
        """Register the plan's trackers as plugins for this run: they see it through the lifecycle hooks."""
        for sel in self.plan.trackers:
            with calling(sel, "__init__"):
                tracker = sel.create()
            self._trackers.append(self.pm.add_run_plugin(tracker, sel.reg))

    def _stop_trackers(self) -> None:
        while self._trackers:
            self.pm.unregister(name=self._trackers.pop())

    def adapter_context(self) -> AdapterContext:
        return AdapterContext(self.info, self.reporter, self.quantizer)

    def _load_data(self, ref: str) -> Any:
        """A plan data reference, ``name`` or ``name:split`` (a plain name: "train"), as a Dataset (cached)."""
        name, _, split = ref.partition(":")
        if name not in self._data:
            sel = self.plan.data[name]
            component = sel.create()
            with calling(sel, "load"):
                loaded = component.load(DataContext(self.info, self.reporter, name, self._load_data))
            self._data[name] = loaded if isinstance(loaded, dict) else {"train": loaded}
            stats = getattr(component, "stats", None)
            if stats and self.reporter is not None:
                self.reporter.data_report(f"source/{name}", stats)
        splits = self._data[name]
        if (split or "train") not in splits:
            raise FtcoreError(f"data '{name}' has no split '{split}'; it has: {', '.join(splits)}")
        return splits[split or "train"]

    def _marker(self, stage: Stage) -> dict[str, Any] | None:
        return rundir.read_json(self.stage_dir(stage) / rundir.COMPLETE)

    def _phase_pending(self, phase: str, stale: bool = False) -> bool:
        wanted = any(phase in e.when for e in self.plan.evaluations)
        stored = rundir.read_json(self.run_dir / "evaluations" / f"{phase}.json")
        if stored is not None and self.resume and not stale:
            self.evaluations[phase] = stored
            self.steps.append(StepTime(f"evaluate:{phase}", 0.0, skipped=True))
            return False
        return wanted

    def _export_done(self, export: Any) -> bool:
        done = rundir.read_json(self.run_dir / "exports.json") or {}
        if export.name in done and self.resume:
            self.exports[export.name] = str(rundir.stored(self.run_dir, done[export.name]))
            return True
        return False

    def _check_exports_free(self) -> None:
        """Refuse before any work if an export would land on files the user already has."""
        done = rundir.read_json(self.run_dir / "exports.json") or {}
        for export in self.plan.exports:
            path = self.export_path(export)
            inside = self.run_dir in path.parents
            if path.exists() and any(path.iterdir() if path.is_dir() else [path]) and not inside \
                    and not (self.resume and export.name in done):
                raise FtcoreError(f"{self.plan.path.name}: export '{export.name}': {path} already exists; "
                                  "choose another export path or move it away (ftcore never overwrites it)")

    def _measure(self, point: str, **extra: Any) -> dict[str, Any]:
        """Record memory at a point of the run; peaks are since the last reset."""
        values = {**memory.snapshot(), **{k: v for k, v in extra.items() if v is not None}}
        self.memory[point] = values
        if self.reporter is not None:
            self.reporter.log("memory", {f"{point}/{k}": v for k, v in values.items()})
        return {f"memory/{k}": v for k, v in values.items()}

    def _notify(self, hook: str, **kwargs: Any) -> None:
        for problem in self.pm.notify(hook, **kwargs):
            if self.reporter is not None:
                self.reporter.warn(problem)

    def _log_to_file(self) -> logging.Handler:
        # Only rank 0 writes into the run directory; other ranks log to stderr.
        if self.info.is_main:
            handler: logging.Handler = logging.FileHandler(self.run_dir / "run.log", encoding="utf-8")
        else:
            handler = logging.StreamHandler()
            handler.setLevel(logging.WARNING)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        root = logging.getLogger()
        root.addHandler(handler)
        if root.level > logging.INFO or root.level == logging.NOTSET:
            root.setLevel(logging.INFO)
        return handler

    @staticmethod
    def _close_log(handler: logging.Handler) -> None:
        logging.getLogger().removeHandler(handler)
        handler.close()

    def _write_manifest(self, status: str) -> dict[str, Any]:
        plan = self.plan
        inputs = {str(path): {"data": name, "sha256": rundir.sha256(path), "bytes": path.stat().st_size}
                  for name, sel in plan.data.items() for path in map(Path, sel.create().inputs()) if path.is_file()}
        dists = {i.dist for i in self.pm.infos.values() if i.dist != "ftcore"}
        manifest = {
            "ftcore_version": rundir.package_versions()["ftcore"],
            "status": status,
            "started_at": rundir.now(),
            "plan_path": str(plan.path),
            "plan_fingerprint": plan.fingerprint(),
            "plan": plan.redacted(),
            "resolved": {
                "model": plan.model.reg.qualified, "quantizer": plan.quantizer.reg.qualified,
                "template": plan.template.reg.qualified,
                "data": {k: v.reg.qualified for k, v in plan.data.items()},
                "stages": [{"name": s.name, "trainer": s.trainer.reg.qualified, "adapter": s.adapter.reg.qualified,
                            "data": s.data} for s in plan.stages],
                "evaluate": [{"name": e.name, "evaluator": e.evaluator.reg.qualified, "data": e.data,
                              "when": list(e.when)} for e in plan.evaluations],
                "export": [{"name": e.name, "exporter": e.exporter.reg.qualified,
                            "path": str(self.export_path(e))} for e in plan.exports],
            },
            "plugins": [{"name": i.name, "dist": i.dist, "version": i.version, "source": i.source}
                        for i in self.pm.infos.values()],
            "packages": rundir.package_versions(sorted(dists)),
            "data_files": inputs,
            "git": rundir.git_info(plan.base_dir),
            "hardware": rundir.hardware(),
            "world_size": self.info.world_size,
        }
        if self.info.is_main:
            previous = rundir.read_json(self.run_dir / rundir.MANIFEST)
            if previous and self.resume:
                manifest["started_at"] = previous.get("started_at", manifest["started_at"])
                manifest["resumed_at"] = [*previous.get("resumed_at", []), rundir.now()]
            rundir.write_json(self.run_dir / rundir.MANIFEST, manifest)
        return manifest

    def _summary(self) -> dict[str, Any]:
        return {
            "run_dir": str(self.run_dir),
            "evaluations": {p: self.evaluations[p] for p in self._phase_order() if p in self.evaluations},
            "stages": self.stage_metrics,
            "exports": self.exports,
            "memory": self.memory,
            "steps": [{"name": s.name, "seconds": round(s.seconds, 2), "skipped": s.skipped} for s in self.steps],
        }


@contextlib.contextmanager
def calling(sel: Selected, what: str, where: str | None = None) -> Iterator[None]:
    """Turn an exception inside a component into one line that names the plugin and where in the
    plan (``where``, default the plan key)."""
    try:
        yield
    except (FtcoreError, ComponentError, KeyboardInterrupt):
        raise
    except Exception as exc:
        raise ComponentError(f"{sel.reg.kind} '{sel.name}' from {sel.reg.who()} failed in {what}() "
                             f"[{where or sel.key}]: {one_line(exc)}") from exc


def _needs_model(export: Any) -> bool:
    """False for an exporter that only reads other exports' folders (``reads_exports = True``)."""
    return not getattr(export.exporter.reg.cls, "reads_exports", False)


def _relative(path: Path, base: Path) -> str:
    try:
        return path.resolve().relative_to(base.resolve()).as_posix()
    except ValueError:
        return path.name


def _last_checkpoint(folder: Path) -> Path | None:
    """The newest complete checkpoint: a trainer writes ``COMPLETE.json`` into a checkpoint folder
    (atomically) once everything else in it is saved, so a save killed halfway is never picked."""
    found = []
    for child in folder.glob("checkpoint-*"):
        m = re.fullmatch(r"checkpoint-(\d+)", child.name)
        if m and (child / rundir.COMPLETE).exists():
            found.append((int(m.group(1)), child))
    return max(found)[1] if found else None
