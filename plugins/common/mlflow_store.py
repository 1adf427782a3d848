"""MLflow, as the ``mlflow`` tracker and the ``mlflow`` exporter (the model registry) both use it: a
client on a tracking URI, an experiment found or made, metric and tag names MLflow accepts, and the
registration of a finished run's export as a new model version. A run's facts are read from its
folder alone (manifest, evaluations, exports), so ``ftcore sweep`` registers its best trial the
same way a run registers itself."""

from __future__ import annotations

import datetime as dt
import json
import re
from pathlib import Path
from typing import Any

from ftcore import rundir
from ftcore.plan import redact

# MLflow's limits on names and values (mlflow.utils.validation).
_BAD_NAME = re.compile(r"[^/\w.\- :]")
MAX_KEY, MAX_VALUE, MAX_TAG = 250, 6000, 5000
ALIAS = re.compile(r"^[A-Za-z0-9_\-]{1,255}$")


def missing(uri: str | None) -> list[str]:
    """``check(plan)`` problems when MLflow, or for a SQLite store SQLAlchemy and Alembic (which
    mlflow-skinny leaves out), are not installed; found without importing them."""
    import importlib.util

    modules = ("mlflow", "sqlalchemy", "alembic") if uri is None or uri.startswith("sqlite") else ("mlflow",)
    absent = [m for m in modules if importlib.util.find_spec(m) is None]
    if not absent:
        return []
    return [f"needs {', '.join(absent)}, which is not installed: pip install mlflow-skinny sqlalchemy alembic "
            "(or pip install 'ftcore[track]')"]


def key(name: str) -> str:
    """A metric, parameter or tag name MLflow accepts."""
    return _BAD_NAME.sub("_", name)[:MAX_KEY]


def client(uri: str) -> Any:
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def experiment(mlflow_client: Any, name: str, artifacts: str | None) -> str:
    """The id of experiment ``name``, made (with its artifacts at ``artifacts``) if missing."""
    found = mlflow_client.get_experiment_by_name(name)
    return found.experiment_id if found else mlflow_client.create_experiment(name, artifact_location=artifacts)


def store_for(uri: str | None, folder: Path) -> tuple[str, str | None]:
    """``(tracking URI, artifact location)``: ``uri`` as given (its server decides where artifacts go),
    or a SQLite store ``folder/mlflow.db`` with its artifacts in ``folder/artifacts``."""
    if uri is not None:
        return uri, None
    folder.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{folder / 'mlflow.db'}", (folder / "artifacts").as_uri()


def run_facts(run_dir: Path) -> dict[str, Any]:
    """What a registry entry records about the run in ``run_dir``: tags (base model, method, data
    sha256s, plan fingerprint, hardware), metrics by evaluation phase, and compute hours."""
    manifest = rundir.read_json(run_dir / rundir.MANIFEST) or {}
    plan = manifest.get("plan", {})
    resolved = manifest.get("resolved", {})
    model = plan.get("model", {})
    base = model.get("path") or f"{model.get('use', '?')} {model.get('architecture', '')}".strip()
    stages = resolved.get("stages", [])
    tags = {
        "ftcore.base_model": str(base),
        "ftcore.method": ", ".join(f"{s['name']}: {s['trainer'].split(':')[-1]} + {s['adapter'].split(':')[-1]}"
                                   for s in stages),
        "ftcore.quantizer": str(resolved.get("quantizer", "none")).split(":")[-1],
        "ftcore.plan_fingerprint": str(manifest.get("plan_fingerprint", "")),
        "ftcore.version": str(manifest.get("ftcore_version", "")),
        "ftcore.run_dir": str(run_dir),
    }
    for path, data in sorted(manifest.get("data_files", {}).items()):
        tags[key(f"ftcore.data.{data['data']}.{Path(path).name}.sha256")] = data["sha256"]
    hardware = manifest.get("hardware", {})
    tags["ftcore.hardware"] = json.dumps(hardware, sort_keys=True, default=str)[:MAX_TAG]
    metrics: dict[str, float] = {}
    for phase_file in sorted((run_dir / "evaluations").glob("*.json")):
        for evaluation, values in (rundir.read_json(phase_file) or {}).items():
            for name, value in values.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    metrics[key(f"{phase_file.stem}/{evaluation}/{name}")] = float(value)
    started = _time(manifest.get("started_at"))
    ended = _time(manifest.get("ended_at")) or dt.datetime.now(dt.timezone.utc)
    wall = (ended - started).total_seconds() / 3600 if started else 0.0
    devices = max(int(manifest.get("world_size", 1) or 1), 1)
    metrics.update({"ftcore/wall_hours": wall, "ftcore/device_hours": wall * devices})
    tags["ftcore.devices"] = f"{devices} x {_device(hardware)}"
    return {"tags": tags, "metrics": metrics, "plan": redact(plan)}


def register(run_dir: Path, source: Path, *, uri: str, artifacts: str | None, experiment_name: str,
             model_name: str, alias: str | None, tags: dict[str, str], kind: str) -> dict[str, Any]:
    """Log ``source`` (an export folder of the run in ``run_dir``) as the artifact ``model`` of a new
    MLflow run with the run's facts, and register it as a new version of ``model_name`` (with
    ``alias``). Returns what was registered."""
    import time

    from mlflow.entities import Metric, Param

    facts = run_facts(run_dir)
    c = client(uri)
    experiment_id = experiment(c, experiment_name, artifacts)
    all_tags = {**facts["tags"], "ftcore.export": kind, **redact(dict(tags))}
    run = c.create_run(experiment_id, run_name=f"register {model_name}", tags=all_tags)
    run_id, now = run.info.run_id, int(time.time() * 1000)
    c.log_batch(run_id, metrics=[Metric(k, v, now, 0) for k, v in facts["metrics"].items()])
    params = [Param(key(k), v[:MAX_VALUE]) for k, v in flat(facts["plan"]).items()]
    for i in range(0, len(params), 100):
        c.log_batch(run_id, params=params[i:i + 100])
    c.log_artifacts(run_id, str(source), artifact_path="model")
    c.set_terminated(run_id)
    try:
        c.get_registered_model(model_name)
    except Exception:  # noqa: BLE001 - MLflow raises its RestException for "not found"
        c.create_registered_model(model_name)
    version = c.create_model_version(model_name, source=f"{run.info.artifact_uri}/model", run_id=run_id,
                                     tags=all_tags, description=f"ftcore {kind} export of {run_dir.name}")
    if alias:
        c.set_registered_model_alias(model_name, alias, version.version)
    return {"tracking_uri": redact(uri), "model_name": model_name, "version": int(version.version), "alias": alias,
            "run_id": run_id, "source": version.source, "model_uri": f"models:/{model_name}/{version.version}",
            "metrics": facts["metrics"], "tags": all_tags}


def flat(plan: dict[str, Any]) -> dict[str, str]:
    """A plan as ``section.key`` -> text, lists of tables by index (``stage.0.name``)."""
    out: dict[str, str] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, inner in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), inner)
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            for i, inner in enumerate(value):
                walk(f"{prefix}.{i}", inner)
        else:
            out[prefix] = value if isinstance(value, str) else json.dumps(value, default=str)

    walk("", plan)
    return out


def _time(text: Any) -> dt.datetime | None:
    try:
        return dt.datetime.fromisoformat(str(text))
    except ValueError:
        return None


def _device(hardware: dict[str, Any]) -> str:
    gpus = hardware.get("gpus")
    if isinstance(gpus, list) and gpus:
        return str(gpus[0])
    return f"CPU ({hardware.get('cpu_count', '?')} cores, {hardware.get('machine', '?')})"
