"""The model card (README.md) the exporters write beside a model: where it came from (base model,
plan fingerprint, data files with their hashes, stages, evaluation results), how the export was
verified, and how to load it. The YAML front matter is written by ``huggingface_hub``'s
``ModelCardData``, so the Hub and ``ModelCard.load`` read it; ``ftcore`` in it holds the same
provenance for programs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ftcore.reporter import format_value


def write_card(folder: Path, ctx: Any, *, title: str, library: str, tags: list[str], usage: str,
               verification: dict[str, Any] | None = None, extra: str | None = None) -> Path:
    """Write ``folder/README.md`` (replacing the one peft writes) and return its path. ``extra``
    (markdown) follows the loading snippet."""
    from huggingface_hub import ModelCard, ModelCardData

    p = ctx.provenance or {}
    data = ModelCardData(library_name=library, base_model=base_model_id(p.get("base_model") or {}),
                         tags=["ftcore", *tags],
                         ftcore={"version": p.get("ftcore_version"), "plan_fingerprint": p.get("plan_fingerprint"),
                                 "data_files": p.get("data_files", {}), "verification": verification or {}})
    body = [f"# {ctx.run.plan.run_name}: {title}", "",
            f"Trained with ftcore {p.get('ftcore_version') or ''} from a plan with fingerprint "
            f"`{p.get('plan_fingerprint')}` (sha256 of the plan's content).", ""]
    quantizer = p.get("quantizer") or "none"
    quantizer = quantizer if isinstance(quantizer, dict) else {"use": quantizer}
    body += _section("Base model", ["key", "value"],
                     [(k, f"`{v}`") for k, v in _base_rows(ctx, p.get("base_model") or {}).items()]
                     + [(f"quantizer.{k}", f"`{v}`") for k, v in quantizer.items()])
    body += _section("Stages", ["stage", "trainer", "adapter", "data"],
                     [(s.get("name"), s.get("trainer"), s.get("adapter"), s.get("data")) for s in p.get("stages", [])])
    body += _section("Data", ["file", "data", "sha256", "bytes"],
                     [(Path(f).name, d.get("data"), f"`{d.get('sha256')}`", d.get("bytes"))
                      for f, d in p.get("data_files", {}).items()])
    body += _metrics(p.get("metrics") or {})
    if verification:
        body += _section("Verification", ["check", "value"], [(k, format_value(v)) for k, v in verification.items()])
    body += ["## How to load", "", "From the run folder:", "", "```python", usage.strip(), "```", ""]
    if extra:
        body += [extra.strip(), ""]
    card = ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(body))
    path = folder / "README.md"
    card.save(path)
    return path


def _base_rows(ctx: Any, section: dict[str, Any]) -> dict[str, Any]:
    """The plan's ``[model]`` as a card shows it: a local folder by what it holds (the hub id its
    config names, its architecture) rather than by a path that means nothing elsewhere."""
    import json

    rows = dict(section)
    path = section.get("path")
    if not isinstance(path, str) or base_model_id(section):
        return rows
    folder = Path(str(getattr(ctx.run.plan.model.options, "path", path)))
    rows["path"] = f"a local folder, {folder.name}"
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return rows
    origin = config.get("_name_or_path")
    if isinstance(origin, str) and base_model_id({"path": origin}):
        rows["from"] = origin
    if config.get("architectures"):
        rows["architecture"] = ", ".join(config["architectures"])
    return rows


def final_path(ctx: Any) -> Path:
    """Where the export will be once complete (it is written to a hidden folder beside it first)."""
    return Path(getattr(ctx, "final_path", None) or ctx.path)


def card_path(ctx: Any, path: Path | str | None = None) -> str:
    """How a card's loading snippet names ``path`` (default: the export): relative to the run folder,
    where the snippet runs as written on any machine the run is copied to; a path outside it (an
    export ``path`` the plan chose) as it is."""
    path = Path(path) if path is not None else final_path(ctx)
    try:
        return path.resolve().relative_to(Path(ctx.run.run_dir).resolve()).as_posix()
    except (ValueError, AttributeError):
        return str(path)


def base_model_id(section: dict[str, Any]) -> str | None:
    """The hub id the plan's ``[model]`` loaded (``hf``'s ``path``, ``org/name``); None for a local folder,
    which means nothing on another machine, or a model made from scratch."""
    from ftcore_plugins.common.model import HUB_ID

    path = section.get("path")
    return path if isinstance(path, str) and HUB_ID.fullmatch(path) else None


def _metrics(metrics: dict[str, dict[str, dict[str, Any]]]) -> list[str]:
    """Evaluation results, one row per evaluation and metric, one column per phase (before, ..., after)."""
    phases = list(metrics)
    rows: dict[str, dict[str, Any]] = {}
    for phase, evaluations in metrics.items():
        for evaluation, values in evaluations.items():
            for metric, value in (values or {}).items():
                rows.setdefault(f"{evaluation}/{metric}", {})[phase] = value
    return _section("Evaluation", ["metric", *phases],
                    [(name, *(format_value(v.get(ph, "")) for ph in phases)) for name, v in rows.items()])


def _section(title: str, header: list[str], rows: list[tuple]) -> list[str]:
    if not rows:
        return []
    lines = [f"## {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return [*lines, ""]

