"""Commands as plugins: the ``register_commands`` hook, through the real CLI and real entry points.

Third-party command plugins are real distributions (see ``add_dist`` in test_plugin_manager.py, or a
real pip install of ``examples/ftcore-example-command``), discovered by ``importlib.metadata``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import installed, run_cli
from ftcore.plugins import get_plugin_manager
from test_plugin_manager import add_dist, ftcore_cli, lines_with

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "ftcore-example-command"


def command_module(name: str, cls: str = "Hello", body: str = "print('hello from', args.who); return 0",
                   extra: str = "") -> str:
    return f"""
import ftcore
from ftcore.command import Command


class {cls}(Command):
    \"\"\"Say hello.

    A test command.
    \"\"\"

    name = {name!r}

    def add_arguments(self, parser):
        parser.add_argument("who")

    def run(self, args):
        {body}

{extra}

@ftcore.hookimpl
def register_commands(register):
    register({cls})
"""


def test_builtin_commands_are_plugins_and_help_lists_them(tmp_path):
    r = ftcore_cli("--help", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""
    for name, line in (("init", "write a starter plan"), ("estimate", "predict each stage's peak memory"),
                       ("report", "write a run's report.html"), ("cache", "show or clear the tokenized-data cache"),
                       ("chat", "chat with a run's model"), ("generate", "answer a JSONL file of prompts"),
                       ("prepare", "tokenize a plan's data into the cache, without training"),
                       ("check", "pre-flight check of a plan's training stages"),
                       ("lr-find", "learning-rate range test on a stage's data"),
                       ("sweep", "search hyperparameters over the plan's [sweep] space with"),
                       ("validate", "check a plan and list every problem, loading nothing")):
        assert lines_with(r.stdout, name, line), r.stdout
    listing = json.loads(ftcore_cli("plugins", "--json", cwd=tmp_path).stdout)
    by_name = {c["name"]: c for c in listing["commands"]}
    assert set(by_name) == {"init", "estimate", "report", "cache", "chat", "generate", "prepare", "check", "lr-find",
                            "sweep", "plugins", "validate"}
    assert all(c["dist"] == "ftcore" and c["plugin"].startswith("ftcore_plugins.commands.") for c in by_name.values())


def test_a_third_party_command_is_listed_and_runs(tmp_path):
    site = tmp_path / "site"
    add_dist(site, "hello-dist", {"hello_cmd": command_module("hello")}, {"hello": "hello_cmd"})
    r = ftcore_cli("--help", cwd=tmp_path, site=site)
    assert lines_with(r.stdout, "hello", "say hello"), r.stdout
    r = ftcore_cli("hello", "world", cwd=tmp_path, site=site)
    assert (r.returncode, r.stdout.strip(), r.stderr) == (0, "hello from world", "")
    r = ftcore_cli("hello", "--help", cwd=tmp_path, site=site)
    assert "A test command." in r.stdout and "--debug" in r.stdout
    text = ftcore_cli("plugins", cwd=tmp_path, site=site).stdout
    assert lines_with(text, "hello", "hello-dist 1.0", "say hello"), text


def test_a_command_raising_ftcore_error_is_one_line_and_exit_2(tmp_path):
    site = tmp_path / "site"
    body = "from ftcore.errors import FtcoreError; raise FtcoreError(f'{args.who}: no such thing')"
    add_dist(site, "hello-dist", {"hello_cmd": command_module("hello", body=body)}, {"hello": "hello_cmd"})
    r = ftcore_cli("hello", "x.toml", cwd=tmp_path, site=site)
    assert (r.returncode, r.stderr) == (2, "error: x.toml: no such thing\n")
    r = ftcore_cli("--debug", "hello", "x.toml", cwd=tmp_path, site=site)  # --debug before the command
    assert r.returncode == 2 and "Traceback" in r.stderr


def test_a_broken_command_plugin_is_one_warning_and_every_other_command_works(tmp_path):
    site = tmp_path / "site"
    add_dist(site, "broken-dist", {"broken_cmd": "raise ImportError('needs a missing library')\n"},
             {"broken": "broken_cmd"})
    add_dist(site, "raising-dist", {"raising_cmd": """
import ftcore

@ftcore.hookimpl
def register_commands(register):
    raise RuntimeError("cannot register")
"""}, {"raising": "raising_cmd"})
    add_dist(site, "hello-dist", {"hello_cmd": command_module("hello")}, {"hello": "hello_cmd"})
    r = ftcore_cli("--help", cwd=tmp_path, site=site)
    assert r.returncode == 0, r.stderr
    assert len(lines_with(r.stderr, "warning:", "'broken'", "broken-dist", "needs a missing library")) == 1, r.stderr
    assert len(lines_with(r.stderr, "warning:", "'raising'", "register_commands", "cannot register")) == 1, r.stderr
    assert len(r.stderr.splitlines()) == 2, r.stderr
    assert "Traceback" not in r.stderr
    assert ftcore_cli("hello", "you", cwd=tmp_path, site=site).stdout.strip() == "hello from you"
    r = ftcore_cli("cache", cwd=tmp_path, site=site, env={"FTCORE_CACHE_DIR": str(tmp_path / "cache")})
    assert r.returncode == 0 and "0 files" in r.stdout


def test_command_name_clashes_name_the_winner(tmp_path):
    site = tmp_path / "site"
    add_dist(site, "one-dist", {"one_cmd": command_module("hello", body="print('one'); return 0")}, {"one": "one_cmd"})
    add_dist(site, "two-dist", {"two_cmd": command_module("hello", body="print('two'); return 0")}, {"two": "two_cmd"})
    add_dist(site, "report-dist", {"report_cmd": command_module("report", body="print('mine'); return 0")},
             {"rep": "report_cmd"})
    add_dist(site, "run-dist", {"run_cmd": command_module("run")}, {"runner": "run_cmd"})
    add_dist(site, "bad-dist", {"bad_cmd": "import ftcore\n\n@ftcore.hookimpl\ndef register_commands(register):\n"
                                           "    register(object)\n"}, {"bad": "bad_cmd"})
    r = ftcore_cli("hello", "x", cwd=tmp_path, site=site)
    assert r.returncode == 0
    clash = lines_with(r.stderr, "warning: command 'hello' is registered by both")
    assert len(clash) == 1, r.stderr
    winner = r.stdout.strip()  # entry points load in an order the environment decides; the warning names it
    assert f"`ftcore hello` runs the one from plugin '{winner}' ({winner}-dist 1.0)" in clash[0]
    # A built-in command keeps its name; the core's own cannot be replaced.
    assert lines_with(r.stderr, "command 'report'", "`ftcore report` runs the one from plugin "
                                                    "'ftcore_plugins.commands.report' (ftcore")
    assert lines_with(r.stderr, "plugin 'runner' (run-dist 1.0) registered the command 'run', which is ftcore's own")
    assert lines_with(r.stderr, "plugin 'bad' (bad-dist 1.0) registered an invalid command: expected a subclass of "
                                "ftcore.command.Command")
    r = ftcore_cli("report", str(tmp_path / "nowhere"), cwd=tmp_path, site=site)
    assert "mine" not in r.stdout and r.returncode == 2


@pytest.mark.slow
def test_the_example_command_package_installed_for_real(tiny_project, tmp_path):
    plan = tiny_project("""
[[stage]]
name = "sft"
trainer = "sft"
data = "chat"
adapter = "full"
max_steps = 4
batch_size = 4
max_length = 64
learning_rate = 3e-3

[[evaluate]]
use = "perplexity"
data = "chat_eval"
when = "both"
""")
    run = run_cli("run", str(plan), cwd=tiny_project.dir)
    assert run.returncode == 0, run.stderr
    with installed(EXAMPLE, "ftcore-example-command", tmp_path):
        r = ftcore_cli("--help", cwd=tmp_path)
        assert lines_with(r.stdout, "runs", "list the runs in a folder"), r.stdout
        listing = json.loads(ftcore_cli("plugins", "--json", cwd=tmp_path).stdout)
        assert {"name": "runs", "dist": "ftcore-example-command"}.items() <= \
            next(c for c in listing["commands"] if c["name"] == "runs").items()
        r = ftcore_cli("runs", "--json", str(tiny_project.dir / "runs"), cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        [row] = json.loads(r.stdout)
        evaluations = tiny_project.dir / "runs" / "tiny" / "evaluations"
        before = json.loads((evaluations / "before.json").read_text())["perplexity"]["perplexity"]
        after = json.loads((evaluations / "after.json").read_text())["perplexity"]["perplexity"]
        assert (row["run"], row["status"], row["stages"]) == ("tiny", "complete", "1/1")
        assert row["metrics"] == f"perplexity.perplexity: {before:.4g} -> {after:.4g}"
        r = ftcore_cli("runs", str(tmp_path / "missing"), cwd=tmp_path)
        assert (r.returncode, r.stderr) == (2, f"error: {tmp_path / 'missing'}: no such folder; give the folder "
                                               "that holds your run directories\n")


def test_the_end_of_run_tables_come_from_the_ftcore_run_summary_hook():
    """``ftcore run`` shows a completed run through ``ftcore_run_summary``; the built-in report plugin prints
    the tables, and without it nothing is printed."""
    from rich.console import Console

    summary = {"run_dir": "runs/x", "stages": {"sft": {"train_loss": 1.25, "other": 3}},
               "evaluations": {"before": {"ppl": {"perplexity": 12.5}}, "after": {"ppl": {"perplexity": 10.0}}},
               "exports": {"merged": "runs/x/exports/merged"}, "memory": {"baseline": {"rss_mib": 100.0}},
               "steps": [{"name": "sft", "seconds": 1.5, "skipped": False}]}
    console = Console(record=True, width=120)
    assert get_plugin_manager(entry_points=False, components=False).notify(
        "ftcore_run_summary", console=console, summary=summary) == []
    text = console.export_text()
    for shown in ("Evaluation", "-2.5", "Steps", "train_loss=1.25", "Memory (MiB,", "Artifacts",
                  "runs/x/exports/merged", "run directory: runs/x"):
        assert shown in text, text
    assert "other=3" not in text
    console = Console(record=True, width=120)
    get_plugin_manager(entry_points=False, components=False, env={"FTCORE_DISABLE_PLUGINS": "commands.report"}).notify(
        "ftcore_run_summary", console=console, summary=summary)
    assert console.export_text() == ""


def test_ftcore_cli_start_quiets_the_libraries_before_ftcore_run(monkeypatch):
    """The command line calls ``ftcore_cli_start`` before a command; the built-in one quiets the ML libraries
    for ``ftcore run`` (not with ``--debug``, nor for a command that does not load them)."""
    import logging
    import os

    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if k != "TRANSFORMERS_VERBOSITY"})
    monkeypatch.setattr(logging, "captureWarnings", lambda capture: None)
    monkeypatch.setattr(logging.getLogger(), "handlers", list(logging.getLogger().handlers))
    pm = get_plugin_manager(entry_points=False, components=False)
    assert pm.notify("ftcore_cli_start", command="validate", debug=False) == []
    assert pm.notify("ftcore_cli_start", command="run", debug=True) == []
    assert "TRANSFORMERS_VERBOSITY" not in os.environ
    assert pm.notify("ftcore_cli_start", command="run", debug=False) == []
    assert os.environ["TRANSFORMERS_VERBOSITY"] == "error"
