"""Shared helpers: tiny offline plans and a CLI runner."""

from __future__ import annotations

import contextlib
import fcntl
import importlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from _forkserver import ForkServer, heavy

# The tiny data the plugin authors' kit generates is the suite's too.
from ftcore.testing import ANIMALS, OTHERS, chat_rows, text_rows, write_jsonl  # noqa: F401

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared" / "fixtures"


# The suite runs in two pytest-xdist workers (the README's command). Each worker, and the ftcore processes
# it starts, gets one thread: two workers of two threads each on 2 cores would fight over them.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

# Tests that must not run beside each other: torchrun's fixed rendezvous port. Each group runs in one worker;
# every other test goes wherever a worker is free. (xdist's own `xdist_group` marks do not reach its scheduler
# under pytest 9.2, so the scheduling is ours.)
_SERIAL_GROUPS = {"test_distributed.py": "torchrun", "test_sequence_parallel.py": "torchrun"}

try:
    from xdist.scheduler import LoadScopeScheduling
except ImportError:  # without pytest-xdist the suite runs in one process, in order
    LoadScopeScheduling = None

if LoadScopeScheduling is not None:
    class _SerialGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _SERIAL_GROUPS.get(nodeid.split("::")[0].rpartition("/")[2], nodeid)

    def pytest_xdist_make_scheduler(config, log):
        return _SerialGroups(config, log) if config.getvalue("dist") == "load" else None


@pytest.fixture(autouse=True, scope="session")
def _isolated_cache(tmp_path_factory):
    """Tests (and the CLI runs they start) use a cache of their own, never the user's."""
    os.environ["FTCORE_CACHE_DIR"] = str(tmp_path_factory.mktemp("ftcore-cache"))
    os.environ["HF_DATASETS_CACHE"] = str(tmp_path_factory.mktemp("hf-datasets-cache"))
    _SESSION_ENV.update(os.environ)
    yield


_SESSION_ENV: dict = {}  # the environment every test starts from (and the fork servers import in)


@pytest.fixture(autouse=True)
def _environment_kept():
    """What a test changes in the environment ends with it. A command run in-process leaves variables set
    (ftcore quiets the libraries through them, for the rest of the process, as a user's command should): the
    next test starts without them, and its commands keep matching the environment its worker's fork server
    imported in, instead of running as subprocesses for the rest of the session."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


_FORK_SERVER: list = []  # this worker's (tests/_forkserver.py), started by the first heavy command


def fork_server() -> ForkServer | None:
    """This worker's fork server (started on first use), or None where FTCORE_TEST_FORKSERVER=0."""
    if os.environ.get("FTCORE_TEST_FORKSERVER", "1") == "0":
        return None
    if not _FORK_SERVER:
        _FORK_SERVER.append(ForkServer(dict(_SESSION_ENV or os.environ)))  # not a test's own changes
    return _FORK_SERVER[0]


def forked(how: str, args: tuple[str, ...], env: dict, script: Path | None = None, **kw):
    """``ForkServer.run`` or ``.start`` (``how``) of the command where this worker's fork server takes it;
    None where it does not (the caller starts a subprocess). No server is started for a light command."""
    if script is None and not heavy(args):
        return None
    server = fork_server()
    if server is None or not server.takes(args, env, script=script):
        return None
    return getattr(server, how)(args, env=env, script=script, **kw)


def run_script(script: Path, *args: str, env: dict | None = None, timeout: int = 600):
    """``python SCRIPT ARGS`` (a benchmark) in a process of its own: a fork of the fork server where the
    environment allows, else a plain subprocess."""
    full_env = {**os.environ, **(env or {})}
    done = forked("run", args, full_env, script=script, cwd=None, timeout=timeout)
    if done is not None:
        return done
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=timeout,
                          env=full_env)


def run_cli(*args: str, cwd: Path | None = None, env: dict | None = None, timeout: int = 3600):
    """Run ``python -m ftcore ARGS`` in a process of its own, as a user would: a fork of this worker's
    fork server where the command imports the training stack anyway, else a plain subprocess. The timeout
    only catches a hang: on a shared 2-core machine a run can take many times its idle time."""
    full_env = {**os.environ, **(env or {})}
    done = forked("run", args, full_env, cwd=cwd, timeout=timeout)
    if done is not None:
        return done
    return subprocess.run([sys.executable, "-m", "ftcore", *args], cwd=cwd, env=full_env,
                          capture_output=True, text=True, timeout=timeout)


def run_kit(*args, cwd: Path | None = None, env: dict | None = None):
    """``ftcore.testing.run_ftcore(*args)``'s :class:`~ftcore.testing.RunResult` (losses, metrics), the
    command run as ``run_cli`` runs it: a fork where it can."""
    from ftcore.testing import RunResult, _run_dir

    args = tuple(str(a) for a in args)
    done = run_cli(*args, cwd=cwd, env=env)
    return RunResult(done.returncode, done.stdout, done.stderr, _run_dir(args, cwd))


def start_script(script: Path, *args: str, env: dict | None = None, stdout: Path | None = None,
                 stderr: Path | None = None):
    """Start ``python SCRIPT ARGS`` (a benchmark) without waiting, as ``run_script`` runs it; its output to
    the files ``stdout`` and ``stderr`` (else nowhere). A fork while the server is free, else a Popen."""
    full_env = {**os.environ, **(env or {})}
    streams = [subprocess.DEVNULL if s is None else s for s in (stdout, stderr)]
    proc = forked("start", args, full_env, script=script, cwd=None, stdout=streams[0], stderr=streams[1])
    if proc is not None:
        return proc
    files = [s if s == subprocess.DEVNULL else open(s, "w") for s in streams]  # noqa: SIM115 - the child's now
    try:
        return subprocess.Popen([sys.executable, str(script), *args], env=full_env, stdout=files[0], stderr=files[1])
    finally:
        for f in files:
            if f != subprocess.DEVNULL:
                f.close()


def start_cli(*args: str, cwd: Path | None = None, env: dict | None = None, stdout=subprocess.PIPE,
              stderr=subprocess.PIPE):
    """Start ``python -m ftcore ARGS`` without waiting (to signal or kill it), as ``run_cli`` runs it: a fork
    while this worker's fork server is free, else a ``subprocess.Popen`` (text). Either has ``pid``, ``poll``,
    ``wait``, ``communicate``, ``send_signal`` and ``returncode``."""
    full_env = {**os.environ, **(env or {})}
    proc = forked("start", args, full_env, cwd=cwd, stdout=stdout, stderr=stderr)
    if proc is not None:
        return proc
    return subprocess.Popen([sys.executable, "-m", "ftcore", *args], cwd=cwd, env=full_env, stdout=stdout,
                            stderr=stderr, text=True)


@pytest.fixture
def qwen25_tiny_model(tmp_path):
    """A 1-layer Qwen2 with the real Qwen2.5 tokenizer (and its native template), saved as a HF folder."""
    folder = SHARED / "tokenizers" / "qwen25"
    if not folder.exists():
        pytest.skip("../shared/fixtures/tokenizers/qwen25 not present")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    config = AutoConfig.for_model("qwen2", vocab_size=len(tok), hidden_size=32, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=1, intermediate_size=64,
                                  max_position_embeddings=256, tie_word_embeddings=True,
                                  eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    out = tmp_path / "base-model"
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


SPECIALS = ["<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """A random-init Llama saved with a byte-level BPE tokenizer trained here on the tests' own
    rows (nothing downloaded, no shared fixture needed): what ``[model] use = "hf"`` loads."""
    torch = pytest.importorskip("torch")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    texts = [m["content"] for row in chat_rows(200) for m in row["messages"]]
    texts += [row["text"] for row in text_rows(50)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIALS, show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>",
                                        additional_special_tokens=SPECIALS[2:])
    config = AutoConfig.for_model("llama", vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                                  max_position_embeddings=128, tie_word_embeddings=False,
                                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    out = tmp_path_factory.mktemp("tiny-llama") / "base"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture
def tiny_project(tmp_path: Path):
    """A folder with tiny text and chat data, and a function that writes a plan there."""
    write_jsonl(tmp_path / "text.jsonl", text_rows(64))
    write_jsonl(tmp_path / "chat.jsonl", chat_rows(64))
    write_jsonl(tmp_path / "chat_eval.jsonl", chat_rows(16, seed=1))

    def plan(body: str, name: str = "plan.toml") -> Path:
        path = tmp_path / name
        path.write_text(TINY_HEADER + body, encoding="utf-8")
        return path

    plan.dir = tmp_path
    return plan


TINY_HEADER = """
[run]
name = "tiny"
seed = 7

[model]
use = "scratch"
hidden_size = 32
num_layers = 1
num_heads = 2
intermediate_size = 64
max_position_embeddings = 128
tokenizer_data = ["text", "chat"]
vocab_size = 300

[template]
use = "chatml"

[data.text]
use = "jsonl"
path = "text.jsonl"

[data.chat]
use = "jsonl"
path = "chat.jsonl"

[data.chat_eval]
use = "jsonl"
path = "chat_eval.jsonl"
"""


# -- installing an example plugin package for real ----------------------------------------------------

def _pip(*args: str) -> None:
    r = subprocess.run([sys.executable, "-m", "pip", *args, "--no-deps", "--no-build-isolation",
                        "--disable-pip-version-check", "-q"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr


INSTALLED_SITES: list[str] = []  # what `installed` put on PYTHONPATH, for helpers that build a command's environment


@contextlib.contextmanager
def installed(folder: Path, dist: str, tmp_path: Path):
    """Install an example plugin package for real (a non-editable pip install of a copy, so the build leaves
    nothing in the repository) into a folder of its own, put first on this process's ``sys.path`` and on the
    ``PYTHONPATH`` of the commands it starts, as long as the block lasts. Not into the shared environment: the
    other worker's commands, started while pip was half done, warned that the package failed to import."""
    source, site = tmp_path / "pkg", tmp_path / "site"
    shutil.copytree(folder, source, ignore=shutil.ignore_patterns("runs", "build", "*.egg-info", "__pycache__"))
    _pip("install", "--target", str(site), str(source))
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(site), *([saved] if saved else [])])
    sys.path.insert(0, str(site))
    INSTALLED_SITES.insert(0, str(site))
    importlib.invalidate_caches()
    assert Path(importlib.metadata.distribution(dist).locate_file("")) == site  # what the commands will find
    try:
        yield
    finally:
        INSTALLED_SITES.remove(str(site))
        sys.path.remove(str(site))
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved
        for name in [m for m, mod in sys.modules.items() if str(getattr(mod, "__file__", "")).startswith(str(site))]:
            del sys.modules[name]
        importlib.invalidate_caches()


def computed_once(tmp_path_factory, name: str, compute):
    """``compute()``'s result (JSON), computed once per test session. Under pytest-xdist a module fixture
    runs in every worker that gets one of its tests; through this the first worker to ask computes it and
    the others wait for it (a lock) and read it, as they share the quickstart run below."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the session's folder, above each worker's own (new for every session)
    path = root / f"{name}.json"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file is closed
        if not path.exists():
            path.write_text(json.dumps(compute()))
        return json.loads(path.read_text())


@pytest.fixture(scope="session")
def quickstart_run(tmp_path_factory):
    """The quickstart, run once per session in a copy of examples/quickstart; its run folder, which tests
    only read (copy it to change it). Under pytest-xdist the workers share it: the first worker to ask
    runs it in the session's temporary folder, the others wait for it (a lock) and read the same run."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the session's folder, above each worker's own (new for every session)
    shared = root / "quickstart-run"
    with open(root / "quickstart-run.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file is closed
        outcome = shared / "outcome.json"
        if not outcome.exists():
            shutil.rmtree(shared, ignore_errors=True)
            project = shared / "quickstart"
            shutil.copytree(ROOT / "examples" / "quickstart", project, ignore=shutil.ignore_patterns("runs"))
            # Two threads, as a user's run on this 2-core machine: the training trajectory depends on the thread
            # count (at one, seed 42 answers fox and dog as "the mouse"), and the tests read the answers a user gets.
            result = run_cli("run", str(project / "plan.toml"), timeout=3600,  # ~2 min idle, 10 on a busy machine
                             env={"OMP_NUM_THREADS": "2"})
            outcome.write_text(json.dumps({"returncode": result.returncode, "stderr": result.stderr[-3000:]}))
        done = json.loads(outcome.read_text())
    assert done["returncode"] == 0, done["stderr"]
    return shared / "quickstart" / "runs" / "quickstart"


# -- the working tree stays as it was -------------------------------------------------------------------
# Every test writes under tmp_path or a run folder. The controlling process compares the repository's
# untracked and ignored files before and after the session, so a test, example or benchmark that leaves a
# file beside the code (an ./mlflow.db from MLflow's default store, say) fails the suite, naming it.

def _tree_files() -> set[str] | None:
    if not (ROOT / ".git").exists():
        return None  # not a git checkout (an sdist): nothing to compare
    out = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all", "--ignored"], cwd=ROOT,
                         capture_output=True, text=True).stdout
    paths = {line[3:] for line in out.splitlines() if line[:2] in ("??", "!!")}
    return {p for p in paths if "__pycache__" not in p and ".egg-info/" not in p
            and not p.startswith((".venv/", ".pytest_cache/", ".ci/venv/"))}


def pytest_sessionstart(session):
    if not hasattr(session.config, "workerinput"):  # the controller, or a run without xdist
        session.config._ftcore_tree = _tree_files()


def pytest_sessionfinish(session, exitstatus):
    for server in _FORK_SERVER:
        server.close()
    before = getattr(session.config, "_ftcore_tree", None)
    after = _tree_files() if before is not None else None
    left = sorted(after - before) if after is not None else []
    if left:
        sys.stderr.write("\nthe suite left files in the working tree: " + ", ".join(left[:20]) + "\n")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def one_line_refusal(result) -> str:
    """The one line a refused command printed (exit 2, no traceback)."""
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]
