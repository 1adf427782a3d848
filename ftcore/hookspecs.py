"""The hooks plugins implement: one registry hook per kind of component, in the callback style of
simonw/llm (the hook calls ``register`` once per class), and lifecycle hooks that observe a run."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pluggy

hookspec = pluggy.HookspecMarker("ftcore")

Register = Callable[[type], None]


@hookspec
def register_model_loaders(register: Register) -> None:
    """Register model loaders: components that produce a model and its tokenizer.

    :param register: call ``register(cls)`` for each loader class, with ``name``, ``Options`` and
        ``load(ctx) -> (model, tokenizer)``; optionally ``meta_model() -> (model, config)`` on the meta
        device, ``load_tokenizer(ctx)`` and ``preflight(plan)``.
    """


@hookspec
def register_data_sources(register: Register) -> None:
    """Register data sources: components that read rows into the internal schema.

    :param register: call ``register(cls)`` for each source class, with ``name``,
        ``Options`` and ``load(ctx) -> datasets.Dataset``.
    """


@hookspec
def register_chat_templates(register: Register) -> None:
    """Register chat templates: components that turn messages into text.

    :param register: call ``register(cls)`` for each template class, with ``name``,
        ``Options`` and ``render(messages, tokenizer, add_generation_prompt) -> str``; optionally ``prepare(model,
        tokenizer)`` and ``stop_tokens`` (generation stops at ``ftcore_plugins.common.chat.stop_token_ids``).
    """


@hookspec
def register_adapters(register: Register) -> None:
    """Register adapter methods (LoRA, full fine-tuning, ...).

    :param register: call ``register(cls)`` for each adapter class, with ``name``,
        ``Options`` and ``apply(model, ctx) -> model``.
    """


@hookspec
def register_quantizers(register: Register) -> None:
    """Register quantizers, which change how the base model is loaded.

    :param register: call ``register(cls)`` for each quantizer class, with ``name``,
        ``Options``, ``load_kwargs() -> dict`` and ``prepare(model) -> model``.
    """


@hookspec
def register_trainers(register: Register) -> None:
    """Register trainers (SFT, pre-training, DPO, ...), one per ``[[stage]]`` kind.

    :param register: call ``register(cls)`` for each trainer class, with ``name``, ``Options`` and
        ``train(ctx) -> dict`` of final metrics; optionally ``prepare_data(ctx)``, the tokenization alone, and
        ``supports_images``: True, it reads rows with images; False, it refuses them (unset: ``ftcore run`` warns).
    """


@hookspec
def register_evaluators(register: Register) -> None:
    """Register evaluators, which measure a model before and after training.

    :param register: call ``register(cls)`` for each evaluator class, with ``name``,
        ``Options`` and ``evaluate(ctx) -> dict[str, float]``; optionally ``supports_images``, as a trainer's.
    """


@hookspec
def register_exporters(register: Register) -> None:
    """Register exporters, which write the trained model somewhere other tools can load it.

    :param register: call ``register(cls)`` for each exporter class, with ``name``, ``Options`` and
        ``export(ctx) -> pathlib.Path``; ``merges = True`` for one that folds the adapter into the model.
    """


@hookspec
def register_reward_functions(register: Register) -> None:
    """Register reward functions, which score generated completions for PPO, GRPO and RLOO.

    :param register: call ``register(cls)`` for each reward function class, with ``name``,
        ``Options`` and ``score(prompts, completions) -> list[float]``. A plan selects one
        as ``[reward.<name>]`` and a trainer names it in its ``reward`` options.
    """


@hookspec
def register_trackers(register: Register) -> None:
    """Register experiment trackers (TensorBoard, MLflow, ...), selected in a plan's ``track``.

    :param register: call ``register(cls)`` for each tracker class, with ``name``, ``Options`` and the
        lifecycle hooks it needs (at least ``ftcore_log``) as methods marked ``@ftcore.hookimpl``: the
        runner registers the plan's trackers as plugins for the length of the run.
    """


@hookspec
def register_commands(register: Register) -> None:
    """Register subcommands of the ``ftcore`` command line (``ftcore init``, ``ftcore report``, ...).

    :param register: call ``register(cls)`` for each :class:`ftcore.command.Command` subclass, with
        ``name`` (the word after ``ftcore``), ``add_arguments(parser)`` and ``run(args) -> int``,
        the exit status. The class docstring's first line is the command's line in ``ftcore --help``.
        Import heavy libraries inside ``run``: ``ftcore --help`` loads every command module.
    """


@hookspec
def register_plan_sections(register: Register) -> None:
    """Register top-level plan tables a plugin owns (``[sweep]`` of ``ftcore sweep``, ``[track]``, ...); not
    one another plugin owns, nor one of the core's (``model``, ``stage``, ...).

    :param register: call ``register(cls)`` for each :class:`ftcore.component.PlanSection` subclass, with
        ``name`` (the table's name), ``Options`` (its keys) or a ``parse`` classmethod, ``fingerprint`` and
        optionally ``check(plan)``, ``components()``, ``launch(plan, argv)`` and ``on_main(fn)``.
    """


@hookspec
def ftcore_preflight(plan: Any) -> list[str]:
    """Called by ``ftcore run`` before the run folder is made or a weight is read: checks of the model
    (the built-in one calls the loader's own ``preflight(plan)``, then checks each ``max_length`` against
    the model's context and each stage's adapter on the meta device). Return problems as ``"key:
    message"``, the key from the plan's top (``stage[0].max_length``); ``ftcore run`` reports them all,
    one line each, and exits 2.

    :param plan: the validated :class:`ftcore.plan.Plan` about to run.
    """


@hookspec
def ftcore_prepare_data(run: Any, stages: list[Any], load_data: Callable[[str], Any]) -> None:
    """Called by ``ftcore run`` once it has read the data of the stages still to train and of the
    evaluations, before the model loads: the built-in one (``ftcore_plugins.commands.prepare``) has each
    stage's trainer prepare its rows as ``ftcore prepare`` does. Raise to stop the run there (a bad row:
    :class:`ftcore.errors.FtcoreError`, exit 2).

    :param run: the :class:`ftcore.context.RunInfo` of this run; ``run.reporter`` is set.
    :param stages: the :class:`ftcore.plan.Stage` objects still to train, in order.
    :param load_data: ``load_data(ref)``: the plan's data ``name`` or ``name:split``, as the run reads it (cached).
    """


@hookspec
def ftcore_run_start(run: Any) -> None:
    """Called once a run directory is ready, before any model is loaded.

    :param run: the :class:`ftcore.context.RunInfo` of this run (plan, run_dir, rank).
    """


@hookspec
def ftcore_stage_start(run: Any, stage: str) -> None:
    """Called before each step of a run: ``load``, ``evaluate:before``, each
    training stage by name, ``evaluate:after`` and ``export:<name>`` per export.
    Every rank calls the lifecycle hooks; check ``run.is_main`` to act once.

    :param run: the :class:`ftcore.context.RunInfo` of this run.
    :param stage: the step's name.
    """


@hookspec
def ftcore_stage_end(run: Any, stage: str, metrics: dict[str, Any], seconds: float) -> None:
    """Called after each step of a run finished successfully.

    :param run: the :class:`ftcore.context.RunInfo` of this run.
    :param stage: the step's name, as given to ``ftcore_stage_start``.
    :param metrics: the step's final metrics (may be empty).
    :param seconds: wall time the step took.
    """


@hookspec
def ftcore_log(run: Any, stage: str, step: int | None, metrics: dict[str, float]) -> None:
    """Called for every metrics record; implement it to send metrics to a tracker.

    The same records go to ``metrics.jsonl`` in the run directory. Only the main
    process (rank 0) calls it.

    :param run: the :class:`ftcore.context.RunInfo` of this run.
    :param stage: the step that produced the metrics.
    :param step: the optimizer step, or ``None`` for one-off measurements.
    :param metrics: name to value.
    """


@hookspec
def ftcore_run_end(run: Any, error: BaseException | None) -> None:
    """Called when a run ends, successfully or not.

    :param run: the :class:`ftcore.context.RunInfo` of this run.
    :param error: the exception that ended the run, or ``None`` on success.
    """


@hookspec
def ftcore_run_summary(console: Any, summary: dict[str, Any]) -> None:
    """Called by ``ftcore run`` once a run has completed, to show its result; the built-in one
    (``ftcore_plugins.commands.report``) prints the end-of-run tables.

    :param console: the rich ``Console`` the run printed on.
    :param summary: what the run wrote to ``summary.json``: evaluations, stages, exports, memory, steps, run_dir.
    """


@hookspec
def ftcore_cli_start(command: str, debug: bool) -> None:
    """Called by the command line before it runs a command, once the plugins that give commands are
    loaded; the built-in one (``ftcore_plugins.commands.quiet``) keeps the ML libraries' progress bars
    and advisories off the console of ``ftcore run``, before any plugin imports them.

    :param command: the command about to run: ``run``, or a plugin's (``validate``, ``plugins``, ...).
    :param debug: whether ``--debug`` was given: show everything.
    """
