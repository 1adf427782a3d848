"""The run directory: manifest, completion markers, and the rules that protect it."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from . import __version__
from .errors import FtcoreError

MANIFEST = "manifest.json"
COMPLETE = "COMPLETE.json"
KEY_PACKAGES = ("torch", "transformers", "trl", "peft", "datasets", "accelerate", "tokenizers",
                "safetensors", "bitsandbytes", "deepspeed", "pydantic", "pluggy", "rich")


def prepare(run_dir: Path, fingerprint: str, resume: bool, force: bool) -> str:
    """Check that ``run_dir`` may be used and create it. Returns a note for the user
    ("" for a fresh run). Never deletes anything: ``force`` moves the old run aside."""
    manifest = run_dir / MANIFEST
    if not run_dir.exists():
        run_dir.mkdir(parents=True)
        return "resuming, but nothing to resume: starting fresh" if resume else ""
    if not any(run_dir.iterdir()):
        return ""
    if force:
        stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        aside = run_dir.with_name(f"{run_dir.name}.{stamp}.old")
        run_dir.rename(aside)
        run_dir.mkdir()
        return f"--force: moved the existing {run_dir} to {aside}"
    if not manifest.exists():
        raise FtcoreError(f"{run_dir}: folder exists and is not an ftcore run; "
                          "set run.name or run.output_dir to another place, or pass --force to move it aside")
    try:
        previous = json.loads(manifest.read_text())
    except (OSError, ValueError) as exc:
        raise FtcoreError(f"{manifest}: unreadable manifest ({exc}); pass --force to move the run aside") from None
    if previous.get("status") == "failed" and not trained_anything(run_dir):
        # Bad data or a bad option stopped it before a single step: nothing in it is worth keeping, and
        # asking for --force or --resume after the fix would only be in the way.
        shutil.rmtree(run_dir)
        run_dir.mkdir()
        return f"the previous run here failed before training ({previous.get('error', 'no error recorded')[:200]}); " \
               f"starting over in {run_dir}"
    if previous.get("plan_fingerprint") != fingerprint:
        raise FtcoreError(
            f"{run_dir}: holds a run of a different plan ({previous.get('plan_path', '?')}, "
            f"started {previous.get('started_at', '?')}); change run.name, or pass --force to move it aside"
        )
    if not resume:
        state = previous.get("status", "unknown")
        raise FtcoreError(f"{run_dir}: this plan already ran here (status: {state}); "
                          "pass --resume to continue it, or --force to move it aside and start over")
    return f"resuming the run in {run_dir}"


def trained_anything(run_dir: Path) -> bool:
    """Whether a run got as far as a training step: one is logged, a stage left a checkpoint, an output
    or its marker, or something was exported. What a stage records at step 0, before its first step (the
    loss kernel, the trainable parameters, an evaluation of the untrained model), is not training."""
    if (run_dir / "exports").exists() or (run_dir / "exports.json").exists():
        return True
    for stage in (run_dir / "stages").glob("*"):
        if any((stage / "checkpoints").glob("*")) or (stage / "output").exists() or (stage / COMPLETE).exists():
            return True
    try:
        with (run_dir / "metrics.jsonl").open(encoding="utf-8") as lines:
            return any(_trained_step(json.loads(line).get("step")) for line in lines if line.strip())
    except FileNotFoundError:
        return False
    except (OSError, ValueError):
        return True  # unreadable: keep it


def _trained_step(step: Any) -> bool:
    """Whether a metrics record's ``step`` is that of a training step: 1 or later (unreadable: kept as one)."""
    if step is None:
        return False
    if isinstance(step, (int, float)) and not isinstance(step, bool):
        return step > 0
    return True


def stored_path(run_dir: Path, path: Path | str) -> str:
    """How a run's records store ``path``: relative to the run folder when inside it, so that a copied or
    moved run still finds its files; absolute otherwise."""
    path = Path(path)
    try:
        return path.resolve().relative_to(Path(run_dir).resolve()).as_posix()
    except ValueError:
        return str(path)


def stored(run_dir: Path, value: str) -> Path:
    """A path as :func:`stored_path` stored it, made usable again (relative: under ``run_dir``)."""
    path = Path(value)
    return path if path.is_absolute() else Path(run_dir) / path


def replace_atomically(partial: Path, final: Path) -> None:
    """Put the finished ``partial`` (a file or folder, next to ``final``) at ``final`` by renaming, so that
    ``final`` never holds half of anything. A previous ``final`` (an export being redone) is renamed aside
    first and deleted after; a kill between the two renames leaves no ``final`` (the run is not complete,
    so ``--resume`` exports again) and the old one under ``.<name>.replaced-<pid>``."""
    old = None
    if final.exists() or final.is_symlink():
        old = final.with_name(f".{final.name}.replaced-{os.getpid()}")
        os.replace(final, old)
    os.replace(partial, final)
    if old is not None:
        remove(old)


def remove(path: Path) -> None:
    """Delete a file, a link or a whole folder, if there is one (ftcore's own temporary ones only)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def git_info(folder: Path) -> dict[str, Any] | None:
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=folder, capture_output=True, text=True, timeout=5)
        if sha.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=folder,
                               capture_output=True, text=True, timeout=5)
        return {"sha": sha.stdout.strip(), "dirty": bool(dirty.stdout.strip())}
    except (OSError, subprocess.SubprocessError):
        return None


def package_versions(extra: list[str] | None = None) -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"ftcore": __version__, "python": platform.python_version()}
    for name in (*KEY_PACKAGES, *(extra or [])):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            pass
    return out


def hardware() -> dict[str, Any]:
    info: dict[str, Any] = {"platform": platform.platform(), "machine": platform.machine(),
                            "cpu_count": os.cpu_count()}
    try:
        info["memory_gib"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        pass
    torch = sys.modules.get("torch")  # only report what is already loaded; never import it here
    if torch is not None and torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info


def now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def run_status(error: BaseException | None) -> str:
    """What ``manifest.json`` calls a run that ended with ``error``: ``complete``, ``interrupted``
    (Ctrl-C, SIGTERM) or ``failed``, or the error's own ``run_status`` (a sweep's ``pruned`` trial)."""
    if error is None:
        return "complete"
    if isinstance(getattr(error, "run_status", None), str):
        return error.run_status
    return "interrupted" if isinstance(error, KeyboardInterrupt) else "failed"


def write_text(path: Path, text: str) -> None:
    """Write atomically (beside it, then renamed) so a kill never leaves half a file behind."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def write_json(path: Path, data: Any) -> None:
    """Write atomically so a kill never leaves half a marker behind."""
    write_text(path, json.dumps(data, indent=2, default=str) + "\n")


def read_json(path: Path) -> Any | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
