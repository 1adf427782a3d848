"""A clean repository: running a plan from the repository root leaves its working tree as it was. Runs,
trackers (MLflow's SQLite store, TensorBoard's events), registries and the tokenized-data cache go to
the run folder or a temporary folder, never beside the code (an ``mlflow.db`` was once committed)."""

from __future__ import annotations

import subprocess

import pytest

from conftest import ROOT

from ftcore.testing import run_ftcore, write_plan

# What a concurrent edit of the sources may add while this test runs; anything else is a run's leftover.
SOURCES = (".py", ".md", ".toml", ".txt", ".json", ".jsonl", ".yaml", ".yml", ".cfg", ".ini", ".sh")


def tree() -> set[str]:
    """The untracked and ignored paths of the working tree, ``__pycache__`` and the virtual environment aside."""
    out = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all", "--ignored"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    paths = {line[3:] for line in out.splitlines() if line[:2] in ("??", "!!")}
    return {p for p in paths if "__pycache__" not in p and not p.startswith((".venv/", ".pytest_cache/"))
            and ".egg-info/" not in p}


@pytest.mark.slow
def test_a_run_with_trackers_and_a_registry_leaves_the_repository_as_it_was(tmp_path):
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    pytest.importorskip("mlflow")
    plan = write_plan(tmp_path, {"stage": [{"trainer": "sft", "data": "chat", "max_steps": 2, "batch_size": 4,
                                            "max_length": 64}],
                                 "evaluate": [{"use": "perplexity", "data": "chat_eval"}],
                                 "track": ["mlflow", "tensorboard"],
                                 "export": [{"use": "merged"}, {"use": "mlflow", "model_name": "tiny"}]})
    before = tree()
    result = run_ftcore("run", plan, cwd=ROOT)  # from the repository root, as a developer would
    assert result.exit_code == 0, result.stderr[-3000:]
    assert (tmp_path / "runs" / "tiny" / "tracking" / "mlflow" / "mlflow.db").is_file()  # the tracker's store
    assert (tmp_path / "runs" / "_mlflow" / "mlflow.db").is_file()  # the registry's, beside the runs
    left = sorted(p for p in tree() - before if not p.endswith(SOURCES))
    assert not left, f"the run wrote into the repository: {left}"
    assert not (ROOT / "mlflow.db").exists() and not (ROOT / "mlruns").exists()
