"""The fast path of ``run_cli``, ``start_cli`` and ``run_script``: a process per pytest worker that imports
the heavy libraries once (torch, transformers, peft, trl, datasets, accelerate, deepspeed, matplotlib) and
forks a fresh child for each ``ftcore`` command, or benchmark script, that would import them anyway.

A subprocess pays its imports before ``ftcore run`` does any work (``import peft`` alone took 12.7 s
on this 2-core machine beside the suite), and the suite runs a few hundred of them:
``tests/test_runs.py`` took 254 s as plain subprocesses and 127 s as forks. The child is still a process
of its own, as a user's run is: its own working folder, environment, standard streams (files the test
reads back), exit status, signals and atexit handlers. What it shares with the server is what the imports
did, so a command whose environment differs from the server's in anything a library reads at import
(``IMPORT_TIME``), or a command that should import nothing heavy (``--help``, ``validate``, ``plugins``),
runs as a plain subprocess.

Three more things keep a forked command fast:

* the server freezes its imports' objects out of the garbage collector's sight, so a child's
  ``gc.collect()`` (ftcore calls it between stages) does not walk, and copy, the whole heap (a tiny
  ``ftcore run`` in a process that had imported the libraries, three times each way, alternating, beside
  the suite: 3.5-4.7 s, frozen 1.4-2.4 s);
* in a child, ``subprocess.Popen`` (so ``subprocess.run``) starts ``python -m ftcore`` and
  ``python script.py`` as a fork of the child itself (:class:`ForkingPopen`): a benchmark's arms and
  runs, and the runs its kill trials kill, skip their imports too;
* :meth:`ForkServer.start` hands the test a Popen-like handle to signal, poll and wait for.

Set ``FTCORE_TEST_FORKSERVER=0`` to run every command as a plain subprocess.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import signal
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


# Threads a fork may leave behind: tqdm's monitor, huggingface_hub's telemetry queue (asleep but for a moment).
IDLE_THREADS = ("tqdm_monitor", "(_telemetry_worker)")
# Read by huggingface_hub at import; a child whose environment sets one goes offline itself.
OFFLINE = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
# The command line of llama.cpp's converter process (ftcore_plugins.exporters.llama_cpp_converter.BOOT): it imports
# torch and transformers, then the converter's own gguf, which replaces any the forking process had imported.
CONVERTER = "from ftcore_plugins.exporters._converter_process import main"
OWN_MODULES = ("gguf", "conversion")


def same_imports(env: dict[str, str], reference: dict[str, str], imported: dict[str, str] | None = None,
                 applied: dict[str, str] | None = None) -> bool:
    """Whether a process started with ``env`` would import the libraries as one started with ``reference``
    did (``PYTHONWARNINGS=ignore`` and offline mode a child applies itself). ``imported``: the reference's
    environment after its imports; a variable they set (torch sets ``TORCHINDUCTOR_CACHE_DIR``, DeepSpeed
    ``PYTORCH_NVML_BASED_CUDA_CHECK``) is no difference where ``env`` has it because a test imported them too.
    ``applied``: what the forking command set itself and applied to the libraries it had (``ftcore`` quiets
    them through variables such as ``TRANSFORMERS_VERBOSITY``, and through their own calls)."""
    env, reference = with_cli_defaults(env), with_cli_defaults(reference)
    keys = {k for k in (*env, *reference) if k.upper().startswith(IMPORT_TIME)} - {"PYTHONPATH"}
    if env.get("PYTHONWARNINGS") == "ignore":
        keys.discard("PYTHONWARNINGS")
    keys -= {k for k in OFFLINE if env.get(k) == "1"}
    keys -= {k for k in keys if k not in reference and imported and k in imported and env.get(k) == imported[k]}
    keys -= {k for k in keys if applied and k in applied and env.get(k) == applied[k]}
    return all(env.get(k) == reference.get(k) for k in keys) and added_path(env, reference) is not None


def added_path(env: dict[str, str], reference: dict[str, str]) -> list[str] | None:
    """The folders ``env``'s PYTHONPATH puts before ``reference``'s (a test's site of plugin packages, which a
    child puts on its ``sys.path``), or None where the rest differs, or where such a folder holds a module the
    server imported (a new process would import that one from the folder; a fork keeps the server's), or a
    ``sitecustomize`` (a new process runs it at start; a fork has started)."""
    mine, theirs = ([p for p in e.get("PYTHONPATH", "").split(os.pathsep) if p] for e in (env, reference))
    extra = mine[:len(mine) - len(theirs)]
    if mine[len(extra):] != theirs:
        return None
    loaded = {name.partition(".")[0] for name in (*sys.modules, *PRELOAD, "ftcore", "ftcore_plugins", "sitecustomize",
                                                  "usercustomize")}
    for folder in extra:
        with contextlib.suppress(OSError):
            if any(Path(name).stem in loaded for name in os.listdir(folder)):
                return None
    return extra


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
    _AT_START.update(env=environment, imported=dict(os.environ), path=list(sys.path), filters=list(warnings.filters))
    # The imports' objects live as long as the server: out of the collector's sight, a child's gc.collect()
    # (ftcore calls it between stages) skips them instead of walking, and copying, the whole heap.
    gc.freeze()
    sys.stdout.flush()
    sys.stderr.flush()
    proto_out.write(f"ready {json.dumps(_AT_START['imported'])}\n")
    proto_out.flush()
    for line in proto_in:
        pid = fork_job(json.loads(line), close=proto_out)
        proto_out.write(f"{pid}\n")
        proto_out.flush()
        _, status = os.waitpid(pid, 0)
        proto_out.write(f"{os.waitstatus_to_exitcode(status)}\n")
        proto_out.flush()


def fork_job(job: dict, close=None) -> int:
    """Fork a child that runs ``job`` and exits; return its pid. ``job``: ``args``, ``script`` (else
    ``ftcore``), ``cwd``, ``env``; ``in``, ``out`` and ``err``, each a file to open, a descriptor to copy or
    None to keep this process's (``in`` defaults to /dev/null); ``close``, descriptors the child must not
    hold; ``new_session``."""
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
    import logging
    import runpy
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
    _AT_START["job_env"] = dict(job["env"])  # what the command started with (its own changes come after)
    if job.get("new_session"):
        os.setsid()
    # Descriptors are copied before any is replaced: "stderr to the caller's stdout" means the old fd 1.
    streams = {fd: os.dup(target) if isinstance(target, int) else target
               for fd, target in ((0, job.get("in", os.devnull)), (1, job["out"]), (2, job["err"]))}
    for fd in job.get("close", ()):
        if fd != -1:
            os.close(fd)  # the parent's ends of the pipes: the child holding them would hide their EOF
    for fd, target in streams.items():
        if isinstance(target, str):
            target = os.open(target, os.O_RDONLY if fd == 0 else os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        if target is not None:
            os.dup2(target, fd)
            os.close(target)
    sys.stdin = open(0, closefd=False)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    warnings.filters[:] = _AT_START["filters"]
    warnings._filters_mutated()
    if job["env"].get("PYTHONWARNINGS") == "ignore":
        warnings.simplefilter("ignore")
    if any(job["env"].get(k) == "1" for k in OFFLINE) and "huggingface_hub.constants" in sys.modules:
        sys.modules["huggingface_hub.constants"].HF_HUB_OFFLINE = True
    sys.path[:] = _AT_START["path"]
    sys.path[1:1] = added_path(job["env"], _AT_START["env"]) or []  # where a new process puts PYTHONPATH
    importlib.invalidate_caches()
    subprocess.Popen = ForkingPopen  # the command's own `python -m ftcore ...` and scripts fork from here too
    code = 1
    try:
        if job.get("code"):  # `python -c CODE ARGS`: llama.cpp's converter, with its own gguf and conversion
            for name in [m for m in sys.modules if m.partition(".")[0] in OWN_MODULES]:
                del sys.modules[name]
            logging.root.handlers.clear()  # as a new process has none: the converter's basicConfig takes effect
            logging.root.setLevel(logging.WARNING)
            sys.argv = ["-c", *job["args"]]
            sys.path[0] = ""
            main = sys.modules["__main__"] = types.ModuleType("__main__")
            main.__builtins__ = builtins
            exec(compile(job["code"], "<string>", "exec"), main.__dict__)
        elif job.get("script"):
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


class ForkingPopen(subprocess.Popen):
    """``subprocess.Popen`` (so ``subprocess.run`` too) in a forked command: ``[sys.executable, -m, ftcore,
    heavy command ...]`` and ``[sys.executable, script.py, ...]`` (a benchmark's arms, runs and runs it
    kills) start as a fork of this process, which imported the libraries already, instead of an exec. The
    child is this object's real child, with the pipes, signals and waits of an exec'd one; any other
    command, or one from a process running other threads, is exec'd as usual."""

    def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
                       creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite,
                       restore_signals, gid, gids, uid, umask, start_new_session, process_group):
        job = None
        if not (shell or executable or preexec_fn or pass_fds or gid is not None or gids or uid is not None
                or umask >= 0 or process_group not in (None, -1)):
            job = _fork_job(args, cwd, env)
        if job is None:
            return super()._execute_child(args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
                                          creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread,
                                          errwrite, restore_signals, gid, gids, uid, umask, start_new_session,
                                          process_group)
        # What the child's standard streams become (-1: this process's), as an exec'd child's would.
        job.update({"in": p2cread if p2cread != -1 else None, "out": c2pwrite if c2pwrite != -1 else None,
                    "err": errwrite if errwrite != -1 else None, "close": [p2cwrite, c2pread, errread],
                    "new_session": start_new_session})
        self.pid = fork_job(job)
        self._child_created = True
        self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)


def _fork_job(args, cwd, env) -> dict | None:
    if isinstance(args, (str, bytes)):
        return None
    # A fork copies no thread but the caller's, nor what the others were doing: only threads asleep but for a
    # moment now and then may be running.
    if any(t is not threading.main_thread() and not t.name.endswith(IDLE_THREADS) for t in threading.enumerate()):
        return None
    argv = [os.fsdecode(a) for a in args]
    if len(argv) < 2 or argv[0] != sys.executable:
        return None
    env = dict(os.environ if env is None else {os.fsdecode(k): os.fsdecode(v) for k, v in env.items()})
    cwd = os.path.abspath(os.fsdecode(cwd) if cwd is not None else os.getcwd())
    applied = {k: v for k, v in os.environ.items() if _AT_START.get("job_env", {}).get(k) != v}
    if not os.path.isdir(cwd) or not same_imports(env, _AT_START["env"], _AT_START["imported"], applied):
        return None
    if argv[1:3] == ["-m", "ftcore"] and heavy(argv[3:]):
        return {"args": argv[3:], "script": None, "cwd": cwd, "env": env}
    if argv[1] == "-c" and len(argv) > 2 and CONVERTER in argv[2]:
        return {"args": argv[3:], "code": argv[2], "cwd": cwd, "env": env}
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
        ready, _, imported = self.proc.stdout.readline().partition(" ")
        self.ready, self.imported = ready.strip() == "ready", json.loads(imported or "{}")
        self.lock = threading.Lock()
        self.count = 0

    def takes(self, args: tuple[str, ...], env: dict[str, str], script: Path | None = None) -> bool:
        """Whether the command can run as a fork: a heavy ``ftcore`` command (or a ``script``), with the
        server's import-time environment (``PYTHONWARNINGS=ignore`` the child applies itself)."""
        if not self.ready or self.proc.poll() is not None:
            return False
        return (script is not None or heavy(args)) and same_imports(env, self.env, self.imported)

    def run(self, args: tuple[str, ...], cwd: Path | None, env: dict[str, str], timeout: float,
            script: Path | None = None) -> subprocess.CompletedProcess | None:
        """``ftcore ARGS``, or ``python SCRIPT ARGS``, in a fork, to its end; None where the server is running
        another command (one the test started and has not waited for)."""
        proc = self.start(args, cwd, env, script=script)
        if proc is None:
            return None
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            raise subprocess.TimeoutExpired(proc.args, timeout, out, err) from None
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def start(self, args: tuple[str, ...], cwd: Path | None, env: dict[str, str], script: Path | None = None,
              stdout=subprocess.PIPE, stderr=subprocess.PIPE) -> ForkedProcess | None:
        """Start ``ftcore ARGS``, or ``python SCRIPT ARGS``, in a fork without waiting for it (to signal or kill
        it); None where the server is running another command. Each stream: PIPE, DEVNULL or a file (a path)."""
        if not self.lock.acquire(blocking=False):
            return None
        try:
            self.count += 1
            job = {"args": list(args), "cwd": str(cwd or os.getcwd()), "env": env, "script": str(script) if script else None}
            files = {}
            for key, target in (("out", stdout), ("err", stderr)):
                if target == subprocess.PIPE:
                    files[key] = self.folder / f"{self.count}.{key}"
                job[key] = str(files[key]) if key in files else os.devnull if target == subprocess.DEVNULL \
                    else os.fspath(target)
            self.proc.stdin.write(json.dumps(job) + "\n")
            self.proc.stdin.flush()
            pid = int(self.proc.stdout.readline())
        except BaseException:
            self.lock.release()
            raise
        command = [sys.executable, *([str(script)] if script else ["-m", "ftcore"]), *args]
        return ForkedProcess(self, command, pid, files)

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


class ForkedProcess:
    """What the tests use of ``subprocess.Popen(..., text=True)`` for a command the server forked: ``pid``,
    ``returncode``, ``poll``, ``wait``, ``communicate``, ``send_signal``, ``terminate``, ``kill``. The server
    waits for the child (it is the server's) and reports its exit status."""

    def __init__(self, server: ForkServer, args: list[str], pid: int, files: dict[str, Path]):
        self.args, self.pid, self.returncode = args, pid, None
        self._files, self._output = files, None
        self._done = threading.Event()
        threading.Thread(target=self._await, args=(server,), daemon=True).start()

    def _await(self, server: ForkServer) -> None:
        try:
            line = server.proc.stdout.readline()
            self.returncode = int(line) if line.strip() else -9  # the server itself died
        finally:
            server.lock.release()
            self._done.set()

    def poll(self) -> int | None:
        return self.returncode if self._done.is_set() else None

    def wait(self, timeout: float | None = None) -> int:
        if not self._done.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def communicate(self, input=None, timeout: float | None = None) -> tuple[str | None, str | None]:
        self.wait(timeout)
        if self._output is None:
            self._output = {key: _read(path) for key, path in self._files.items()}
            for path in self._files.values():
                path.unlink(missing_ok=True)
        return self._output.get("out"), self._output.get("err")

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):  # ended (and reaped) since
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __enter__(self) -> ForkedProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.communicate()


def with_cli_defaults(env: dict[str, str]) -> dict[str, str]:
    """``env`` as ``ftcore``'s ``main`` leaves it before torch loads (ftcore/cli.py)."""
    return {"OMP_WAIT_POLICY": "PASSIVE", **env}


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace") if path.exists() else ""
