"""Exporter ``mlflow``: another export of the run (merged or adapter) registered as a new model version
in an MLflow model registry, with the run's provenance, metrics and compute hours."""

from __future__ import annotations

import json
import os

import ftcore
from ftcore.component import Component, Options
from ftcore.errors import FtcoreError

from ftcore_plugins.common import mlflow_store

REGISTRABLE = ("merged", "adapter")  # exporters whose folder transformers or peft load as it is


class MLflowRegistry(Component):
    """Registers the run's merged or adapter export as a new version in an MLflow model registry.

    The export's folder is logged as the artifact ``model`` of an MLflow run tagged with the base
    model, the method, each data file's sha256, the plan fingerprint and the hardware, with the
    evaluation metrics by phase and the compute hours; then registered as a version of
    ``model_name``, with ``alias`` if given. The store is ``tracking_uri``, else
    ``MLFLOW_TRACKING_URI``, else SQLite in ``<output_dir>/_mlflow/`` beside the runs, shared by them
    (no run can be named ``_mlflow``).
    Writes ``registered.json`` (name, version, alias, run id, model URI) in its export folder."""

    name = "mlflow"
    reads_exports = True  # runs after the other exports, from their folders; needs no model

    class Options(Options):
        source: str = "merged"  # the [[export]] (by name) whose folder is registered
        model_name: str | None = None  # the registered model; default: the plan's [run] name
        alias: str | None = None  # e.g. "candidate"
        tracking_uri: str | None = None
        experiment: str = "ftcore"
        tags: dict[str, str] = {}

    def check(self, plan):
        problems = mlflow_store.missing(self.options.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI"))
        o = self.options
        source = next((e for e in plan.exports if e.name == o.source), None)
        if source is None:
            problems.append(f"source: no [[export]] named {o.source!r} to register; exports: "
                            f"{', '.join(e.name for e in plan.exports if e.exporter.reg.cls is not type(self)) or 'none'}"
                            " (add [[export]] use = \"merged\")")
        elif source.exporter.name not in REGISTRABLE:
            problems.append(f"source: export {o.source!r} is '{source.exporter.name}'; the registry takes a folder "
                            f"transformers or peft loads: {' or '.join(REGISTRABLE)}")
        if o.alias is not None and (not mlflow_store.ALIAS.match(o.alias) or o.alias == "latest"
                                    or (o.alias[:1] in "vV" and o.alias[1:].isdigit())):
            problems.append(f"alias: {o.alias!r} is not an alias MLflow accepts (letters, digits, '_' and '-'; "
                            "not 'latest' nor v<number>)")
        return problems

    def export(self, ctx):
        o = self.options
        source = ctx.exports.get(o.source)
        if source is None:
            raise FtcoreError(f"exporter 'mlflow': export {o.source!r} has not been written, so it cannot be registered")
        record = register_export(ctx.run.run_dir, source, o, ctx.run.plan.run_name, ctx.run.plan.output_dir)
        ctx.path.mkdir(parents=True, exist_ok=True)
        path = ctx.path / "registered.json"
        path.write_text(json.dumps(record, indent=2, default=str) + "\n", encoding="utf-8")
        ctx.reporter.info(f"registered {o.source} as {record['model_name']} version {record['version']}"
                          + (f" (alias {o.alias})" if o.alias else "") + f" in {record['tracking_uri']}")
        return path


def register_export(run_dir, source, options, run_name: str, output_dir) -> dict:
    """Register export folder ``source`` of the run in ``run_dir`` with these options (``ftcore sweep``
    registers its best trial through here)."""
    from pathlib import Path

    uri, artifacts = mlflow_store.store_for(options.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI"),
                                            Path(output_dir) / "_mlflow")
    return mlflow_store.register(Path(run_dir), Path(source), uri=uri, artifacts=artifacts,
                                 experiment_name=options.experiment, model_name=options.model_name or run_name,
                                 alias=options.alias, tags=options.tags, kind=options.source)


@ftcore.hookimpl
def register_exporters(register):
    register(MLflowRegistry)
