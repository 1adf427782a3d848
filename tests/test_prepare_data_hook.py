"""The ``ftcore_prepare_data`` hook: ``ftcore run`` reads the data of the stages it is about to train, and the
plugins prepare or check it before the model loads. The built-in one (``ftcore_plugins.commands.prepare``) has
each stage's trainer prepare its rows (``tests/test_bad_data.py`` checks that a bad row stops the run there); a
third party's check stops it the same way, and its bug is one line naming it. And a plan table that selects
components (``PlanSection.parse(table, problem, select)``), as the trackers' ``track`` does."""

from __future__ import annotations

import json
import os

import pytest

from test_plugin_manager import add_dist, ftcore_cli, lines_with

import ftcore
from ftcore.component import PlanSection
from ftcore.errors import PlanError
from ftcore.plan import load_plan
from ftcore.plugins import PluginInfo, get_plugin_manager

STAGE = '\n[[stage]]\ntrainer = "sft"\ndata = "chat"\nmax_steps = 2\nmax_length = 64\n'

CHECK = """
import ftcore
from ftcore.errors import FtcoreError


@ftcore.hookimpl
def ftcore_prepare_data(run, stages, load_data):
    rows = len(load_data(stages[0].data))
    if {fail}:
        raise ValueError("the team's check broke")
    raise FtcoreError(f"stage {{stages[0].name}}: {{rows}} rows; the team trains on 1000 or more")
"""


@pytest.mark.parametrize("fail", [False, True])
def test_a_third_partys_data_check_stops_the_run_before_the_model_loads(tiny_project, tmp_path, fail):
    site = tmp_path / "site"
    add_dist(site, "team-data", {"team_data": CHECK.format(fail=fail)}, {"team": "team_data"})
    plan = tiny_project(STAGE)
    r = ftcore_cli("run", str(plan), cwd=tiny_project.dir, site=site)
    assert "Traceback" not in r.stderr
    if fail:  # a plugin's bug: exit 1, naming the plugin and the hook
        assert r.returncode == 1 and lines_with(r.stderr, "error: plugin 'team' failed in ftcore_prepare_data: "
                                                          "ValueError: the team's check broke"), r.stderr
    else:
        assert r.returncode == 2 and lines_with(r.stderr, "error: stage 0-sft: 64 rows; the team trains on 1000"), \
            r.stderr
    run = tiny_project.dir / "runs" / "tiny"
    assert json.loads((run / "manifest.json").read_text())["status"] == "failed"
    assert "model loaded" not in (run / "metrics.jsonl").read_text()  # no weight was loaded


class AlertsSection(PlanSection):
    """``[alerts.<name>]``: each table a tracker with its options, as ``track`` reads them."""

    name = "alerts"

    @classmethod
    def parse(cls, table, problem, select):
        if not isinstance(table, dict):
            problem("alerts", "must be a table")
            return []
        return [sel for name, options in table.items()
                if (sel := select("tracker", name, f"alerts.{name}", options)) is not None]

    def components(self):
        return self.options or []


class Alerts:
    @ftcore.hookimpl
    def register_plan_sections(self, register):
        register(AlertsSection)


def test_a_table_that_selects_components_reports_them_as_the_core_does(tiny_project):
    pm = get_plugin_manager(entry_points=False)
    pm.add_plugin(Alerts(), PluginInfo("alerts", "alerts-dist", "1.0", "entry point"))
    registry = pm.registry()
    assert not registry.problems
    plan = load_plan(tiny_project(STAGE + '\n[alerts.tensorboard]\ndir = "tb"\n'), registry)
    [tracker] = plan.sections["alerts"].components()
    assert (tracker.key, tracker.name, tracker.options.dir.name) == ("alerts.tensorboard", "tensorboard", "tb")
    assert [t.key for t in plan.trackers] == ["alerts.tensorboard"]  # ftcore run registers it for the run
    with pytest.raises(PlanError) as err:
        load_plan(tiny_project(STAGE + '\n[alerts.tensorbord]\n\n[alerts.mlflow]\nexperimnt = "x"\n', "bad.toml"),
                  registry)
    problems = [p.split("bad.toml: ", 1)[1] for p in err.value.problems]
    assert problems[0].startswith("alerts.tensorbord: unknown tracker 'tensorbord'; did you mean 'tensorboard'?")
    assert problems[1].startswith("alerts.mlflow.experimnt: unknown key for tracker 'mlflow'; did you mean "
                                  "'experiment'?")
    assert len(problems) == 2, problems


@pytest.mark.parametrize("template, reads", [("native", 1), ("llama3", 2)])
def test_the_load_takes_the_tokenizer_the_data_check_read(qwen25_tiny_model, tmp_path, monkeypatch, template, reads):
    """The data check before the load reads the tokenizer, and the load takes that one rather than reading
    the files again (Llama 3's tokenizer is seconds to read). Not when the template added tokens to it:
    the load's tokenizer must be fresh, so that its own preparation grows the real model's embeddings."""
    import transformers
    from rich.console import Console

    from ftcore.runner import Runner

    from ftcore.testing import chat_rows, write_jsonl

    write_jsonl(tmp_path / "chat.jsonl", chat_rows(16))
    plan_path = tmp_path / "plan.toml"
    plan_path.write_text(f"""
[run]
name = "once"
output_dir = "{tmp_path / 'runs'}"

[model]
use = "hf"
path = "{qwen25_tiny_model}"

[template]
use = "{template}"

[data.chat]
use = "jsonl"
path = "{tmp_path / 'chat.jsonl'}"

[[stage]]
trainer = "sft"
data = "chat"
max_steps = 1
max_length = 64
""")
    monkeypatch.setenv("FTCORE_CACHE_DIR", str(tmp_path / "cache"))
    calls = []
    original = transformers.AutoTokenizer.from_pretrained
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        lambda *a, **k: calls.append(a) or original(*a, **k))
    loaded = []
    load_model = Runner.load_model
    monkeypatch.setattr(Runner, "load_model", lambda self, work: loaded.append(load_model(self, work)) or loaded[-1])
    pm = get_plugin_manager()
    with open(os.devnull, "w") as sink:
        Runner(load_plan(str(plan_path), pm.registry()), pm, Console(file=sink)).run()
    assert len(calls) == reads, calls
    [(model, tokenizer)] = loaded
    assert model.get_input_embeddings().weight.shape[0] >= len(tokenizer)
    if template == "llama3":  # its header tokens were added to the Qwen tokenizer, and the real model grew
        assert "<|start_header_id|>" in tokenizer.get_vocab()
        assert model.get_input_embeddings().weight.shape[0] == len(tokenizer)
