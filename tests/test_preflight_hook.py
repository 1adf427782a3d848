"""The ``ftcore_preflight`` hook: checks of what the model's shapes decide, before ``ftcore run`` makes the
run folder. The built-in one (``ftcore_plugins.models.preflight``) checks ``max_length`` against the
model's context; a third party's problems are reported the same way, one line each, exit 2."""

from __future__ import annotations

from test_plugin_manager import add_dist, ftcore_cli, lines_with

STAGE = '\n[[stage]]\ntrainer = "sft"\ndata = "chat"\nmax_steps = 2\nmax_length = {length}\n'

PREFLIGHT = """
import ftcore


@ftcore.hookimpl
def ftcore_preflight(plan):
    return [f"stage[{s.index}].max_steps: {s.trainer.options.max_steps} steps is too few for this team"
            for s in plan.stages if s.trainer.options.max_steps < 10]
"""


def test_preflight_problems_stop_the_run_before_its_folder(tiny_project, tmp_path):
    # The tiny model's context is 128 tokens: a max_length the plan sets above it is refused.
    plan = tiny_project(STAGE.format(length=256))
    r = ftcore_cli("run", str(plan), cwd=tiny_project.dir)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert lines_with(r.stderr, f"{plan}: stage[0].max_length: 256 is longer than the model's context of 128 "
                                "tokens"), r.stderr
    assert not (tiny_project.dir / "runs").exists()
    # A third party's checks, through the same hook.
    site = tmp_path / "site"
    add_dist(site, "team-checks", {"team_checks": PREFLIGHT}, {"team": "team_checks"})
    plan = tiny_project(STAGE.format(length=64), "ok.toml")
    r = ftcore_cli("run", str(plan), cwd=tiny_project.dir, site=site)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert lines_with(r.stderr, f"{plan}: stage[0].max_steps: 2 steps is too few for this team"), r.stderr
    assert not (tiny_project.dir / "runs").exists()
