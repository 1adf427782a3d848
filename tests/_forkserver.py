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

import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

# Commands that load torch and the training stack: the ones worth a fork.
HEAVY = {"run", "sweep", "generate", "check", "lr-find", "estimate", "prepare", "init"}
# Environment variables read at import by the preloaded libraries (or the interpreter): where a command's
# differs from the server's, it runs as a plain subprocess.
IMPORT_TIME = ("HF_", "HUGGINGFACE", "TRANSFORMERS", "TORCH", "PYTORCH", "OMP_", "MKL_", "KMP_", "PYTHON", "CUDA",
               "TOKENIZERS", "MLFLOW", "DS_", "DEEPSPEED", "ACCELERATE", "BITSANDBYTES", "TMPDIR", "TEMP", "TMP",
               "XDG_", "LD_", "WANDB", "TRITON", "NUMEXPR", "OPENBLAS")
PRELOAD = ("torch", "transformers", "transformers.modeling_utils", "transformers.trainer", "transformers.processing_utils",
           "peft", "trl", "trl.trainer.sft_trainer", "datasets", "accelerate", "deepspeed", "safetensors.torch")

SERVER = r"""
import json, os, runpy, signal, sys, traceback, atexit, importlib
# The protocol: jobs in on stdin, lines out on a copy of stdout; the server's own stdout goes nowhere.
proto_in, proto_out = sys.stdin, os.fdopen(os.dup(1), "w")
quiet = os.open(os.devnull, os.O_WRONLY)
os.dup2(quiet, 1)
for name in json.loads(sys.argv[1]):
    try:
        importlib.import_module(name)
    except Exception:
        pass
sys.stdout.flush(); sys.stderr.flush()
proto_out.write("ready\n"); proto_out.flush()
for line in proto_in:
    job = json.loads(line)
    sys.stdout.flush(); sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            proto_out.close()
            os.chdir(job["cwd"])
            os.environ.clear(); os.environ.update(job["env"])
            for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, job["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                                    (2, job["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
                opened = os.open(path, flags, 0o644)
                os.dup2(opened, fd)
                os.close(opened)
            sys.stdin = open(0, closefd=False)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            if job["env"].get("PYTHONWARNINGS") == "ignore":
                import warnings
                warnings.simplefilter("ignore")
            try:
                if job.get("script"):
                    sys.argv = [job["script"], *job["args"]]
                    sys.path[0] = os.path.dirname(job["script"])
                    runpy.run_path(job["script"], run_name="__main__")
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
        finally:
            try:
                sys.stdout.flush(); sys.stderr.flush()
            finally:
                os._exit(code)
    proto_out.write(f"{pid}\n"); proto_out.flush()
    _, status = os.waitpid(pid, 0)
    proto_out.write(f"{os.waitstatus_to_exitcode(status)}\n"); proto_out.flush()
"""


class ForkServer:
    """One server process; :meth:`run` is ``subprocess.run([python, -m, ftcore, *args], capture_output=True,
    text=True)`` by a fork of it."""

    def __init__(self, env: dict[str, str]):
        self.env = with_cli_defaults(env)
        self.folder = Path(tempfile.mkdtemp(prefix="ftcore-forkserver-"))
        self.proc = subprocess.Popen([sys.executable, "-c", SERVER, json.dumps(PRELOAD)], env=self.env,
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
        if script is None and (not args or args[0] not in HEAVY or "--help" in args or "-h" in args):
            return False
        env = with_cli_defaults(env)
        keys = {k for k in (*env, *self.env) if k.upper().startswith(IMPORT_TIME)}
        if env.get("PYTHONWARNINGS") == "ignore":
            keys.discard("PYTHONWARNINGS")
        return all(env.get(k) == self.env.get(k) for k in keys)

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
