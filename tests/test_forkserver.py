"""The suite's fork server (tests/_forkserver.py) runs a command as a plain subprocess would: the same exit
status, standard streams, working folder and environment."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from _forkserver import ForkServer


@pytest.fixture(scope="module")
def server():
    found = ForkServer(dict(os.environ))
    yield found
    found.close()


def plain(args, cwd, env):
    return subprocess.run([sys.executable, "-m", "ftcore", *args], cwd=cwd, env=env, capture_output=True, text=True)


def test_a_refused_plan_gives_what_a_subprocess_gives(server, tmp_path):
    (tmp_path / "plan.toml").write_text('[run]\nname = "x"\n\n[model]\nuse = "scratch"\nsize = "nope"\n')
    env = {**os.environ, "COLUMNS": "123"}
    assert server.takes(("run", "plan.toml"), env)
    forked = server.run(("run", "plan.toml"), tmp_path, env, timeout=300)
    alone = plain(("run", "plan.toml"), tmp_path, env)
    assert forked.returncode == alone.returncode == 2
    assert forked.stderr == alone.stderr and forked.stdout == alone.stdout


def test_what_the_fork_would_not_reproduce_runs_as_a_subprocess(server):
    env = dict(os.environ)
    assert not server.takes(("validate", "plan.toml"), env)  # imports nothing heavy: nothing to save
    assert not server.takes(("run", "--help"), env)
    assert not server.takes(("run", "plan.toml"), {**env, "HF_HOME": "/elsewhere"})  # read at import
    assert not server.takes(("run", "plan.toml"), {**env, "OMP_NUM_THREADS": "7"})


def test_a_hang_is_killed_at_the_timeout(server, tmp_path):
    with pytest.raises(subprocess.TimeoutExpired):
        # `estimate` of a plan read from a FIFO nobody writes: the command blocks reading it.
        os.mkfifo(tmp_path / "plan.toml")
        server.run(("estimate", "plan.toml"), tmp_path, dict(os.environ), timeout=5)
    assert server.run(("run", "missing.toml"), tmp_path, dict(os.environ), timeout=300).returncode == 2
