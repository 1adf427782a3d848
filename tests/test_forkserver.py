"""The suite's fork server (tests/_forkserver.py) runs a command as a plain subprocess would: the same exit
status, standard streams, working folder and environment."""

from __future__ import annotations

import json
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


CHILD = """
import json, os, sys
print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0], "marker": os.environ.get("MARKER"),
                  "forked": "torch" in sys.modules}))
print("to stderr", file=sys.stderr)
if sys.argv[1] == "sleep":
    sys.stdout.flush()
    __import__("time").sleep(300)
sys.exit(int(sys.argv[1]))
"""

DRIVER = """
import json, os, subprocess, sys, tempfile

def real_run(*args, **kw):  # subprocess.run with the exec'ing Popen
    forking, subprocess.Popen = subprocess.Popen, subprocess.Popen.__mro__[1]
    try:
        return subprocess.run(*args, **kw)
    finally:
        subprocess.Popen = forking

kept = tempfile.TemporaryDirectory()
results = {}
for name, run in (("nested", subprocess.run), ("real", real_run)):
    env = {**os.environ, "MARKER": name}
    script = run([sys.executable, "child.py", "3"], cwd="sub", env=env, capture_output=True, text=True)
    merged = run([sys.executable, "child.py", "0"], cwd="sub", stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    refused = run([sys.executable, "-m", "ftcore", "run", "plan.toml"], capture_output=True, text=True, timeout=300)
    try:
        run([sys.executable, "child.py", "4"], cwd="sub", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            check=True)
    except subprocess.CalledProcessError as exc:
        checked = exc.returncode
    popen = subprocess.Popen if name == "nested" else subprocess.Popen.__mro__[1]
    with popen([sys.executable, "child.py", "sleep"], cwd="sub", stdout=subprocess.PIPE, text=True,
                          start_new_session=True) as sleeper:
        started = json.loads(sleeper.stdout.readline())
        leads_a_session = os.getsid(sleeper.pid) == sleeper.pid
        sleeper.terminate()
        stopped = [sleeper.wait(timeout=60), started["forked"], leads_a_session]
    results[name] = {"stopped": stopped, "script": [script.returncode, json.loads(script.stdout), script.stderr],
                     "merged": merged.stdout.decode().splitlines()[1:],
                     "refused": [refused.returncode, refused.stdout, refused.stderr], "checked": checked}
results["kept"] = os.path.isdir(kept.name)
print(json.dumps(results))
"""


def test_a_forked_commands_own_python_subprocesses_fork_too_and_behave_as_real_ones(server, tmp_path):
    """A benchmark run as a fork starts its arms and `ftcore` runs with subprocess.run: those fork from it,
    with what a real subprocess would see and give back (streams, pipes, exit status, signals, sessions), and
    the driver's own cleanups stay its own."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "child.py").write_text(CHILD)
    (tmp_path / "driver.py").write_text(DRIVER)
    (tmp_path / "plan.toml").write_text('[run]\nname = "x"\n\n[model]\nuse = "scratch"\nsize = "nope"\n')
    done = server.run((), tmp_path, dict(os.environ), timeout=600, script=tmp_path / "driver.py")
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout.splitlines()[-1])
    nested, real = results["nested"], results["real"]
    assert nested["script"][1].pop("forked") and not real["script"][1].pop("forked")  # imports not paid again
    assert nested["script"][1]["marker"] == "nested" and real["script"][1]["marker"] == "real"
    nested["script"][1]["marker"] = real["script"][1]["marker"] = None
    assert nested["script"] == real["script"]
    assert nested["script"][1]["cwd"] == str(tmp_path / "sub") == nested["script"][1]["path0"]
    assert nested["merged"] == real["merged"] == ["to stderr"]
    assert nested["refused"] == real["refused"] and nested["refused"][0] == 2
    assert nested["checked"] == real["checked"] == 4
    assert nested["stopped"] == [-15, True, True] and real["stopped"] == [-15, False, True]  # pipes, signals
    assert results["kept"]  # the fork's exit ran none of the driver's finalizers


def test_a_started_command_is_signalled_and_waited_for_as_a_popen_is(server, tmp_path):
    """``start`` (the kill-and-resume tests' way in): a real pid to signal, poll and wait, one command at a
    time; while it runs the server refuses another, and the caller starts a subprocess instead."""
    os.mkfifo(tmp_path / "plan.toml")  # `estimate` blocks reading a FIFO nobody writes
    proc = server.start(("estimate", "plan.toml"), tmp_path, dict(os.environ))
    assert proc.poll() is None and server.start(("run", "plan.toml"), tmp_path, dict(os.environ)) is None
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=1)
    proc.kill()
    assert proc.wait(timeout=60) == -9 and proc.communicate() == ("", "")
    done = server.run(("run", "missing.toml"), tmp_path, dict(os.environ), timeout=300)
    assert done.returncode == 2 and "missing.toml" in done.stderr


def test_a_site_folder_on_pythonpath_forks_unless_it_shadows_what_the_server_imported(tmp_path):
    """A test's folder of plugin packages on PYTHONPATH goes on a fork's sys.path, as a new process puts it;
    one holding a module the server imported (a new process would import the folder's) runs as a new process."""
    from _forkserver import added_path, same_imports

    plugins, shadow = tmp_path / "plugins", tmp_path / "shadow"
    (plugins / "ftcore_some_plugin").mkdir(parents=True)
    (plugins / "some_plugin-1.0.dist-info").mkdir()
    (shadow / "torch").mkdir(parents=True)
    assert added_path({"PYTHONPATH": str(plugins)}, {}) == [str(plugins)]
    assert same_imports({"PYTHONPATH": str(plugins)}, {})
    assert added_path({"PYTHONPATH": f"{plugins}{os.pathsep}{shadow}"}, {}) is None
    assert not same_imports({"PYTHONPATH": str(shadow)}, {})
    assert added_path({}, {"PYTHONPATH": str(plugins)}) is None  # the server's own folder taken away
    (shadow / "torch").rmdir()
    (shadow / "sitecustomize.py").write_text("")  # run at a new process's start, which a fork has had
    assert added_path({"PYTHONPATH": str(shadow)}, {}) is None


def test_what_the_imports_set_in_the_environment_is_no_difference():
    """A test that imported torch in its own process has the variables the imports set (as the server has):
    its commands still fork; a value of the user's own for the same variable does not."""
    from _forkserver import same_imports

    imported = {"TORCHINDUCTOR_CACHE_DIR": "/tmp/torchinductor_root"}
    assert same_imports({"TORCHINDUCTOR_CACHE_DIR": "/tmp/torchinductor_root"}, {}, imported)
    assert not same_imports({"TORCHINDUCTOR_CACHE_DIR": "/elsewhere"}, {}, imported)
    assert not same_imports({"TORCHINDUCTOR_CACHE_DIR": "/tmp/torchinductor_root"}, {})
