"""``ftcore sweep``: the [sweep] table's checks, trials as full runs, shared stages, pruning, a killed
sweep resumed, best_plan.toml reproducing its trial, and the report."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time

import pytest

from conftest import run_cli, start_cli

STAGES = """
[[stage]]
name = "pretrain"
trainer = "pretrain"
data = "text"
epochs = 1
batch_size = 8
max_length = 64
learning_rate = 3e-3

[[stage]]
name = "sft"
trainer = "sft"
data = "chat"
eval_data = "chat_eval"
eval_steps = 2
save_steps = 2
adapter = { use = "lora", r = 8, lora_alpha = 16 }
epochs = 2
batch_size = 8
max_length = 64
learning_rate = 2e-3

[[evaluate]]
use = "perplexity"
data = "chat_eval"

[[export]]
use = "adapter"
"""

SWEEP = """
[sweep]
sampler = "{sampler}"
trials = {trials}
metric = "perplexity"
direction = "minimize"
pruner = "{pruner}"
prune_startup_trials = 1
seed = 3

[sweep.space]
{space}
"""

SPACE = '''"stage.sft.learning_rate" = { choices = [3e-3, 1e-6, 2e-6] }
"stage.sft.adapter.r" = { choices = [4] }'''


def sweep_plan(tiny_project, space: str = SPACE, sampler: str = "grid", trials: int = 3,
               pruner: str = "median") -> os.PathLike:
    return tiny_project(STAGES + SWEEP.format(sampler=sampler, trials=trials, pruner=pruner, space=space))


def trials(folder) -> list[dict]:
    with sqlite3.connect(folder / "study.db") as con:
        rows = con.execute("select trial_id, number, state from trials order by number").fetchall()
        attrs = con.execute("select trial_id, key, value_json from trial_user_attributes").fetchall()
    out = {tid: {"number": n, "state": state, "attrs": {}} for tid, n, state in rows}
    for tid, key, value in attrs:
        out[tid]["attrs"][key] = json.loads(value)
    return sorted(out.values(), key=lambda t: t["number"])


# -- the plan's [sweep] table --------------------------------------------------------------------------

BAD = [
    ('sampler = "tpe"', 'sampler = "gird"', "sweep.sampler: unknown sampler 'gird'; did you mean 'grid'?"),
    ("trials = 3", "trials = 3\nsamples = 2", "sweep.samples: unknown key 'samples'; did you mean 'sampler'?"),
    ('metric = "perplexity"', 'metric = "perplexty"', "sweep.metric: no evaluation named 'perplexty'; did you mean"),
    (SPACE, '"stage.sfx.learning_rate" = { low = 1e-4, high = 1e-2 }',
     """sweep.space."stage.sfx.learning_rate": no stage named 'sfx'; stages: pretrain, sft"""),
    (SPACE, '"stage.sft.learning_rate" = { low = 1e-4, high = 5.0, log = true }',
     """sweep.space."stage.sft.learning_rate": 5.0 fails the plan's check: stage[1].learning_rate: input should be """
     "less than or equal to 1"),
    (SPACE, '"stage.sft.adapter.r" = { choices = [0, 8] }',
     """sweep.space."stage.sft.adapter.r": 0 fails the plan's check: stage[1].adapter.r: input should be greater """
     "than 0"),
    (SPACE, '"stage.sft.adapter.rank" = { choices = [4, 8] }',
     """sweep.space."stage.sft.adapter.rank": stage[1].adapter.rank: unknown key for adapter 'lora'"""),
    (SPACE, '"stage.sft.adapter.r" = { choices = [4.5] }',
     """sweep.space."stage.sft.adapter.r": 4.5 fails the plan's check: stage[1].adapter.r: input should be a valid """
     "integer"),
    (SPACE, '"stage.sft.learning_rate" = { low = 0.0, high = 1e-2, log = true }',
     """sweep.space."stage.sft.learning_rate": a log range needs low above 0, got 0.0"""),
    (SPACE, '"stage.sft.learning_rate" = { low = 1e-2, high = 1e-4 }',
     """sweep.space."stage.sft.learning_rate": low must be below high"""),
    ('sampler = "tpe"\ntrials = 3', 'sampler = "grid"\ntrials = 3',
     """sweep.space."stage.sft.warmup_ratio": the grid sampler needs choices, or low and high with a step"""),
    (SPACE, '"run.output_dir" = { choices = ["a", "b"] }',
     """sweep.space."run.output_dir": run.output_dir places the trials' run folders; the sweep sets it"""),
    (SPACE, '"training.lr" = { choices = [1, 2] }', """sweep.space."training.lr": unknown plan section 'training'"""),
    ('eval_data = "chat_eval"\neval_steps = 2\n', "", "sweep.pruner: pruner 'median' reads stage 'sft''s eval "
                                                        "loss, and it has no eval_data"),
]


@pytest.mark.parametrize("old,new,expected", BAD, ids=[b[2].split(":")[0] + str(i) for i, b in enumerate(BAD)])
def test_a_bad_sweep_is_one_line_naming_its_key(tiny_project, old, new, expected):
    path = sweep_plan(tiny_project, space=SPACE + '\n"stage.sft.warmup_ratio" = { low = 0.0, high = 0.1 }',
                      sampler="tpe")
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))
    r = run_cli("validate", str(path))
    assert r.returncode == 2, r.stdout
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert lines[0].startswith(f"{path}: {expected}"), lines[0]


def test_a_good_sweep_validates_and_a_run_ignores_it(tiny_project):
    path = sweep_plan(tiny_project, space='"adapter.r" = { choices = [4, 8] }\n'
                                           '"stage.sft.learning_rate" = { low = 1e-4, high = 1e-2, log = true }',
                      sampler="tpe")
    r = run_cli("validate", str(path))
    assert r.returncode == 0, r.stderr
    from ftcore.plan import load_plan
    from ftcore.plugins import get_plugin_manager

    plan = load_plan(path, get_plugin_manager().registry())
    # "adapter.r" without a top-level [adapter]: the one stage that has its own.
    assert [p.keys for p in plan.sweep.space] == [("stage", 1, "adapter", "r"), ("stage", 1, "learning_rate")]
    assert plan.sweep.first_searched_stage(2) == 1 and plan.sweep.pruned_stage(2) == 1
    # A run's identity leaves the sweep out: changing the search does not make a run "another plan".
    edited = load_plan(path.write_text(path.read_text().replace("trials = 3", "trials = 5")) and path,
                       get_plugin_manager().registry())
    assert edited.fingerprint() == plan.fingerprint()


def test_apply_turns_shorthands_into_tables():
    from ftcore_plugins.commands._sweep_plan import apply, locate

    raw = {"adapter": "lora", "stage": [{"name": "a", "trainer": "sft"}, {"trainer": "sft", "adapter": "dora"}]}
    keys, why = locate(raw, "stage.a.adapter.r")
    assert keys == ("stage", 0, "adapter", "r") and why == ""
    out = apply(raw, {keys: 8, ("stage", 1, "adapter", "r"): 4, ("quantizer", "compute_dtype"): "bf16"})
    assert out["stage"][0]["adapter"] == {"use": "lora", "r": 8}  # the plan's default adapter, as a table
    assert out["stage"][1]["adapter"] == {"use": "dora", "r": 4}
    assert out["quantizer"] == {"compute_dtype": "bf16"}
    assert raw["stage"][0] == {"name": "a", "trainer": "sft"}  # the plan itself is left alone
    assert locate(raw, "stage.1-sft.learning_rate")[0] == ("stage", 1, "learning_rate")  # a stage's default name
    assert locate({"stage": [{"trainer": "sft", "adapter": "lora"}, {"trainer": "dpo", "adapter": "lora"}]},
                  "adapter.r")[0] is None  # two stages with their own adapter: ambiguous


def test_url_passwords_never_reach_a_manifest():
    from ftcore.plan import redact

    out = redact({"sweep": {"storage": "postgresql://me:s3cret@db:5432/optuna"}, "x": "https://example.com/a:b"})
    assert out == {"sweep": {"storage": "postgresql://me:***@db:5432/optuna"}, "x": "https://example.com/a:b"}


# -- running a sweep -----------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_sweep_prunes_shares_its_first_stage_and_writes_a_best_plan_that_reproduces_it(tiny_project):
    path = sweep_plan(tiny_project)
    # A registry export: the sweep registers its best trial alone, not every trial.
    path.write_text(path.read_text().replace("[sweep]", '[[export]]\nuse = "merged"\n\n[[export]]\nuse = "mlflow"\n'
                                                       'alias = "best"\n\n[sweep]'))
    r = run_cli("sweep", str(path))
    assert r.returncode == 0, r.stderr[-3000:]
    folder = tiny_project.dir / "runs" / "tiny"
    done = trials(folder)
    states = [t["state"] for t in done]
    assert len(done) == 3 and states.count("COMPLETE") + states.count("PRUNED") == 3
    # 1e-6 and 2e-6 barely move the adapter: once 3e-3 ran, a tiny rate trails it at its first evaluation.
    assert "PRUNED" in states, done
    rates = []
    for t in done:
        manifest = json.loads((folder / "trials" / str(t["number"]) / "manifest.json").read_text())
        assert manifest["status"] == {"COMPLETE": "complete", "PRUNED": "pruned"}[t["state"]]
        # The pre-training stage is the sweep's shared one, linked in, not trained again.
        link = folder / "trials" / str(t["number"]) / "stages" / "pretrain"
        assert link.is_symlink() and (link / "COMPLETE.json").exists()
        rates.append(manifest["plan"]["stage"][1]["learning_rate"])
    assert sorted(rates) == [1e-6, 2e-6, 3e-3]  # the grid, each value once
    pruned = next(t for t in done if t["state"] == "PRUNED")
    assert isinstance(pruned["attrs"]["pruned_at_step"], int)
    summary = json.loads((folder / "sweep.json").read_text())
    assert summary["models"]["built"] == 2  # the base once, the shared stage's output once; copies after
    assert summary["models"]["copied"] >= 4

    # best_plan.toml: valid, the best values in, and running it gives the best trial's metric again.
    best = summary["best"]
    assert all(e["use"] != "mlflow" for t in done
               for e in json.loads((folder / "trials" / str(t["number"]) / "manifest.json").read_text())["plan"]["export"])
    registered = json.loads((folder / "registered" / "mlflow" / "registered.json").read_text())
    assert registered["version"] == 1 and registered["model_name"] == "tiny" and registered["alias"] == "best"
    assert registered["tags"]["ftcore.run_dir"] == str(folder / "trials" / best["folder"])
    text = (folder / "best_plan.toml").read_text()
    assert "[sweep]" not in text and 'name = "tiny-best"' in text
    assert run_cli("validate", str(folder / "best_plan.toml")).returncode == 0
    again = run_cli("run", str(folder / "best_plan.toml"))
    assert again.returncode == 0, again.stderr[-3000:]
    result = json.loads((tiny_project.dir / "runs" / "tiny-best" / "summary.json").read_text())
    assert result["evaluations"]["after"]["perplexity"]["perplexity"] == pytest.approx(best["value"], rel=1e-6)

    md = (folder / "sweep.md").read_text()
    assert "| trial | state | run folder | stage.sft.learning_rate |" in md and "pruned" in md
    for png in ("history", "slice", "intermediate"):
        assert (folder / "report" / f"sweep_{png}.png").read_bytes()[:4] == b"\x89PNG"
    assert "data:image/png;base64," in (folder / "sweep.html").read_text()

    # The folder is the sweep's: a second sweep without --resume, or a run, is refused in one line.
    second = run_cli("sweep", str(path))
    assert second.returncode == 2 and "pass --resume" in second.stderr and "Traceback" not in second.stderr
    path.write_text(path.read_text().replace("[sweep]", "[sweep]\nstartup_trials = 2"))
    other = run_cli("sweep", str(path), "--resume")
    assert other.returncode == 2 and "a different plan or space" in other.stderr


@pytest.mark.slow
def test_a_killed_sweep_resumes_without_counting_a_trial_twice(tiny_project):
    path = sweep_plan(tiny_project, sampler="random", trials=3, pruner="none",
                      space='"stage.sft.learning_rate" = { low = 1e-4, high = 1e-2, log = true }')
    path.write_text(path.read_text().replace("epochs = 2", "epochs = 6"))
    folder = tiny_project.dir / "runs" / "tiny"
    proc = start_cli("sweep", str(path), stdout=subprocess.DEVNULL)
    checkpoints = folder / "trials" / "1" / "stages" / "sft" / "checkpoints"
    deadline = time.time() + 900
    while time.time() < deadline and proc.poll() is None and not list(checkpoints.glob("checkpoint-*/COMPLETE.json")):
        time.sleep(0.02)
    assert proc.poll() is None, f"the sweep ended before it could be killed: {proc.communicate()[1][-2000:]}"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    r = run_cli("sweep", str(path), "--resume")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "trial 1 was interrupted" in r.stdout
    done = trials(folder)
    finished = [t for t in done if t["state"] in ("COMPLETE", "PRUNED")]
    assert len(finished) == 3  # the study's count, as planned
    interrupted = [t for t in done if t["attrs"].get("interrupted")]
    assert [t["number"] for t in interrupted] == [1] and interrupted[0]["state"] == "FAIL"
    # The rerun continued trial 1's own folder from its checkpoint; no folder holds two finished trials.
    folders = [t["attrs"]["folder"] for t in finished]
    assert sorted(folders) == sorted(set(folders)) and "1" in folders
    manifest = json.loads((folder / "trials" / "1" / "manifest.json").read_text())
    assert manifest["status"] == "complete" and len(manifest["resumed_at"]) == 1
    assert "resuming from checkpoint-" in (folder / "trials" / "1" / "run.log").read_text() or \
        "resuming from checkpoint-" in r.stdout


def test_a_plan_without_a_sweep_is_refused(tiny_project):
    path = tiny_project(STAGES)
    r = run_cli("sweep", str(path))
    assert r.returncode == 2 and "has no [sweep] table" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
def test_two_workers_share_one_study(tiny_project):
    """Optuna's own distributed mode: two processes, one SQLite storage and study, a folder each."""
    db = tiny_project.dir / "study.db"
    paths = []
    for name in ("w1", "w2"):
        path = sweep_plan(tiny_project, sampler="random", trials=4, pruner="none",
                          space='"stage.sft.learning_rate" = { low = 1e-4, high = 1e-2, log = true }')
        text = path.read_text().replace('name = "tiny"', f'name = "{name}"')
        paths.append(tiny_project.dir / f"{name}.toml")
        paths[-1].write_text(text.replace("[sweep]", f'[sweep]\nstudy = "shared"\nstorage = "sqlite:///{db}"'))
    # Both subprocesses, so they start alike (a fork would finish the study before the other had imported).
    procs = [subprocess.Popen([sys.executable, "-m", "ftcore", "sweep", str(p)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True) for p in paths]
    for proc in procs:
        assert proc.wait(timeout=1800) == 0, proc.stderr.read()[-2000:]
    with sqlite3.connect(db) as con:
        assert con.execute("select study_name from studies").fetchall() == [("shared",)]
        numbers = [n for (n,) in con.execute("select number from trials where state = 'COMPLETE'")]
    assert 4 <= len(numbers) <= 5  # each worker stops once 4 are finished; one more at most
    folders = [int(f.name) for name in ("w1", "w2") for f in (tiny_project.dir / "runs" / name / "trials").iterdir()]
    assert sorted(folders) == sorted(numbers)  # every trial ran once, in one worker's folder


def test_a_storage_that_cannot_open_is_one_line_and_the_fixed_plan_starts_over(tiny_project):
    path = sweep_plan(tiny_project)
    path.write_text(path.read_text().replace("[sweep]", '[sweep]\nstorage = "postgresql://me:s3cret@127.0.0.1:1/x"'))
    r = run_cli("sweep", str(path))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: sweep.storage: cannot open postgresql://me:***@127.0.0.1:1/x")
    folder = tiny_project.dir / "runs" / "tiny"
    assert "s3cret" not in (folder / "sweep.json").read_text()
    # Nothing ran: after the fix the same command starts over, without --resume.
    path.write_text(path.read_text().replace('storage = "postgresql://me:s3cret@127.0.0.1:1/x"\n', "")
                    .replace("trials = 3", "trials = 1"))
    again = run_cli("sweep", str(path))
    assert again.returncode == 0, again.stderr[-2000:]


@pytest.mark.parametrize("sampler,pruner,kinds", [
    ("tpe", "median", ("TPESampler", "MedianPruner")), ("random", "hyperband", ("RandomSampler", "HyperbandPruner")),
    ("grid", "none", ("GridSampler", "NopPruner")), ("cmaes", "median", ("CmaEsSampler", "MedianPruner"))])
def test_each_sampler_and_pruner_is_optunas_own(tiny_project, sampler, pruner, kinds):
    from ftcore.plan import load_plan
    from ftcore.plugins import get_plugin_manager

    from ftcore_plugins.commands.sweep import Sweeper

    space = SPACE if sampler == "grid" else '"stage.sft.learning_rate" = { low = 1e-4, high = 1e-2, log = true }\n' \
                                            '"stage.sft.adapter.r" = { low = 4, high = 16, step = 4 }'
    path = sweep_plan(tiny_project, space=space, sampler=sampler, pruner=pruner)
    pm = get_plugin_manager()
    sweeper = Sweeper(load_plan(path, pm.registry()), pm, None, str(path), resume=False)
    sweeper.folder.mkdir(parents=True)
    study = sweeper.study()
    assert (type(study.sampler).__name__, type(study.pruner).__name__) == kinds
    assert study.study_name == "tiny" and (sweeper.folder / "study.db").exists()
    if sampler != "grid":
        trial = study.ask()
        from ftcore_plugins.commands.sweep import suggest

        values = [suggest(trial, p) for p in sweeper.spec.space]
        assert 1e-4 <= values[0] <= 1e-2 and values[1] in (4, 8, 12, 16)
