"""What the training benchmarks share: per-step wall times and token counts recorded inside the
Trainer (the same instrument in every arm), ftcore runs in-process, and the machine they ran on."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared" / "fixtures"


# A tiny scratch Llama (2 layers) with a BPE tokenizer trained on the data, and the data: the head
# of the plans of packing.py and padding_free.py (``{source}`` names the data; a stage follows).
SCRATCH_PLAN = """
[run]
name = "{name}"
seed = 7
output_dir = "runs"

[model]
use = "scratch"
hidden_size = {hidden}
num_layers = {layers}
num_heads = 4
intermediate_size = {intermediate}
max_position_embeddings = {max_length}
tokenizer_data = ["{source}"]
vocab_size = 4096

[data.{source}]
use = "json"
path = "{data}"
limit = {rows}

[template]
use = "chatml"
"""


def __getattr__(name: str) -> Any:
    """``StepRecorder``, a transformers ``TrainerCallback``, made on first use: importing transformers takes
    seconds (10 s on a busy machine), which the benchmarks that only need ``machine()`` or ``rss_anon()``
    (and each of their per-arm processes) do not pay."""
    if name == "StepRecorder":
        from transformers import TrainerCallback

        cls = type("StepRecorder", (_StepRecording, TrainerCallback),
                   {"__doc__": _StepRecording.__doc__, "__module__": __name__})
        globals()["StepRecorder"] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _StepRecording:
    """Installed into ``transformers.trainer.DEFAULT_CALLBACKS``, so every Trainer built afterwards,
    ftcore's or a raw TRL one, carries it as its first callback. Per step: the time of
    ``on_step_begin`` (a step's time is the gap to the next one: forward, backward, optimizer and
    every callback and log of that step, and loading the next batch) and the tokens the model's
    forward saw (``real``: not padding by the attention mask; ``total``: every position; ``trained``:
    the positions with a label, those the loss scores)."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.begins: list[float] = []
        self.real: list[int] = []
        self.total: list[int] = []
        self.trained: list[int] = []
        self.losses: dict[int, float] = {}
        self.end: float | None = None
        self._hook = None

    def on_train_begin(self, args, state, control, model=None, **kw):
        self.reset()
        self._hook = model.register_forward_pre_hook(self._count, with_kwargs=True)

    def _count(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        mask = kwargs.get("attention_mask")
        if ids is None or not self.real:
            return
        self.total[-1] += ids.numel()
        self.real[-1] += real_positions(ids, mask)
        labels = kwargs.get("labels")
        if labels is not None:
            self.trained[-1] += int((labels != -100).sum())

    def on_step_begin(self, args, state, control, **kw):
        self.begins.append(time.perf_counter())
        self.real.append(0)
        self.total.append(0)
        self.trained.append(0)

    def on_log(self, args, state, control, logs=None, **kw):
        if logs and "loss" in logs:
            self.losses[state.global_step] = float(logs["loss"])

    def on_train_end(self, args, state, control, **kw):
        self.end = time.perf_counter()
        if self._hook is not None:
            self._hook.remove()

    def step_seconds(self, skip: int = 0) -> list[float]:
        """Each step's time after the first ``skip`` (warm-up); the last step, whose end is the save
        and teardown, is not timed."""
        return [b - a for a, b in zip(self.begins[skip:], self.begins[skip + 1:])]

    def install(self) -> StepRecorder:  # noqa: F821 (made by __getattr__)
        import transformers.trainer

        defaults = transformers.trainer.DEFAULT_CALLBACKS
        defaults[:] = [c for c in defaults if not isinstance(c, _StepRecording)] + [self]  # one recorder at a time
        return self


def real_positions(ids: Any, mask: Any) -> int:
    """The positions of a batch that are not padding: by a 2D mask (0 is padding; packed masks that
    number the samples 1, 2, ... count once each), by a 4D mask (a query row that may attend to
    something; additive masks allow with 0), or every position of a padding-free batch."""
    import torch

    if mask is None:
        return ids.numel()
    if mask.dim() == 4:
        allowed = mask if mask.dtype == torch.bool else mask == 0
        return int(allowed[:, 0].any(-1).sum())
    return int((mask != 0).sum())


def run_ftcore(plan_path: Path) -> dict[str, Any]:
    """``ftcore run PLAN`` in this process (the CLI's own path: plugin manager, plan, Runner), with the
    console drawn as on a terminal into /dev/null, so the progress bar costs what it costs a user."""
    from rich.console import Console

    from ftcore.plan import load_plan
    from ftcore.plugins import get_plugin_manager
    from ftcore.runner import Runner

    pm = get_plugin_manager()
    plan = load_plan(str(plan_path), pm.registry())
    with open(os.devnull, "w") as sink, quiet():
        return Runner(plan, pm, Console(file=sink, force_terminal=True, width=120)).run()


# One sft stage of the ``hf`` loader on a saved model and chat rows: the plan of the GPU benchmarks' ftcore
# arms (gpu_throughput.py, gpu_smoke.py); ``{stage_extra}`` adds the arm's options.
HF_SFT_PLAN = """
[run]
name = "{name}"
seed = 7
output_dir = "runs"

[model]
use = "hf"
path = "{model}"
dtype = "{dtype}"
{model_extra}

{quantizer}

[template]
use = "chatml"

[data.rows]
use = "jsonl"
path = "{rows}"

[[stage]]
name = "sft"
trainer = "sft"
data = "rows"
adapter = {adapter}
max_steps = {max_steps}
batch_size = {batch_size}
max_length = {max_length}
learning_rate = {learning_rate}
logging_steps = 1
save_steps = 1000000
packing = {packing}
{stage_extra}
"""


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def in_child(work: Callable[[], dict], out: Path, limit: float | None, started: Callable[[int], None], *,
             limit_name: str = "its time limit") -> tuple[dict, int, float]:
    """``work()`` in a forked child process, which writes the dict it returns (or ``{"error": ...}``, the
    exception it raised) to ``out`` as JSON and exits; killed after ``limit`` seconds (``limit_name`` says
    what that limit is, in the error). ``started(pid)`` is called once it runs. Returns (result, pid,
    seconds from the fork to its exit); the result is ``{"error": ...}`` too where the child crashed, was
    killed, or timed out. The GPU benchmarks run each arm so: no patch (Liger's), compiled graph or CUDA
    memory of one arm reaches the next. A child still running when this process dies is killed with it
    (``PR_SET_PDEATHSIG``)."""
    import gc
    import signal
    import sys

    import torch

    # CUDA is only ever touched in the children: a fork of a process that has initialised it cannot use it.
    assert not torch.cuda.is_initialized(), "CUDA was initialised in the benchmark's own process"
    out.unlink(missing_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()  # else the child would write out what this process had buffered again
    gc.collect()
    gc.freeze()  # the child's collections then leave this process's objects be: no copy of the whole heap
    parent, begin = os.getpid(), time.monotonic()
    pid = os.fork()
    if pid == 0:
        _child(work, out, parent)
    gc.unfreeze()
    try:
        started(pid)
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if limit is not None and time.monotonic() - begin > limit:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                seconds = time.monotonic() - begin
                return {"error": f"timed out after {seconds:.0f} s (killed at {limit_name})"}, pid, seconds
            time.sleep(0.05)
    except BaseException:  # Ctrl-C, or the parent's own failure: the child does not outlive it
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        raise
    seconds, code = time.monotonic() - begin, os.waitstatus_to_exitcode(status)
    if code == 0 and out.exists():
        return json.loads(out.read_text()), pid, seconds
    if code < 0:
        why = f"was killed by {signal.Signals(-code).name}" + \
            (" (the kernel's OOM killer?)" if -code == signal.SIGKILL else "")
    else:
        why = f"exited with status {code}" + ("" if out.exists() else " before writing its result")
    return {"error": f"its process {pid} {why}"}, pid, seconds


def _child(work: Callable[[], dict], out: Path, parent: int) -> NoReturn:
    """The forked child's whole life: ``work()``, its result written to ``out``, and ``os._exit`` (not
    ``sys.exit``: the atexit handlers, the scratch folder's removal among them, are the parent's)."""
    import ctypes
    import signal
    import sys
    import traceback

    code = 1
    try:
        with contextlib.suppress(AttributeError, OSError):  # Linux: a killed benchmark leaves no child running
            ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() == parent:  # else the parent died before the prctl
            try:
                result = work()
            except BaseException as exc:  # noqa: BLE001 (the child's error, for the parent to record)
                result = {"error": error_text(exc)}
            part = out.with_name(out.name + ".part")
            part.write_text(json.dumps(result))
            part.replace(out)
            code = 0
    except BaseException:  # noqa: BLE001 (the result could not be written: the exit status says so)
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


# What every forked arm imports, imported once in the parent before the first fork (:func:`preload`). On a GPU
# only as far as a probe child finds them to leave CUDA uninitialised (:func:`probe`): bitsandbytes' import
# reads the devices' compute capabilities, which initialises CUDA, and peft imports it, transformers' Trainer
# peft; there each arm imports the rest itself.
PRELOAD = ("datasets", "rich.progress", "matplotlib.pyplot", "scipy.io", "scipy.stats", "deepspeed", "peft",
           "transformers.trainer", "transformers.models.llama.modeling_llama", "trl.trainer.sft_trainer",
           "ftcore.runner", "ftcore_plugins.trainers.sft")


def preload(names: tuple[str, ...]) -> None:
    """The modules every arm imports, imported once, here, before the first fork, so that no arm pays for
    them (those that are not installed left out); what an import prints, as in an arm, not shown."""
    import importlib

    from ftcore.plugins import get_plugin_manager

    get_plugin_manager()  # imports no torch
    for name in names:
        with contextlib.suppress(Exception), quiet():  # an arm that needs a module that failed fails itself
            importlib.import_module(name)


def probe(names: tuple[str, ...]) -> dict:
    """In a child, on a GPU: its name, and how many of ``names``, imported in order, leave CUDA
    uninitialised (``preload``): the parent may import those, not the rest."""
    import importlib

    import torch

    safe = len(names)
    for i, name in enumerate(names):
        with contextlib.suppress(Exception), quiet():
            importlib.import_module(name)
        if torch.cuda.is_initialized():
            safe = i
            break
    return {"device": torch.cuda.get_device_name(), "preload": safe}


def error_text(exc: BaseException) -> str:
    """An exception in one line or a few, at most 600 characters."""
    import traceback

    text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    return text if len(text) <= 600 else text[:600] + " ..."


@contextlib.contextmanager
def quiet():
    """Library prints and progress bars (tqdm writes to stderr) go to /dev/null, in every arm alike."""
    with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        yield


def rss_anon() -> int:
    """This process's anonymous resident memory in bytes (RssAnon of /proc/self/status): its own
    heap, without the memory-mapped files' pages that VmRSS and VmHWM also count."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise SystemExit("no RssAnon in /proc/self/status (Linux only)")


def validate_report(plan: Any) -> str:
    """What ``ftcore validate --data`` prints for ``plan`` (it must pass: a run would go on)."""
    import io

    from ftcore_plugins.data._check import check_plan_data

    out = io.StringIO()
    code = check_plan_data(plan, out)
    assert code == 0, out.getvalue()
    return out.getvalue()


def interleaved_medians(first: Any, second: Any, repeat: int) -> tuple[float, float]:
    """Median seconds of ``first()`` and ``second()``, called in turns ``repeat`` times so that drift on
    the machine hits both alike (warm both up before)."""
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeat):
        for fn, seconds in zip((first, second), times):
            start = time.perf_counter()
            fn()
            seconds.append(time.perf_counter() - start)
    return statistics.median(times[0]), statistics.median(times[1])


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def machine() -> str:
    """CPU model, cores, RAM, load, and the library versions: one line for RESULTS.md."""
    import importlib.metadata as md

    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    ram = ""
    with contextlib.suppress(OSError, ValueError):
        kb = int(Path("/proc/meminfo").read_text().split("MemTotal:")[1].split()[0])
        ram = f", {kb / 2**20:.0f} GiB RAM"
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    versions = ", ".join(f"{d} {md.version(d)}" for d in ("torch", "transformers", "trl", "peft"))
    return f"{cpu}, {os.cpu_count()} cores{ram}; load average {load:.1f} at the end; {versions}"


def print_seed_table(results: list[dict], seeds: list, arms: list, *, arm_key: str, stopped: str) -> None:
    """The per-seed Markdown rows of exact match and stopped answers for each arm (``arm_key`` names the
    arm field of a result; ``stopped`` is the second column's heading after the arm's name)."""
    print("| seed | " + " | ".join(f"{arm} exact match | {arm} {stopped}" for arm in arms) + " |")
    print("|---:|" + "---:|---:|" * len(arms))
    for seed in seeds:
        cells = []
        for arm in arms:
            r = next(r for r in results if r["seed"] == seed and r[arm_key] == arm)
            cells += [f"{r['exact_match']:.2f}", f"{r['stopped']}/{r['answers']}"]
        print(f"| {seed} | " + " | ".join(cells) + " |")
