"""What the runner hands to components. Plain dataclasses: no torch here; fields typed ``Any`` hold
torch/transformers/datasets objects that the core only passes along."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .plan import Plan
    from .reporter import Reporter


@dataclass
class RunInfo:
    """The run as lifecycle hooks see it."""

    plan: Plan
    run_dir: Path
    rank: int = 0
    world_size: int = 1
    reporter: Reporter | None = None  # the run's console and metrics log, once the run has started

    @property
    def is_main(self) -> bool:
        return self.rank == 0


@dataclass
class LoadContext:
    """For ``ModelLoader.load``: return ``(model, tokenizer)``."""

    run: RunInfo
    reporter: Reporter
    quantizer: Any  # the plan's quantizer component: use load_kwargs() and prepare(model)
    seed: int
    work_dir: Path  # a folder in the run directory for the loader's own files (e.g. a trained tokenizer)
    data: Callable[[str], Any]  # data(name) loads the plan's [data.<name>] (cached), e.g. to train a tokenizer


@dataclass
class DataContext:
    """For ``DataSource.load``: return a ``datasets.Dataset`` in the internal schema."""

    run: RunInfo
    reporter: Reporter
    name: str  # the plan's name for this data, e.g. "chat" for [data.chat]
    data: Callable[[str], Any] | None = None  # data(ref) loads other plan data (e.g. for a mix)


@dataclass
class AdapterContext:
    run: RunInfo
    reporter: Reporter
    quantizer: Any


@dataclass
class StageContext:
    """For ``Trainer.train``. The trainer trains ``model`` in place (or replaces it) and
    returns its final metrics."""

    run: RunInfo
    reporter: Reporter
    stage: str
    model: Any
    tokenizer: Any
    template: Any  # the chat template component
    train_data: Any  # datasets.Dataset, internal schema
    eval_data: Any | None
    output_dir: Path  # the stage's folder
    checkpoint_dir: Path  # where to save resumable checkpoints
    resume_from: Path | None  # the checkpoint to continue from, when resuming
    seed: int
    adapter: Any = None  # the stage's adapter component (e.g. its ``optimizer(model, args)``, if it has one)
    rewards: dict[str, Any] = field(default_factory=dict)  # the plan's [reward.<name>] functions, created
    outputs: dict[str, Path] = field(default_factory=dict)  # earlier stages' output folders, by stage name
    # True when ``model`` carries an adapter an earlier stage trained and this stage continues, so
    # disabling the adapter does not give the model as it was when this stage started.
    continues_adapter: bool = False

    @property
    def output(self) -> Path:
        """Where the stage's product goes: the runner saves the adapter there, and a trainer that
        trains a separate model (``trains_policy = False``, e.g. a reward model) saves that model there."""
        return self.output_dir / "output"


@dataclass
class EvalContext:
    """For ``Evaluator.evaluate``: return ``{metric: value}``."""

    run: RunInfo
    reporter: Reporter
    phase: str  # "before" training, a stage's name (right after that stage), or "after" the last stage
    model: Any
    tokenizer: Any
    template: Any
    data: Any | None  # datasets.Dataset, internal schema, when the evaluation names data
    output_dir: Path  # for the evaluator's own files (predictions, ...)
    earlier: dict[str, dict[str, Any]] = field(default_factory=dict)  # this evaluation's results in earlier phases
    outputs: dict[str, Path] = field(default_factory=dict)  # finished stages' output folders, by stage name
    # load_model("base") or load_model("<stage>"): that model rebuilt from the run's files, as
    # (model, tokenizer), for comparisons on the same data with the same settings.
    load_model: Callable[[str], tuple[Any, Any]] | None = None
    load_data: Callable[[str], Any] | None = None  # load_data(ref): the plan's data ``name`` or ``name:split``
    name: str = ""  # the [[evaluate]] entry's name: results are stored and logged under it


@dataclass
class ExportContext:
    """For ``Exporter.export``: write under ``path`` and return the main artifact path."""

    run: RunInfo
    reporter: Reporter
    model: Any
    tokenizer: Any
    template: Any
    adapter: Any | None  # the adapter component whose weights are live on ``model``, if any
    path: Path
    name: str = "export"  # the [[export]] entry's name: its step is "export:<name>"
    # base_model (the plan's [model], redacted), plan_fingerprint, data_files, metrics by phase,
    # stages and ftcore_version: what a model card records about where the model came from.
    provenance: dict[str, Any] = field(default_factory=dict)
    quantized: bool = False  # the base was loaded through a quantizer other than ``none``
    # The model the live adapter was applied to, rebuilt at full precision (the quantizer skipped),
    # so a QLoRA adapter is merged into full-precision weights, never into 4-bit ones.
    load_full_precision_base: Callable[[], Any] | None = None
    # Where the export ends up: ``path`` is a hidden folder next to it, renamed into place when the export
    # returns. Name this one in what the export writes (a model card's loading snippet).
    final_path: Path | None = None
    # The index in plan.stages of the stage where the live adapter was first applied (-1: none), and
    # load_model("base" or "<stage>"), as EvalContext's: an adapter export names its exact base so.
    adapter_from: int = -1
    load_model: Callable[[str], tuple[Any, Any]] | None = None
    load_data: Callable[[str], Any] | None = None  # as EvalContext's: calibration rows, say
    # For an exporter that merges (``merges = True`` on its class; it runs after those that do not):
    # ``consume``: the run has no further use for ``model`` as it is, so merge it in place (no copy)
    # and set ``merged`` to the merged model, which the exports after this one get. ``last``: none
    # follows. ``release_model()`` drops the run's own references to ``model``, so that dropping the
    # context's frees it (before loading a full-precision base for a QLoRA merge, say).
    consume: bool = False
    last: bool = True
    release_model: Callable[[], None] | None = None
    merged: Any = None
    # The exports written before this one, by name: where each one's main artifact is. An exporter
    # that only reads them (``reads_exports = True`` on its class, e.g. a registry) runs after every
    # other export and gets no model (``model`` is None).
    exports: dict[str, Path] = field(default_factory=dict)
