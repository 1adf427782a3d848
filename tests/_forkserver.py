"""The fast path of ``run_cli`` and ``run_script``: a process per pytest worker that imports the heavy
libraries once (torch, transformers, peft, trl, datasets, accelerate, deepspeed) and forks a fresh
child for each ``ftcore`` command, or benchmark script, that would import them anyway.

A subprocess pays its imports before ``ftcore run`` does any work (``import peft`` alone took 12.7 s
on this 2-core machine beside the suite), and the suite runs a few hundred of them:
``tests/test_runs.py`` took 254 s as plain subprocesses and 127 s as forks. The child is still a process of its own, as a user's
run is: its own working folder, environment, standard streams (files the test reads back), exit status
and atexit handlers. What it shares with the server is what the imports did, so a command whose
environment differs from the server's in anything a library reads at import (``IMPORT_TIME``), or a
command that should import nothing heavy (``--help``, ``validate``, ``plugins``), runs as a plain
subprocess.

Set ``FTCORE_TEST_FORKSERVER=0`` to run every command as a plain subprocess.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

# Commands that load torch and the training stack: the ones worth a fork.
HEAVY = {"run", "sweep", "generate", "check", "lr-find", "estimate", "prepare", "init"}
# Environment variables read at import by the preloaded libraries (or the interpreter): where a command's
# differs from the server's, it runs as a plain subprocess.
IMPORT_TIME = ("HF_", "HUGGINGFACE", "TRANSFORMERS", "TORCH", "PYTORCH", "OMP_", "MKL_", "KMP_", "PYTHON", "CUDA",
               "TOKENIZERS", "MLFLOW", "DS_", "DEEPSPEED", "ACCELERATE", "BITSANDBYTES", "TMPDIR", "TEMP", "TMP",
               "XDG_", "LD_", "WANDB", "TRITON", "NUMEXPR", "OPENBLAS")
PRELOAD = ("torch", "transformers", "transformers.modeling_utils", "transformers.trainer", "transformers.processing_utils",
           "peft", "trl", "trl.trainer.sft_trainer", "datasets", "accelerate", "deepspeed", "safetensors.torch",
           "matplotlib.pyplot")

def same_imports(env: dict[str, str], reference: dict[str, str]) -> bool:
    """Whether a process started with ``env`` would import the libraries as one started with ``reference``
    did (``PYTHONWARNINGS=ignore`` a child applies itself)."""
    env, reference = with_cli_defaults(env), with_cli_defaults(reference)
    keys = {k for k in (*env, *reference) if k.upper().startswith(IMPORT_TIME)}
    if env.get("PYTHONWARNINGS") == "ignore":
        keys.discard("PYTHONWARNINGS")
    return all(env.get(k) == reference.get(k) for k in keys)


def heavy(args: tuple[str, ...] | list[str]) -> bool:
    """Whether ``ftcore ARGS`` imports the training stack (so a fork saves its imports)."""
    return bool(args) and args[0] in HEAVY and "--help" not in args and "-h" not in args


# -- the server process and its children ----------------------------------------------------------------

_BOOT = "import sys; sys.path.insert(0, sys.argv[1]); import _forkserver; _forkserver.serve(sys.argv[2])"
_AT_START: dict = {}  # the server's environment, sys.path and warning filters, as a child starts from them


def serve(preload: str) -> None:
    """The server's main: import ``preload``, then fork a child per job line on stdin; answer its pid, then
    its exit status, on stdout."""
    import gc
    import importlib
    import warnings

    sys.path.remove(str(Path(__file__).parent))  # a fresh `python -m ftcore` does not see tests/
    # The protocol: jobs in on stdin, lines out on a copy of stdout; the server's own stdout goes nowhere.
    proto_in, proto_out = sys.stdin, os.fdopen(os.dup(1), "w")
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    environment = dict(os.environ)  # as started: the imports add their own variables
    for name in json.loads(preload):
        try:
            importlib.import_module(name)
        except Exception:
            pass
    _AT_START.update(env=environment, path=list(sys.path), filters=list(warnings.filters))
    # The imports' objects live as long as the server: out of the collector's sight, a child's gc.collect()
    # (ftcore calls it between stages) skips them instead of walking, and copying, the whole heap.
    gc.freeze()
    sys.stdout.flush()
    sys.stderr.flush()
    proto_out.write("ready\n")
    proto_out.flush()
    for line in proto_in:
        pid = fork_job(json.loads(line), close=proto_out)
        proto_out.write(f"{pid}\n")
        proto_out.flush()
        _, status = os.waitpid(pid, 0)
        proto_out.write(f"{os.waitstatus_to_exitcode(status)}\n")
        proto_out.flush()


def fork_job(job: dict, close=None) -> int:
    """Fork a child that runs ``job`` (``args``, ``script``, ``cwd``, ``env``, and ``out``/``err``: a file
    to write, a descriptor to copy, ``"stdout"``, or None to keep this process's) and exits; return its
    pid."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        if close is not None:
            close.close()
        code = _run_job(job)
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _run_job(job: dict) -> int:
    import atexit
    import builtins
    import runpy
    import signal
    import traceback
    import types
    import warnings
    import weakref

    # What the forking process set up is not the new command's: cleanups it registered (its temporary
    # folders) stay its own, and the environment, import path and warning filters start as the server's.
    for finalizer in list(weakref.finalize._registry):
        finalizer.atexit = False
    os.chdir(job["cwd"])
    os.environ.clear()
    os.environ.update(job["env"])
    streams = {fd: os.dup(job[key]) if isinstance(job[key], int) else job[key] for fd, key in ((1, "out"), (2, "err"))}
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    for fd, target in streams.items():
        if target == "stdout":
            os.dup2(1, fd)
        elif isinstance(target, int):
            os.dup2(target, fd)
        elif target is not None:
            os.dup2(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
    sys.stdin = open(0, closefd=False)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    warnings.filters[:] = _AT_START["filters"]
    warnings._filters_mutated()
    if job["env"].get("PYTHONWARNINGS") == "ignore":
        warnings.simplefilter("ignore")
    sys.path[:] = _AT_START["path"]
    subprocess.run = _nested_run  # the command's own `python -m ftcore ...` and scripts fork from here too
    code = 1
    try:
        if job.get("script"):
            # As `python SCRIPT` runs it: argv[0] as given, __file__ absolute, a fresh __main__.
            sys.argv = [job.get("argv0") or job["script"], *job["args"]]
            sys.path[0] = os.path.dirname(job["script"])
            main = sys.modules["__main__"] = types.ModuleType("__main__")
            main.__file__, main.__builtins__ = job["script"], builtins
            exec(compile(Path(job["script"]).read_bytes(), job["script"], "exec"), main.__dict__)
        else:
            sys.argv = ["ftcore", *job["args"]]
            runpy.run_module("ftcore", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        if exc.code is None:
            code = 0
        elif isinstance(exc.code, int):
            code = exc.code
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    return code


_REAL_RUN = subprocess.run
_RUN_KEYS = {"cwd", "env", "capture_output", "text", "universal_newlines", "encoding", "errors", "timeout", "check",
             "stdout", "stderr"}


def _nested_run(args, *more, **kw):
    """``subprocess.run`` in a forked command: ``[sys.executable, -m, ftcore, heavy command ...]`` and
    ``[sys.executable, script.py, ...]`` (a benchmark's arms, the tiny modes' runs) fork from this process,
    which imported the libraries already; anything else, or from a process running other threads, is the real
    ``subprocess.run``."""
    job = _nested_job(args, more, kw)
    if job is None:
        return _REAL_RUN(args, *more, **kw)
    captured = {}
    for key in ("out", "err"):
        target = kw.get(f"std{key}")
        if kw.get("capture_output") or target == subprocess.PIPE:
            fd, captured[key] = tempfile.mkstemp(prefix="ftcore-fork-", suffix=f".{key}")
            os.close(fd)
            job[key] = captured[key]
        elif target == subprocess.DEVNULL:
            job[key] = os.devnull
        elif target == subprocess.STDOUT:
            job[key] = "stdout"
        elif target is None:
            job[key] = None
        else:
            job[key] = target if isinstance(target, int) else target.fileno()
    pid = fork_job(job)
    timeout = kw.get("timeout")
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while not (done := os.waitpid(pid, os.WNOHANG))[0]:
            if deadline is not None and time.monotonic() > deadline:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                raise subprocess.TimeoutExpired(args, timeout)
            time.sleep(0.02)
    except BaseException:
        with contextlib.suppress(ProcessLookupError, ChildProcessError):
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        raise
    finally:
        text = kw.get("text") or kw.get("universal_newlines") or kw.get("encoding") or kw.get("errors")
        output = {}
        for key, path in captured.items():
            data = Path(path).read_bytes()
            output[key] = data.decode(kw.get("encoding") or "utf-8", kw.get("errors") or "strict") if text else data
            os.unlink(path)
    code = os.waitstatus_to_exitcode(done[1])
    if kw.get("check") and code:
        raise subprocess.CalledProcessError(code, args, output.get("out"), output.get("err"))
    return subprocess.CompletedProcess(args, code, output.get("out"), output.get("err"))


def _nested_job(args, more, kw) -> dict | None:
    if more or not set(kw) <= _RUN_KEYS or isinstance(args, (str, bytes)):
        return None
    # A fork copies no thread but the caller's, nor what the others were doing: only tqdm's monitor (asleep
    # but for a moment a second) may be running.
    if any(t is not threading.main_thread() and t.name != "tqdm_monitor" for t in threading.enumerate()):
        return None
    argv = [os.fspath(a) for a in args]
    if len(argv) < 2 or argv[0] != sys.executable:
        return None
    env = dict(os.environ if kw.get("env") is None else kw["env"])
    if not same_imports(env, _AT_START["env"]):
        return None
    cwd = os.path.abspath(os.fspath(kw.get("cwd") or os.getcwd()))
    if argv[1:3] == ["-m", "ftcore"] and heavy(argv[3:]):
        return {"args": argv[3:], "script": None, "cwd": cwd, "env": env}
    script = os.path.join(cwd, argv[1])  # a script's path is the new process's, from its folder
    if script.endswith(".py") and os.path.isfile(script):
        return {"args": argv[2:], "script": script, "argv0": argv[1], "cwd": cwd, "env": env}
    return None


class ForkServer:
    """One server process; :meth:`run` is ``subprocess.run([python, -m, ftcore, *args], capture_output=True,
    text=True)`` by a fork of it."""

    def __init__(self, env: dict[str, str]):
        self.env = with_cli_defaults(env)
        self.folder = Path(tempfile.mkdtemp(prefix="ftcore-forkserver-"))
        self.proc = subprocess.Popen([sys.executable, "-c", _BOOT, str(Path(__file__).parent), json.dumps(PRELOAD)],
                                     env=self.env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True, bufsize=1)
        self.ready = self.proc.stdout.readline().strip() == "ready"
        self.lock = threading.Lock()
        self.count = 0

    def takes(self, args: tuple[str, ...], env: dict[str, str], script: Path | None = None) -> bool:
        """Whether the command can run as a fork: a heavy ``ftcore`` command (or a ``script``), with the
        server's import-time environment (``PYTHONWARNINGS=ignore`` the child applies itself)."""
        if not self.ready or self.proc.poll() is not None:
            return False
        return (script is not None or heavy(args)) and same_imports(env, self.env)

    def run(self, args: tuple[str, ...], cwd: Path | None, env: dict[str, str], timeout: float,
            script: Path | None = None):
        """``ftcore ARGS``, or ``python SCRIPT ARGS``, in a fork."""
        with self.lock:
            self.count += 1
            out, err = self.folder / f"{self.count}.out", self.folder / f"{self.count}.err"
            job = {"args": list(args), "cwd": str(cwd or os.getcwd()), "env": env, "out": str(out), "err": str(err),
                   "script": str(script) if script else None}
            self.proc.stdin.write(json.dumps(job) + "\n")
            self.proc.stdin.flush()
            pid = int(self.proc.stdout.readline())
            status: list[str] = []
            reader = threading.Thread(target=lambda: status.append(self.proc.stdout.readline()), daemon=True)
            reader.start()
            reader.join(timeout)
            command = [sys.executable, *([str(script)] if script else ["-m", "ftcore"]), *args]
            if reader.is_alive():
                os.kill(pid, 9)
                reader.join()
                raise subprocess.TimeoutExpired(command, timeout, _read(out), _read(err))
            code = int(status[0])
            result = subprocess.CompletedProcess(command, code, _read(out), _read(err))
            out.unlink(missing_ok=True)
            err.unlink(missing_ok=True)
            return result

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        for f in self.folder.iterdir():
            f.unlink()
        self.folder.rmdir()


def with_cli_defaults(env: dict[str, str]) -> dict[str, str]:
    """``env`` as ``ftcore``'s ``main`` leaves it before torch loads (ftcore/cli.py)."""
    return {"OMP_WAIT_POLICY": "PASSIVE", **env}


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace") if path.exists() else ""
