"""``ftcore sweep``: the plan's ``[sweep]`` hyperparameter search, with Optuna; each trial a full run."""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ftcore
from ftcore.command import Command
from ftcore.errors import ComponentError, FtcoreError, Interrupted

from ftcore_plugins.commands._sweep_plan import SweepSection

MANIFEST = "sweep.json"
STUDY_DB = "study.db"


class TrialStopped(BaseException):
    """Raised from the pruning hook to end a trial's run at once. A BaseException, like Ctrl-C, so
    that no component's error handling swallows it; the trial's manifest says ``pruned``."""

    run_status = "pruned"


class TrialFailed(Exception):
    """A trial's run failed (its error is recorded on the trial); the sweep goes on."""


class SweepCommand(Command):
    """Search hyperparameters over the plan's [sweep] space with Optuna; each trial is a full run.

    Trials run one after another in this process, in runs/<name>/trials/<n>/, each made by the same
    runner as `ftcore run`. The stages before the first searched one are trained once, in
    runs/<name>/shared/, and every trial starts from them; the base model is loaded once. The
    study lives in runs/<name>/study.db (SQLite), so --resume continues a killed sweep and reruns
    its interrupted trial from that trial's last checkpoint. At the end it writes best_plan.toml
    (the plan with the best values) and the sweep report (sweep.html, sweep.md).
    """

    name = "sweep"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("plan", help="the plan (TOML), with a [sweep] table")
        parser.add_argument("--resume", action="store_true",
                            help="continue the sweep in the plan's folder: finished trials stay, an interrupted "
                                 "one is rerun from its last checkpoint")

    def run(self, args: argparse.Namespace) -> int:
        from rich.console import Console

        from ftcore_plugins.commands.quiet import quiet_libraries

        quiet_libraries(verbose=args.debug)
        plan, pm = self.load_plan(args.plan)
        if plan.sweep is None:
            raise FtcoreError(f"{args.plan}: has no [sweep] table; add one with the space to search (docs/sweeps.md)")
        try:
            import optuna
        except ImportError:
            raise FtcoreError("ftcore sweep needs Optuna; install it with: pip install 'ftcore[sweep]'") from None
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        console = Console()
        sweep = Sweeper(plan, pm, console, args.plan, resume=args.resume)
        again = f"continue with: ftcore sweep {args.plan} --resume"

        def terminated(signum, frame):
            raise Interrupted(f"terminated (SIGTERM); {again}", 128 + signum)

        previous = signal.signal(signal.SIGTERM, terminated)
        try:
            study = sweep.run()
        except KeyboardInterrupt as exc:
            sweep.mark("interrupted")
            raise Interrupted(f"sweep interrupted; {again}", getattr(exc, "exit_code", 130)) from None
        except BaseException:
            sweep.mark("failed")
            raise
        finally:
            signal.signal(signal.SIGTERM, previous)
        sweep.finish(study)
        return 0


class Sweeper:
    """One ``ftcore sweep``: the folder, the study, the shared stages and the trials."""

    def __init__(self, plan: Any, pm: Any, console: Any, shown: str, resume: bool):
        self.plan, self.pm, self.console, self.shown, self.resume = plan, pm, console, shown, resume
        self.spec = plan.sweep
        self.folder = plan.run_dir
        from ftcore_plugins.commands._sweep_runner import ModelCache

        self.models = ModelCache() if self.spec.share_stages else None
        stages = plan.stages
        self.shared = stages[:self.spec.first_searched_stage(len(stages))] if self.spec.share_stages else []
        # The stage whose eval loss pruning reads (none in a plan without stages, e.g. evaluations alone).
        self.pruned = stages[self.spec.pruned_stage(len(stages))].name if stages else ""
        self.registries = [_Indexed(i, e) for i, e in enumerate(plan.exports)
                           if getattr(e.exporter.reg.cls, "reads_exports", False)]
        self.seconds = {"shared": 0.0, "trials": 0.0}

    # -- the folder ------------------------------------------------------------------------------
    def claim_folder(self) -> None:
        """Use the plan's run folder for this sweep, or refuse: it never takes over another run's folder."""
        from ftcore import rundir

        manifest = self.folder / MANIFEST
        fingerprint = self.fingerprint()
        if manifest.exists():
            previous = rundir.read_json(manifest) or {}
            if previous.get("status") == "failed" and not any((self.folder / d).exists() for d in ("trials", "shared")):
                # It stopped before any run (a storage it could not open): nothing here is worth keeping.
                for name in (MANIFEST, STUDY_DB):
                    (self.folder / name).unlink(missing_ok=True)
                return self.claim_folder()
            if previous.get("fingerprint") != fingerprint:
                raise FtcoreError(f"{self.folder}: holds a sweep of a different plan or space ({previous.get('plan_path')}); "
                                  "change run.name to sweep into another folder")
            if not self.resume:
                raise FtcoreError(f"{self.folder}: this sweep already ran here (status: {previous.get('status')}); "
                                  f"pass --resume to continue it, or change run.name to start another")
            rundir.write_json(manifest, {**previous, "status": "running", "resumed_at":
                                         [*previous.get("resumed_at", []), rundir.now()]})
            return
        if self.folder.exists() and any(self.folder.iterdir()):
            what = "a run of `ftcore run`" if (self.folder / rundir.MANIFEST).exists() else "files"
            raise FtcoreError(f"{self.folder}: holds {what}, not a sweep; set run.name to sweep into another folder")
        self.folder.mkdir(parents=True, exist_ok=True)
        rundir.write_json(manifest, {"plan_path": str(self.plan.path), "fingerprint": fingerprint, "status": "running",
                                     "started_at": rundir.now(), "storage": self.storage_url(redact=True)})

    def fingerprint(self) -> str:
        """The plan and its space; not the number of trials, which a resumed sweep may raise."""
        import hashlib

        raw = {**self.plan.raw, "sweep": {k: v for k, v in self.plan.raw["sweep"].items() if k != "trials"}}
        return hashlib.sha256(json.dumps(raw, sort_keys=True, default=str).encode()).hexdigest()

    def storage_url(self, redact: bool = False) -> str:
        if self.spec.storage is None:
            return f"sqlite:///{self.folder / STUDY_DB}"
        if redact:  # "postgresql://user:password@host/db": the password stays out of files
            from ftcore.plan import redact as hide

            return hide(self.spec.storage)
        return self.spec.storage

    # -- the study -------------------------------------------------------------------------------
    def study(self) -> Any:
        import optuna

        spec, seed = self.spec, self.spec.seed if self.spec.seed is not None else self.plan.seed
        startup = spec.startup_trials or min(10, max(1, spec.trials // 3))
        sampler = {
            "tpe": lambda: optuna.samplers.TPESampler(seed=seed, n_startup_trials=startup),
            "random": lambda: optuna.samplers.RandomSampler(seed=seed),
            "grid": lambda: optuna.samplers.GridSampler({p.path: p.grid() for p in spec.space}, seed=seed),
            "cmaes": lambda: optuna.samplers.CmaEsSampler(seed=seed, n_startup_trials=startup),
        }[spec.sampler]()
        pruner = {
            "median": lambda: optuna.pruners.MedianPruner(n_startup_trials=spec.prune_startup_trials,
                                                          n_warmup_steps=spec.prune_warmup_steps),
            "hyperband": lambda: optuna.pruners.HyperbandPruner(min_resource=max(1, spec.prune_warmup_steps)),
            "none": lambda: optuna.pruners.NopPruner(),
        }[spec.pruner]()
        # A shared database (several machines on one study) needs heartbeats to find trials whose
        # process died elsewhere; trials of a dead process on this machine are found by their pid.
        shared = spec.storage is not None and not spec.storage.startswith("sqlite")
        for attempt in range(5):
            try:
                storage = optuna.storages.RDBStorage(self.storage_url(), heartbeat_interval=60 if shared else None,
                                                     grace_period=600 if shared else None)
                break
            except Exception as exc:  # noqa: BLE001 - workers starting together race to create the tables
                if attempt == 4 or isinstance(exc, ImportError):  # a driver missing is no race
                    first = (str(exc).strip().splitlines() or [""])[0]
                    raise FtcoreError(f"sweep.storage: cannot open {self.storage_url(redact=True)}: "
                                      f"{type(exc).__name__}: {first}") from None
                time.sleep(1 + attempt)
        self.storage = storage
        return optuna.create_study(storage=storage, sampler=sampler, pruner=pruner,
                                   study_name=spec.study or self.plan.run_name,
                                   direction=spec.direction, load_if_exists=True)

    def requeue_interrupted(self, study: Any) -> list[int]:
        """Trials a stopped sweep left unfinished: those interrupted (Ctrl-C, SIGTERM), and those still
        marked running by a process of this machine that is gone (SIGKILL). Each is marked failed and
        interrupted, and its parameters are queued again: the new trial continues the old one's run
        folder from its last checkpoint. Returns the interrupted trial numbers."""
        from optuna.trial import TrialState

        found = []
        for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING, TrialState.FAIL)):
            attrs = t.user_attrs
            if t.state == TrialState.RUNNING and (attrs.get("host") != socket.gethostname() or _alive(attrs.get("pid"))):
                continue
            if t.state == TrialState.FAIL and not (attrs.get("interrupted") and not attrs.get("requeued")):
                continue
            # FrozenTrial keeps its storage id private; the storage API needs it.
            self.storage.set_trial_user_attr(t._trial_id, "interrupted", True)
            self.storage.set_trial_user_attr(t._trial_id, "requeued", True)
            if t.state == TrialState.RUNNING:
                self.storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
            study.enqueue_trial(t.params, user_attrs={"continues": attrs.get("folder", str(t.number))})
            found.append(t.number)
        return found

    def finished(self, study: Any) -> int:
        from optuna.trial import TrialState

        return len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)))

    # -- running ---------------------------------------------------------------------------------
    def run(self) -> Any:
        from ftcore.plan import check_plan

        self.claim_folder()
        study = self.study()
        started = time.perf_counter()
        if self.resume:
            for number in self.requeue_interrupted(study):
                self.say(f"trial {number} was interrupted: it runs again from its last checkpoint")
        if self.shared:
            from ftcore_plugins.commands._sweep_runner import SweepRunner

            raw = self.trial_raw({}, "shared", self.folder)
            raw["stage"] = raw["stage"][:len(self.shared)]
            for key in ("evaluate", "export", "track"):
                raw.pop(key, None)
            plan = check_plan(raw, self.plan.path, self.pm.registry(), shown=f"{self.shown} [shared stages]")
            self.say(f"shared stages ({', '.join(s.name for s in self.shared)}): trained once, in {self.folder / 'shared'}")
            t0 = time.perf_counter()
            SweepRunner(plan, self.pm, self.console, resume=(self.folder / "shared").exists(),
                        models=self.models).run()
            self.seconds["shared"] += time.perf_counter() - t0
        failures = 0
        while self.finished(study) < self.spec.trials:
            before = len(study.trials)
            study.optimize(self.objective, n_trials=1, catch=(TrialFailed,))
            last = study.trials[before] if len(study.trials) > before else None
            failures = failures + 1 if last is not None and last.state.name == "FAIL" else 0
            if failures >= 3:
                raise FtcoreError(f"{failures} trials in a row failed (last: trial {last.number}: "
                                  f"{last.user_attrs.get('error', '?')}); see {self.folder / 'trials'}")
        self.seconds["wall"] = time.perf_counter() - started
        return study

    def trial_raw(self, values: dict, name: str, output_dir: Path) -> dict[str, Any]:
        """A trial's plan: the sweep's values in, its run folder set, and no export that registers
        (``reads_exports``): the sweep registers its best trial alone, at the end."""
        from ftcore_plugins.commands._sweep_plan import apply, strip

        raw = apply(strip(self.plan.raw), values)
        raw["run"] = {**raw.get("run", {}), "output_dir": str(output_dir), "name": name}
        if self.registries:
            sections = raw["export"] if isinstance(raw["export"], list) else [raw["export"]]
            raw["export"] = [s for i, s in enumerate(sections) if i not in {e.index for e in self.registries}]
        return raw

    def register_best(self, best: Any) -> list[Path]:
        """Run the plan's registering exports (``[[export]] use = "mlflow"``) on the best trial's run
        folder and its exports, as its own run would have; their records go under ``registered/``."""
        from ftcore import rundir
        from ftcore.context import ExportContext, RunInfo
        from ftcore.reporter import Reporter
        from ftcore.runner import calling

        trial_dir = self.folder / "trials" / str(best.user_attrs["folder"])
        if not trial_dir.is_dir():  # another machine or worker of a shared study ran it
            self.say(f"the best trial ({best.number}) ran in another worker's sweep folder: register it there, "
                     f"with this plan's registry export, by running this sweep there with --resume")
            return []
        done = rundir.read_json(trial_dir / "exports.json") or {}
        reporter = Reporter(self.console, None, None, None)
        # The sweep's plan (its run name names the registered model), the best trial's folder.
        info = RunInfo(self.plan, trial_dir, 0, 1, reporter)
        written = []
        for e in self.registries:
            out = self.folder / "registered" / e.export.name
            out.parent.mkdir(exist_ok=True)
            ctx = ExportContext(info, reporter, None, None, None, None, out, e.export.name,
                                exports={k: rundir.stored(trial_dir, v) for k, v in done.items()})
            with calling(e.export.exporter, "export"):
                written.append(Path(e.export.exporter.create().export(ctx) or out))
        return written

    def objective(self, trial: Any) -> float:
        from ftcore import memory
        from ftcore.plan import check_plan

        from ftcore_plugins.commands._sweep_runner import SweepRunner

        spec = self.spec
        values = {p.keys: suggest(trial, p) for p in spec.space}
        continues = trial.user_attrs.get("continues")
        folder = str(continues if continues is not None else trial.number)
        for key, value in (("folder", folder), ("host", socket.gethostname()), ("pid", os.getpid())):
            trial.set_user_attr(key, value)
        shown = ", ".join(f"{p.path} = {_short(trial.params[p.path])}" for p in spec.space)
        self.say(f"[bold]trial {trial.number}[/]" + (f" (continues trial folder {folder})" if continues is not None
                                                      else "") + f": {shown}")
        plan = check_plan(self.trial_raw(values, folder, self.folder / "trials"), self.plan.path, self.pm.registry(),
                          shown=f"{self.shown} [trial {trial.number}]")
        watch = EvalLossWatch(trial, self.pruned, -1.0 if spec.direction == "maximize" else 1.0)
        name = f"ftcore-sweep-trial-{trial.number}"
        self.pm.register(watch, name=name)
        shared = {s.name: self.folder / "shared" / "stages" / s.name for s in self.shared}
        t0 = time.perf_counter()
        try:
            summary = SweepRunner(plan, self.pm, self.console, resume=continues is not None, shared_stages=shared,
                                  models=self.models).run()
        except TrialStopped as stop:
            import optuna

            trial.set_user_attr("pruned_at_step", watch.step)
            self.say(f"trial {trial.number}: pruned at step {watch.step} ({stop})")
            raise optuna.TrialPruned(str(stop)) from None
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM: Optuna marks the trial failed; --resume reruns it
            trial.set_user_attr("interrupted", True)
            raise
        except (FtcoreError, ComponentError) as exc:
            trial.set_user_attr("error", str(exc)[:500])
            self.say(f"[red]trial {trial.number} failed[/]: {exc}")
            raise TrialFailed(str(exc)) from None
        finally:
            self.pm.unregister(name=name)
            seconds = time.perf_counter() - t0
            self.seconds["trials"] += seconds
            trial.set_user_attr("seconds", round(seconds, 2))
            memory.release()
        # Every evaluation after training, for the report: the search reads one, a user wants them all.
        trial.set_user_attr("results", {f"{ev}/{k}": v for ev, values in summary.get("evaluations", {}).get("after", {})
                                        .items() for k, v in values.items() if k not in ("n", "tokens")
                                        and isinstance(v, (int, float)) and not isinstance(v, bool)})
        value = metric_value(summary, spec.metric, plan.run_dir, self.pruned)
        self.say(f"trial {trial.number}: {spec.metric} = {value:.6g} ({seconds:.1f} s)")
        return value

    def mark(self, status: str) -> None:
        from ftcore import rundir

        manifest = self.folder / MANIFEST
        if manifest.exists():
            rundir.write_json(manifest, {**(rundir.read_json(manifest) or {}), "status": status, "ended_at": rundir.now()})

    def finish(self, study: Any) -> None:
        from ftcore import rundir

        from ftcore_plugins.commands._sweep_report import best_plan_text, best_trial, state_counts, write_report

        best = best_trial(study)
        out: dict[str, Any] = {"status": "complete", "ended_at": rundir.now(), "seconds": self.seconds}
        if self.models is not None:
            out["models"] = {"built": self.models.built, "copied": self.models.copied}
        if best is not None:
            rundir.write_text(self.folder / "best_plan.toml", best_plan_text(self.plan, self.spec, best, self.folder))
            out["best"] = {"trial": best.number, "value": best.value, "params": best.params,
                           "folder": best.user_attrs.get("folder")}
            out["registered"] = [str(p) for p in self.register_best(best)]
        manifest = self.folder / MANIFEST
        rundir.write_json(manifest, {**(rundir.read_json(manifest) or {}), **out})
        html_path, _ = write_report(self.folder, study, self.spec, self.seconds)
        counts = state_counts(study)
        failed = counts.get("fail", 0) + counts.get("interrupted", 0)
        self.say(f"sweep done: {counts.get('complete', 0)} finished, {counts.get('pruned', 0)} pruned, "
                 f"{failed} failed, in {self.seconds['wall']:.0f} s")
        if best is not None:
            self.say(f"best: trial {best.number}, {self.spec.metric} = {best.value:.6g}: "
                     + ", ".join(f"{k} = {_short(v)}" for k, v in best.params.items()))
            self.say(f"best plan: {self.folder / 'best_plan.toml'}")
        self.say(f"report: {html_path}")

    def say(self, text: str) -> None:
        self.console.print(text, highlight=False, soft_wrap=True)


@dataclass
class _Indexed:
    index: int  # the export's place in the plan's [[export]] array
    export: Any


class EvalLossWatch:
    """A run plugin for one trial: reports each eval loss of the searched stage to Optuna as an
    intermediate value (negated when the study maximises, so that lower loss is better either way)
    and stops the run when the pruner says so."""

    def __init__(self, trial: Any, stage: str, sign: float):
        self.trial, self.stage, self.sign = trial, stage, sign
        self.step: int | None = None

    @ftcore.hookimpl
    def ftcore_log(self, run: Any, stage: str, step: int | None, metrics: dict[str, float]) -> None:
        if stage != self.stage or step is None or not isinstance(metrics.get("eval_loss"), float):
            return
        self.step = step
        self.trial.report(self.sign * metrics["eval_loss"], step)
        if self.trial.should_prune():
            raise TrialStopped(f"eval_loss {metrics['eval_loss']:.4g} at step {step} is worse than the median "
                               f"of earlier trials there")


def suggest(trial: Any, p: Any) -> Any:
    if p.kind == "categorical":
        return trial.suggest_categorical(p.path, list(p.choices))
    if p.kind == "int":
        return trial.suggest_int(p.path, p.low, p.high, step=p.step or 1, log=p.log)
    return trial.suggest_float(p.path, float(p.low), float(p.high), step=p.step, log=p.log)


def metric_value(summary: dict[str, Any], metric: str, run_dir: Path, stage: str) -> float:
    """The trial's value of the sweep's metric: an evaluation's after training, or the stage's last
    eval loss (from the run's metrics, the last attempt of each step)."""
    import math

    from ftcore_plugins.commands.report import latest_attempts, read_records

    if metric == "eval_loss":
        losses = [r["eval_loss"] for r in latest_attempts(read_records(run_dir))
                  if r.get("stage") == stage and isinstance(r.get("eval_loss"), (int, float))]
        if not losses:
            raise FtcoreError(f"sweep.metric: stage {stage!r} logged no eval_loss in {run_dir}")
        return float(losses[-1])
    evaluation, _, key = metric.partition("/")
    results = summary.get("evaluations", {}).get("after", {}).get(evaluation)
    if results is None:
        raise FtcoreError(f"sweep.metric: evaluation {evaluation!r} has no result after training in {run_dir}")
    key = key or evaluation
    value = results.get(key)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value):
        numbers = [k for k, v in results.items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
        raise FtcoreError(f"sweep.metric: evaluation {evaluation!r} gives no number {key!r}; it gives "
                          f"{', '.join(numbers) or 'none'}: write metric = \"{evaluation}/<one of them>\"")
    return float(value)


def _short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _alive(pid: Any) -> bool:
    if not isinstance(pid, int):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return pid != os.getpid()


@ftcore.hookimpl
def register_commands(register):
    register(SweepCommand)


@ftcore.hookimpl
def register_plan_sections(register):
    register(SweepSection)
