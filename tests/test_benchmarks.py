"""The benchmark scripts run at tiny sizes, and what they print agrees with what they measured."""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, SHARED, run_cli, run_script, start_script


def bench(script: str, *args: str, timeout: int = 600) -> str:
    r = run_script(ROOT / "benchmarks" / script, *args, timeout=timeout, env={"PYTHONWARNINGS": "ignore"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout


def table_rows(out: str) -> list[list[str]]:
    """The cells of every markdown table row but headers and separators."""
    rows = [[c.strip() for c in line.strip().strip("|").split("|")]
            for line in out.splitlines() if line.startswith("|")]
    return [r for r in rows if not set("".join(r)) <= set("-:") and r[0] not in ("run", "arm", "command")]


def gpu_throughput():
    """benchmarks/gpu_throughput.py as a module (its helpers, without running it)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_throughput", ROOT / "benchmarks" / "gpu_throughput.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_throughput"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def json_lines(path) -> list[dict]:
    """The complete lines of a JSON lines file (a line still being written is left out)."""
    text = path.read_text() if path.exists() else ""
    return [json.loads(line) for line in text.splitlines(keepends=True) if line.endswith("\n")]


def test_gpu_throughput_pairs_budgets_and_bin_padding():
    import torch

    gt = gpu_throughput()
    # Memory is compared at equal work: packed arms against TRL's packing, unpacked ones against the padded baseline.
    assert {gt.reference(a) for a in ("baseline-packed", "ftcore", "ftcore+flex", "ftcore+liger", "ftcore+varlen",
                                      "ftcore+sdpa-block", "ftcore+per-sample")} == {"baseline-packed"}
    assert gt.reference("baseline") == gt.reference("ftcore+unpacked") == "baseline"
    # The work of each architecture, counted as a loaded model is (Llama 3 8B, Llama 3.2 1B; LoRA r=16 on
    # every linear layer of the blocks: the trainable counts peft prints for them).
    assert gt.parameters("8b") == pytest.approx(8.03e9, rel=0.01)
    assert gt.parameters("8b", matmul=True) == pytest.approx(8.03e9 - 128256 * 4096, rel=0.01)
    assert gt.parameters("1b") == gt.parameters("1b", matmul=True) == pytest.approx(1.24e9, rel=0.01)  # tied
    assert gt.trainable_parameters("8b", "qlora") == 41_943_040
    assert gt.trainable_parameters("1b", "lora") == 11_272_192
    assert gt.flops_per_token("1b", "full") == 6 * gt.parameters("1b", matmul=True)

    # Budgets on an H200, nothing measured yet: each arm's from its own size (fixed + load + training).
    runs = {n: gt.Run(n, *gt.RUNS[n], arms=[], work=ROOT) for n in ("1b-lora-2048", "1b-full-2048", "8b-qlora-2048")}
    clock = gt.Clock(None, runs, 11, True, 989e12)
    rate = gt.ASSUMED_MFU * 989e12

    def work(name):  # load and training seconds, at 16k positions a step
        arch, method, max_length, batch = gt.RUNS[name]
        return 2 * gt.parameters(arch) / gt.LOAD_BYTES_PER_S + 11 * batch * max_length * gt.flops_per_token(
            arch, method) / rate

    small, large = clock.arm_budget(runs["1b-lora-2048"]), clock.arm_budget(runs["8b-qlora-2048"])
    assert small[0] == pytest.approx(gt.FIXED_S[True] + work("1b-lora-2048"))
    assert large[0] == pytest.approx(gt.FIXED_S[True] + work("8b-qlora-2048"))
    assert 5 < work("8b-qlora-2048") / work("1b-lora-2048") < 7  # 16 GB to load, 6x the FLOPs
    assert large[0] < 120 and "16.1 GB at 1 GB/s" in large[1] and "35% of 989 TFLOP/s" in large[1]
    assert clock.build_budget("8b")[0] == pytest.approx(gt.BUILD_FIXED_S[True] + 2 * gt.parameters("8b") / 0.5e9)
    # A 1B arm measured at 60 s, mostly loading and JIT: the 8B arm's budget is its own size's plus the 1B arm's
    # residual (what neither loading nor training explains), not 60 s x the parameter ratio (6.5: 390 s).
    clock.arms.append(("1b-lora-2048", "ftcore", {"seconds": 60.0, "train_seconds": 9.0,
                                                  "positions_per_step": [16384] * 11}))
    residual = 60.0 - work("1b-lora-2048")
    assert clock.arm_budget(runs["8b-qlora-2048"])[0] == pytest.approx(residual + work("8b-qlora-2048"))
    assert clock.arm_budget(runs["8b-qlora-2048"])[0] < 100 < 60.0 * gt.parameters("8b") / gt.parameters("1b")
    assert clock.arm_budget(runs["1b-full-2048"])[0] == pytest.approx(residual + work("1b-full-2048"))
    # Once an arm of the same run is measured, the run's slowest arm so far is the budget.
    assert clock.arm_budget(runs["1b-lora-2048"]) == (60.0, "the slowest 1b-lora-2048 arm so far, ftcore")
    clock.builds.append(("1b", 9.0))  # a build's fixed part measured: 9 s less its save
    assert clock.build_budget("8b")[0] == pytest.approx(9.0 - 2 * gt.parameters("1b") / 0.5e9
                                                        + 2 * gt.parameters("8b") / 0.5e9)

    # On a CPU: fp32 weights; the rate is the lowest measured (the same method's first), else CPU_FLOPS.
    tiny = {n: gt.Run(n, *gt.TINY_RUNS[n], arms=[], work=ROOT) for n in ("tiny-lora-128", "tiny4-qlora-128")}
    cpu = gt.Clock(None, tiny, 11, False, 1e9)  # a peak given for MFU is not a CPU's rate
    assert cpu.rate("qlora") == (gt.CPU_FLOPS, "assumed for a CPU")
    cpu.arms.append(("tiny-lora-128", "baseline", {"seconds": 8.0, "train_seconds": 2.0,
                                                   "positions_per_step": [300] * 11}))
    measured = 300 * 11 * gt.flops_per_token("tiny", "lora") / 2.0
    assert cpu.rate("qlora") == (measured, "measured, tiny-lora-128 baseline")
    budget, how = cpu.arm_budget(tiny["tiny4-qlora-128"])
    assert budget == pytest.approx(8.0 - 2.0 - 4 * gt.parameters("tiny") / 1e9 + 4 * gt.parameters("tiny4") / 1e9
                                   + 11 * 4 * 128 * gt.flops_per_token("tiny4", "qlora") / measured)
    assert how.startswith("fixed 6.0 s (measured, tiny-lora-128 baseline) + load")
    # The deadline: work that would end past it is late; without one nothing is, and nothing is killed.
    assert not clock.late(1e9) and clock.left() is None
    clock.deadline = clock.elapsed() + 20
    assert not clock.late(14.0) and clock.late(30.0) and 19 < clock.left() <= 20
    clock.deadline = clock.elapsed() - 1
    assert clock.late(0.0) and clock.left() == 0  # past the deadline, nothing starts
    # Packed bins without a mask (flex, sdpa_block): each row's trailing untrained pad tokens are not real
    # tokens; a trained pad token (an end of text the loss learns) is, and so is a pad token before real ones.
    ids = torch.tensor([[5, 6, 7, 8, 0, 0], [5, 0, 5, 6, 7, 8], [5, 6, 7, 0, 0, 0]])
    labels = torch.tensor([[-100, 6, 7, 8, -100, -100], [-100, -100, -100, 6, 7, 8], [-100, 6, 7, 0, -100, -100]])
    assert gt.bin_padding(ids, labels, pad_token_id=0) == 2 + 0 + 2
    assert gt.bin_padding(ids, labels, pad_token_id=8) == 0


def test_gpu_throughput_children_report_crashes_and_time_limits(tmp_path, monkeypatch):
    """Each piece of work runs in a fork of its own: its result comes back; an exception, an exit, a signal
    or the time limit comes back as its error, and the benchmark's process goes on."""
    import signal

    gt = gpu_throughput()
    seen = []
    result, pid, seconds = gt.in_child(lambda: {"pid": os.getpid(), "parent": os.getppid()}, tmp_path / "a.json",
                                       None, seen.append)
    assert result == {"pid": pid, "parent": os.getpid()} and seen == [pid] and pid != os.getpid() and seconds > 0
    result, pid2, _ = gt.in_child(lambda: 1 / 0, tmp_path / "b.json", None, seen.append)
    assert result == {"error": "ZeroDivisionError: division by zero"} and pid2 not in (pid, os.getpid())
    result, pid, _ = gt.in_child(lambda: os._exit(3), tmp_path / "c.json", None, seen.append)
    assert result == {"error": f"its process {pid} exited with status 3 before writing its result"}
    result, pid, _ = gt.in_child(lambda: os.kill(os.getpid(), signal.SIGKILL), tmp_path / "d.json", None,
                                 seen.append)
    assert result == {"error": f"its process {pid} was killed by SIGKILL (the kernel's OOM killer?)"}
    result, pid, seconds = gt.in_child(lambda: time.sleep(60), tmp_path / "e.json", 0.5, seen.append,
                                       limit_name="the deadline")
    assert result["error"].startswith("timed out after ") and result["error"].endswith(" s (killed at the deadline)")
    assert 0.5 < seconds < 30
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # killed and reaped
    assert len(set(seen)) == 5
    # On a GPU a probe child finds how many of the modules to preload leave CUDA uninitialised (bitsandbytes'
    # import initialises it); the benchmark's process imports those, a missing one skipped.
    import torch

    (tmp_path / "initialises_cuda.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: "initialises_cuda" in sys.modules)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "NVIDIA H200")
    assert gt.probe(("json", "no_such_module", "initialises_cuda", "csv")) == {"device": "NVIDIA H200", "preload": 2}
    sys.modules.pop("initialises_cuda")


def test_gpu_throughput_each_arm_in_its_own_process_and_a_crash_is_its_error(tmp_path, monkeypatch, capsys):
    """The benchmark's loop with the model build and the training stood in for: the build and every arm run in
    processes of their own; an arm whose process dies is written as failed, and the next arms still run."""
    import signal
    from types import SimpleNamespace

    gt = gpu_throughput()

    def build(folder, arch, rows, max_length, dtype):
        gt.tokenizer_for(arch, gt.synthetic_rows(rows, max_length)).save_pretrained(folder)
        return {}

    def train(run, arm, folder, tokenizer, args, dtype, gpu, peak_flops):
        if arm == "ftcore":
            os.kill(os.getpid(), signal.SIGKILL)  # as the kernel's OOM killer would
        steps = [run.batch_size * 64] * args.steps
        return {"tokens_per_s": 100.0, "peak_gib": 0.5, "mfu": None, "train_seconds": 0.1, "losses": [1.0] * 3,
                "tokens_per_step": steps, "positions_per_step": steps, "in_process": os.getpid()}

    monkeypatch.setattr(gt, "build_model", build)
    monkeypatch.setattr(gt, "train_arm", train)
    name, arms = "tiny-lora-128", ["baseline", "ftcore", "baseline-packed", "ftcore+unpacked"]
    (tmp_path / name).mkdir()
    runs = {name: gt.Run(name, *gt.TINY_RUNS[name], arms=arms, work=tmp_path / name)}
    args = SimpleNamespace(scratch=tmp_path, rows=None, steps=3, warmup=0, deadline_s=None)
    lines = gt.Lines(tmp_path / "l.jsonl")
    gt.bench(runs, [(name, a) for a in arms], args, lines, None, False, gt.Clock(None, runs, 3, False, None))
    out = capsys.readouterr().out
    events = json_lines(tmp_path / "l.jsonl")
    assert [e["event"] for e in events if e["event"] != "pair"] == ["build", "prepare", "arm", "arm", "arm", "arm"]
    done = {e["arm"]: e for e in events if e["event"] == "arm"}
    pids = [events[0]["pid"], *(done[a]["pid"] for a in arms)]
    assert len(set(pids)) == len(pids) and os.getpid() not in pids  # each its own process, none this one
    assert done["ftcore"]["error"] == f"its process {done['ftcore']['pid']} was killed by SIGKILL " \
        "(the kernel's OOM killer?)"
    for arm in ("baseline", "baseline-packed", "ftcore+unpacked"):  # measured, after the crash too
        assert done[arm]["in_process"] == done[arm]["pid"] and done[arm]["budget_s"] > 0
        assert f"{name} {arm}: starting (process {done[arm]['pid']}, budget " in out
    assert f"{name} ftcore: failed after " in out and runs[name].results["ftcore"]["pid"] == done["ftcore"]["pid"]
    assert [p["arm"] for p in events if p["event"] == "pair"] == ["ftcore+unpacked"]  # ftcore has none to make


OPTION_ARMS = ["neftune", "adamw-8bit", "loss-full", "unpacked", "sdpa-block", "liger", "flash-attention-2", "varlen"]


@pytest.mark.slow
def test_gpu_throughput_tiny_mode_and_its_option_arms(tmp_path):
    """One tiny run, its three arms and an arm for each option: what the table and the JSON lines say is
    what was measured; each option is an arm of its own, the CUDA-only ones written as skipped, a failing
    one as failed. (The three arms alone were a test of their own, and ran again here.)"""
    import torch

    from ftcore_plugins.trainers.sft import SFTOptions

    steps, warmup = 5, 1
    out = bench("gpu_throughput.py", "--tiny", "--runs", "tiny-lora-128", "--steps", str(steps), "--warmup",
                str(warmup), "--peak-tflops", "0.001", "--options", ",".join(OPTION_ARMS),
                "--json", str(tmp_path / "r.json"), "--jsonl", str(tmp_path / "r.jsonl"))
    measured = json.loads((tmp_path / "r.json").read_text())["tiny-lora-128"]
    rows = table_rows(out)
    labels = [r[1].split(" (")[0] for r in rows]
    assert [r[0] for r in rows] == ["tiny-lora-128"] * 11
    assert labels == ["HF+TRL defaults", "HF+TRL packing=True", "ftcore", "ftcore+neftune", "ftcore+adamw-8bit",
                      "ftcore+loss-full", "ftcore+unpacked", "ftcore+sdpa-block", "ftcore+liger",
                      "ftcore+flash-attention-2", "ftcore+varlen"]
    base, packed, ours = measured["baseline"], measured["baseline-packed"], measured["ftcore"]
    for row, arm in zip(rows, (base, packed, ours)):
        timed = arm["tokens_per_step"][warmup:warmup + arm["timed_steps"]]
        assert arm["timed_steps"] == steps - warmup - 1  # the last step is not timed
        assert arm["timed_tokens"] == sum(timed) > 0
        assert float(row[2]) == pytest.approx(arm["tokens_per_s"], abs=0.5)
        assert float(row[4]) == pytest.approx(arm["peak_gib"], abs=0.005)
        # LoRA r=16 on every linear layer of 2 layers, hidden 64, 2 of 4 heads for k/v (32), MLP 256:
        # r x (in + out) per layer: q, k, v, o, gate, up, down.
        assert arm["n_trainable"] == 2 * 16 * (128 + 96 + 96 + 128 + 320 + 320 + 320)
        flops = 4 * arm["n_matmul"] + 2 * arm["n_trainable"]
        assert arm["mfu"] == pytest.approx(arm["tokens_per_s"] * flops / 1e9, rel=1e-9)
        assert float(row[8].rstrip("%")) == pytest.approx(100 * arm["mfu"], abs=0.05)
        assert len(arm["losses"]) == steps  # a loss per step, for the parity column
        assert 0 < arm["train_seconds"] < arm["seconds"]
    # Tokens/s against HF+TRL defaults; memory against the baseline that saw the same real tokens per step.
    assert rows[0][3] == "1.00" and rows[0][5] == "1.00" and rows[0][6] == "HF+TRL defaults"
    assert float(rows[2][3]) == pytest.approx(ours["tokens_per_s"] / base["tokens_per_s"], abs=0.005)
    assert float(rows[2][5]) == pytest.approx(ours["peak_gib"] / packed["peak_gib"], abs=0.005)
    assert rows[2][6] == "HF+TRL packing=True" and rows[2][7] == "yes"
    # ftcore's packing and TRL's packing=True (bfd) put the same real tokens in every step, padding-free;
    # the baseline pads.
    assert ours["tokens_per_step"] == packed["tokens_per_step"]
    assert ours["tokens_per_step"] == ours["positions_per_step"]
    assert packed["tokens_per_step"] == packed["positions_per_step"]
    assert sum(base["tokens_per_step"]) < sum(base["positions_per_step"])
    # The JSON lines: the start, the build, the data, each arm as it finished (baseline and ftcore before
    # baseline-packed, then the options), and each equal-work pair once both of its arms were measured.
    lines = json_lines(tmp_path / "r.jsonl")
    schedule = ["baseline", "ftcore", "baseline-packed", *(f"ftcore+{o}" for o in OPTION_ARMS)]
    assert [line["event"] for line in lines if line["event"] != "pair"] == \
        ["start", "build", "prepare", *["arm"] * len(schedule), "end"]
    arms = [line for line in lines if line["event"] == "arm"]
    assert [line["arm"] for line in arms] == schedule
    assert [s[:2] for s in lines[0]["schedule"]] == [["tiny-lora-128", a] for a in schedule]
    # The build and each arm that ran, in a process of its own; every arm with its budget.
    pids = [lines[1]["pid"], *(line["pid"] for line in arms if "skipped" not in line)]
    assert len(set(pids)) == len(pids) == 1 + 8 and lines[0]["pid"] not in pids
    assert all(line["budget_s"] > 0 for line in arms)
    for line in arms[:3]:
        assert {k: v for k, v in line.items() if k in measured[line["arm"]] and k != "equal_work"} == \
            {k: v for k, v in measured[line["arm"]].items() if k != "equal_work"}
        assert line["memory_vs"] == ("baseline" if line["arm"] == "baseline" else "baseline-packed")
    # ftcore's pair, written as soon as baseline-packed (its reference, measured after it) was.
    at = lines.index(next(line for line in lines if line["event"] == "arm" and line["arm"] == "baseline-packed"))
    pair = lines[at + 1]
    assert (pair["event"], pair["run"], pair["arm"], pair["reference"], pair["same_tokens_per_step"]) == \
        ("pair", "tiny-lora-128", "ftcore", "baseline-packed", True)
    assert pair["x_memory"] == pytest.approx(ours["peak_gib"] / packed["peak_gib"])
    assert pair["x_tokens_per_s"] == pytest.approx(ours["tokens_per_s"] / base["tokens_per_s"])
    assert [line["t"] for line in lines] == sorted(line["t"] for line in lines)

    # The option arms.
    for arm in ("ftcore+neftune", "ftcore+adamw-8bit", "ftcore+loss-full", "ftcore+unpacked"):
        assert measured[arm]["timed_tokens"] > 0 and len(measured[arm]["losses"]) == steps
    assert measured["ftcore+loss-full"]["chosen"]["loss_kernel"] == "full"
    # The same batches and weights: the loss kernels agree; NEFTune's noise changes the first step's loss.
    assert measured["ftcore+loss-full"]["losses"] == pytest.approx(measured["ftcore"]["losses"], abs=1e-5)
    assert measured["ftcore+neftune"]["losses"][0] != pytest.approx(measured["ftcore"]["losses"][0], abs=1e-6)
    # Packing off: the same rows one per batch row, so fewer real tokens per step than packed bins; its
    # memory is compared with the padded baseline, which saw the same batches.
    unpacked = measured["ftcore+unpacked"]
    assert unpacked["timed_tokens"] < measured["ftcore"]["timed_tokens"]
    assert unpacked["equal_work"]["reference"] == "baseline" and unpacked["equal_work"]["same_tokens_per_step"]
    assert unpacked["tokens_per_step"] == measured["baseline"]["tokens_per_step"]
    assert measured["ftcore+neftune"]["equal_work"]["reference"] == "baseline-packed"
    block = measured["ftcore+sdpa-block"]
    if "packed_attention" in SFTOptions.model_fields:
        # One right-padded row per bin: the padding is not counted, so the real tokens are TRL packing's.
        assert block["chosen"]["packed_attention"] == "sdpa_block"
        assert block["tokens_per_step"] == measured["baseline-packed"]["tokens_per_step"]
        assert block["equal_work"]["same_tokens_per_step"]
        assert block["losses"] == pytest.approx(measured["ftcore"]["losses"], abs=1e-4)
    else:  # the option does not exist yet: the arm is written as failed and the others go on
        assert "packed_attention" in block["error"]
    if not torch.cuda.is_available():
        for arm in ("ftcore+liger", "ftcore+flash-attention-2", "ftcore+varlen"):
            assert measured[arm]["skipped"] == "needs CUDA" and "pid" not in measured[arm]  # never started
        assert "skipped: needs CUDA (unmeasured)" in out
    assert len(arms) == len(labels) and {line["arm"] for line in arms} == set(measured)


@pytest.mark.slow
def test_gpu_throughput_quick_rehearsal_writes_each_arm_as_it_finishes(tmp_path):
    """``--tiny --quick``: the GPU preset's runs, arms and order on tiny models; each arm's line is in the
    file as soon as the arm has finished, while the next ones still run."""
    import importlib.util

    path = tmp_path / "q.jsonl"
    # Two steps, the first timed (the last one never is): each arm's numbers, at the least training.
    proc = start_script(ROOT / "benchmarks" / "gpu_throughput.py", "--tiny", "--quick", "--steps", "2", "--warmup",
                        "0", "--jsonl", str(path), stdout=tmp_path / "out", stderr=tmp_path / "err",
                        env={"PYTHONWARNINGS": "ignore"})
    try:
        give_up = time.monotonic() + 600
        while not any("tokens_per_s" in line for line in json_lines(path)):
            assert proc.poll() is None, (tmp_path / "err").read_text()[-3000:]
            assert time.monotonic() < give_up
            time.sleep(0.1)
        first = json_lines(path)
        assert proc.poll() is None  # the first arm's numbers are written, the other arms still to run
        proc.wait(timeout=1200)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 0, (tmp_path / "err").read_text()[-3000:]
    lines = json_lines(path)
    assert lines[:len(first)] == first and [line["event"] for line in first][-1] == "arm"
    start, arms = lines[0], [line for line in lines if line["event"] == "arm"]
    attention = "flex" if importlib.util.find_spec("flash_attn") else "sdpa-block"  # not the CUDA default
    options = ["ftcore+liger", f"ftcore+{attention}", "ftcore+unpacked"]
    runs = {"tiny-lora-128": options, "tiny-qlora-128": options, "tiny-full-128": options, "tiny4-qlora-128": []}
    # The most important first: baseline and ftcore of every run, then TRL's packing, then the option arms.
    expected = [[r, a] for r in runs for a in ("baseline", "ftcore")] + [[r, "baseline-packed"] for r in runs] + \
        [[r, a] for r, arms_ in runs.items() for a in arms_]
    assert [s[:2] for s in start["schedule"]] == expected and start["deadline_s"] == 450 and start["steps"] == 2
    assert all(s[2] > 0 for s in start["schedule"]) and set(start["build_budgets_s"]) == {"tiny", "tiny4"}
    assert not Path(start["scratch"]).exists()  # removed at exit
    assert [[line["run"], line["arm"]] for line in arms] == expected  # one line per arm, in that order
    assert [line["t"] for line in lines] == sorted(line["t"] for line in lines)
    builds = [line for line in lines if line["event"] == "build"]
    assert [b["arch"] for b in builds] == ["tiny", "tiny4"] and all(b["seconds"] > 0 for b in builds)
    text = (tmp_path / "out").read_text()
    # Each build and each arm in a process of its own, none of them this benchmark's; every arm with its budget.
    pids = [b["pid"] for b in builds] + [line["pid"] for line in arms if "pid" in line]
    assert len(pids) == 2 + 18 and len(set(pids)) == len(pids) and start["pid"] not in pids  # 3 need CUDA
    for line in arms:
        assert line["budget_s"] > 0 and line["budget_from"]
        if line["arm"] in ("ftcore+liger", "ftcore+flex", "ftcore+varlen"):
            assert line["skipped"].startswith("needs")  # CUDA (or flash_attn)
            continue
        assert f"{line['run']} {line['arm']}: starting (process {line['pid']}, budget " in text
        assert line["tokens_per_s"] > 0 and line["peak_gib"] > 0 and line["mfu"] is None  # no peak given on CPU
        assert line["seconds"] > line["train_seconds"] > 0 and line["timed_steps"] == 1
        padded = line["arm"] in ("baseline", "ftcore+unpacked")
        assert line["memory_vs"] == ("baseline" if padded else "baseline-packed")
    # The equal-work pairs: ftcore against TRL's packing in every run, unpacked against the padded baseline.
    pairs = {(p["run"], p["arm"]): p for p in lines if p["event"] == "pair"}
    ftcore_arms = {(line["run"], line["arm"]) for line in arms if line["arm"].startswith("ftcore") and "pid" in line}
    assert set(pairs) == ftcore_arms and {(r, "ftcore") for r in runs} | {(r, "ftcore+unpacked") for r in runs
                                                                          if runs[r]} <= ftcore_arms
    for (run, arm), pair in pairs.items():
        assert pair["reference"] == ("baseline" if arm == "ftcore+unpacked" else "baseline-packed")
        assert pair["same_tokens_per_step"] is True and pair["tokens_per_step_ratio"] == 1.0
        assert pair["x_memory"] > 0 and pair["x_tokens_per_s"] > 0
    assert lines[-1]["event"] == "end"
    assert len(table_rows(text)) == len(expected)
    assert "MFU n/a on CPU unless --peak-tflops is given" in text


@pytest.mark.slow
def test_gpu_throughput_deadline_and_a_killed_run(tmp_path):
    """Past the deadline no arm starts (each written as skipped, with its budget and why); a killed run keeps
    the lines it wrote, and its arm's process dies with it."""
    out = bench("gpu_throughput.py", "--tiny", "--quick", "--deadline-s", "0", "--jsonl", str(tmp_path / "d.jsonl"))
    lines = json_lines(tmp_path / "d.jsonl")
    arms = [line for line in lines if line["event"] == "arm"]
    assert len(arms) == len(lines[0]["schedule"]) == 21 and not any(line["event"] == "build" for line in lines)
    for line in arms:
        cuda = line["arm"] in ("ftcore+liger", "ftcore+flex", "ftcore+varlen")
        assert line["skipped"].startswith("needs" if cuda else "deadline: "), line
        assert "pid" not in line and line["budget_s"] > 0  # none started
        if not cuda:
            assert line["estimate_s"] >= line["budget_s"] and line["estimate_from"].startswith("fixed ")
    assert "starting" not in out and "building" not in out
    assert all("(unmeasured)" in row[2] for row in table_rows(out))

    path, out = tmp_path / "k.jsonl", tmp_path / "k.out"
    proc = start_script(ROOT / "benchmarks" / "gpu_throughput.py", "--tiny", "--runs", "tiny-lora-128", "--steps",
                        "2", "--warmup", "0", "--jsonl", str(path), stdout=out)
    try:  # killed once the first arm is written and the next one has started
        give_up = time.monotonic() + 600
        while not (started := re.search(r"ftcore: starting \(process (\d+)", out.read_text() if out.exists() else "")) \
                and proc.poll() is None and time.monotonic() < give_up:
            time.sleep(0.05)
    finally:
        proc.kill()
        proc.wait()
    assert started, out.read_text()
    text = path.read_text()
    assert text.endswith("\n")
    lines = [json.loads(line) for line in text.splitlines()]  # every line whole
    assert [line["event"] for line in lines][:4] == ["start", "build", "prepare", "arm"]
    assert lines[3]["arm"] == "baseline" and lines[3]["tokens_per_s"] > 0 and lines[-1]["event"] != "end"
    scratch = Path(lines[0]["scratch"])  # killed: its models stay, where the start line says
    assert (scratch / "tiny-lora-128").is_dir()
    # The running arm's process dies with the benchmark's (the kernel kills it: PR_SET_PDEATHSIG).
    stat, give_up = Path(f"/proc/{started[1]}/stat"), time.monotonic() + 60

    def alive() -> bool:  # a zombie (Z) or a dead one (X) is gone
        try:
            return stat.read_text().rsplit(")", 1)[-1].split()[0] not in "ZX"
        except FileNotFoundError:
            return False

    while alive():
        assert time.monotonic() < give_up
        time.sleep(0.1)
    shutil.rmtree(scratch)


@pytest.mark.slow
@pytest.mark.slow
@pytest.mark.skipif(not (SHARED / "tokenizers" / "llama3").exists(), reason="needs ../shared's Llama 3 tokenizer")
def test_gpu_smoke_tiny_mode_runs_what_a_cpu_can_and_skips_the_cuda_checks(tmp_path):
    """The GPU smoke check on a CPU: a line per check as it finishes, each training arm in a process of its own
    with the CPU's defaults chosen, and every CUDA-only check written "skipped: no GPU"."""
    out = bench("gpu_smoke.py", "--tiny", "--arms", "lora-packed,qlora-unpacked,lora-packed-liger",
                "--jsonl", str(tmp_path / "smoke.jsonl"))
    lines = {r["check"]: r for r in json_lines(tmp_path / "smoke.jsonl")}
    assert list(lines) == ["c-compiler", "triton-launcher", "model", "defaults", "lora-packed", "qlora-unpacked",
                           "lora-packed-liger", "packed-equals-unpacked", "pytest -m gpu"]
    skipped = {name for name, r in lines.items() if r["status"] == "skipped"}
    assert skipped == {"triton-launcher", "lora-packed-liger", "pytest -m gpu"}
    assert all(lines[name]["detail"] == "no GPU" for name in skipped)
    assert all(r["status"] == "ok" for name, r in lines.items() if name not in skipped), out
    assert lines["lora-packed"]["chosen"] == {"loss_kernel": "chunked", "optimizer": "adamw_torch",
                                              "packed_attention": "sdpa_per_sample"}
    assert len(lines["qlora-unpacked"]["losses"]) == 5
    pids = [r["pid"] for r in lines.values() if "pid" in r]
    assert len(pids) == len(set(pids)) == 5 and os.getpid() not in pids
    for name in lines:
        assert re.search(rf"\] {re.escape(name)}: (ok|skipped)", out), name
    assert "gpu_smoke: 0 failed" in out


def test_overhead_arms_do_the_same_work(tmp_path):
    out = bench("overhead.py", "--blocks", "2", "--steps", "5", "--warmup", "2", "--rows", "200",
                "--json", str(tmp_path / "r.json"))
    measured = json.loads((tmp_path / "r.json").read_text())
    assert "same tokens at every step: True" in out
    assert measured["ftcore_real"] == measured["raw_real"] and min(measured["raw_real"][0]) > 0
    assert len(measured["ftcore_ms"]) == len(measured["raw_ms"]) == 2 * 5
    ratio = float(out.split("ratio ftcore/raw of the median step time: ")[1].split()[0])
    assert ratio == pytest.approx(statistics.median(measured["ftcore_ms"]) / statistics.median(measured["raw_ms"]),
                                  abs=5e-4)


@pytest.mark.slow
def test_packing_counts_every_real_token_once(tmp_path):
    out = bench("packing.py", "--rows", "40", "--rounds", "1", "--max-length", "256",
                "--arms", "unpacked", "packed", "packed-mask", "--json", str(tmp_path / "r.json"))
    measured = json.loads((tmp_path / "r.json").read_text())
    # One epoch in each arm: the forward saw exactly the tokens of the prepared data set, once.
    tokens = [measured["report"]["tokens"]]
    assert measured["real"]["packed"] == measured["real"]["packed-mask"] == measured["real"]["unpacked"] == tokens
    assert measured["padding"]["packed"] == measured["padding"]["packed-mask"] == 0.0 < measured["padding"]["unpacked"]
    ratio = float(out.split("ratio packed/unpacked tokens/s: ")[1].split(";")[0])
    rates = measured["tokens_per_s"]
    assert ratio == pytest.approx(rates["packed"] / rates["unpacked"], abs=0.005)
    assert "| packed (bfd, padding-free, per-sample SDPA: the default) |" in out
    # The same trained positions (labelled, scored by the loss) in every arm: what the FLOP bound counts.
    trained = measured["trained"]
    assert trained["packed"] == trained["packed-mask"] == trained["unpacked"] and 0 < trained["packed"][0] < tokens[0]
    bound = float(out.split("the FLOP bound with ftcore's loss: ")[1].split()[0])
    assert 1 < bound < 1 / (1 - measured["padding"]["unpacked"])


@pytest.mark.slow
def test_compile_tiny_mode(tmp_path):
    out = bench("compile.py", "--tiny", "--json", str(tmp_path / "r.json"))
    row, = json.loads((tmp_path / "r.json").read_text())
    assert row["blocks"] == 2 and row["max_loss_diff"] <= 1e-4 and row["compile_s"] > 0
    assert row["ratio"] == pytest.approx(row["compiled_step_s"] / row["eager_step_s"])
    assert f"| tiny | 0.6M | 2 | {row['eager_step_s']:.3f} | {row['compiled_step_s']:.3f} | {row['ratio']:.2f} |" in out


@pytest.mark.slow
def test_cli_startup_table():
    rows = table_rows(bench("cli_startup.py", "--repeat", "1"))
    names = [r[0] for r in rows]
    assert names[:3] == ["ftcore --help", "ftcore plugins", "ftcore validate quickstart"]
    assert "import torch, transformers, trl, peft" in names[3] and rows[3][3] == "1.00"
    for r in rows:
        assert float(r[3]) == pytest.approx(float(r[1]) / float(rows[3][1]), abs=0.02)


def test_validate_data_tiny_mode():
    out = bench("validate_data.py", "--tiny")
    # The one bad row, in the middle of the file, is found and placed; the run would skip it.
    assert "data.chat: chat.jsonl:51: 'messages[1]' is an assistant turn with empty content" in out
    assert "data: 100 rows read from 1 file(s) in 1 source(s); 1 bad (empty answer: 1); a run skips them all" in out
    times = [float(line.split(":")[1].split()[0]) for line in out.splitlines()
             if line.startswith(("tokenize (", "validate --data ("))]
    ratio = float(out.split("ratio validate/tokenize: ")[1].split()[0])
    assert len(times) == 2 and min(times) > 0
    rounding = 0.0005 * (1 + ratio) / times[0] + 0.005  # the times are printed to the millisecond
    assert ratio == pytest.approx(times[1] / times[0], abs=rounding)


def test_validate_images_tiny_mode(tmp_path):
    """The image rows' benchmark: both arms timed, the ratio their quotient, a peak per size; every row
    checked and none bad, and its scratch folder (made in TMPDIR) gone afterwards."""
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "validate_images.py"), "--tiny"],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONWARNINGS": "ignore", "TMPDIR": str(tmp_path)})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert "data: 40 rows read from 1 file(s) in 1 source(s); no bad rows" in out
    times = [float(line.split(":")[1].split()[0]) for line in out.splitlines()
             if line.startswith(("processor (", "validate --data:"))]
    ratio = float(out.split("ratio validate/processor: ")[1].split()[0])
    assert len(times) == 2 and min(times) > 0
    assert ratio == pytest.approx(times[1] / times[0], abs=0.0005 * (1 + ratio) / times[0] + 0.005)
    peaks = [float(line.split(":")[1].split()[0]) for line in out.splitlines() if "peak RSS," in line]
    assert len(peaks) == 2 and min(peaks) > 50
    assert not list(tmp_path.glob("ftcore-bench-images-*"))


def test_openmp_threads_wait_passively_unless_the_user_says(monkeypatch):
    """ftcore sets OMP_WAIT_POLICY=PASSIVE before torch loads (spinning OpenMP threads slow a run
    beside other busy processes several times over); a user's own setting is kept."""
    from ftcore.cli import main

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    with pytest.raises(SystemExit):
        main(["--help"])
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    with pytest.raises(SystemExit):
        main(["--help"])
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"


@pytest.mark.slow
def test_contention_tiny_mode(tmp_path):
    out = bench("contention.py", "--tiny", "--json", str(tmp_path / "r.json"))
    rates = json.loads((tmp_path / "r.json").read_text())["rates"]
    policies = ("passive (default)", "spin 300k (before)")
    assert set(rates) == {f"{p} / {n} busy" for p in policies for n in (0, 1)}
    assert all(v > 0 for v in rates.values())
    rows = {line.split("  ")[0].strip(): line for line in out.splitlines() if line.startswith(policies)}
    for policy in policies:
        alone, beside = rates[f"{policy} / 0 busy"], rates[f"{policy} / 1 busy"]
        assert f"{alone / beside:.2f}x" in rows[policy]


@pytest.mark.slow
def test_loss_kernels_tiny_mode(tmp_path):
    """The three loss kernels, each in its own process, reach the same loss and LoRA gradients."""
    out = bench("loss_kernels.py", "--tiny", "--grads", "--json", str(tmp_path / "r.json"))
    rows = json.loads((tmp_path / "r.json").read_text())
    assert [r["kernel"] for r in rows] == ["full", "trl", "chunked"]
    full, trl = rows[0], rows[1]
    printed = {line.split()[1]: line.split() for line in out.splitlines() if line.startswith("tiny ")}
    for row in rows:
        assert row["loss"] == pytest.approx(full["loss"], abs=1e-5)
        assert row["max_grad_diff"] < 1e-5
        # A step that reuses pages freed before it can measure a hair below its baseline (-0.1 MiB seen).
        assert row["step_s"] > 0 and row["peak_above_mib"] >= -1
        # The table's ratios are the measured values'.
        cells = printed[row["kernel"]]
        assert float(cells[3]) == pytest.approx(row["step_s"], abs=1e-3)  # printed to 3 decimals
        assert float(cells[4]) == pytest.approx(row["step_s"] / full["step_s"], abs=0.01)
        assert float(cells[5]) == pytest.approx(row["step_s"] / trl["step_s"], abs=0.01)


@pytest.mark.slow
@pytest.mark.skipif(not (SHARED / "tokenizers" / "llama3").exists(), reason="../shared fixtures absent")
def test_peers_tiny_mode_runs_ftcore_side_of_the_job():
    """The peer itself needs its own 6.6 GB environment (run by hand); the job's ftcore side runs here."""
    result = json.loads(bench("peers.py", "--tiny").strip().splitlines()[-1])
    assert result["steps"] == 3 and len(result["real_per_step"]) == 3 and min(result["real_per_step"]) > 0
    assert result["tokens_per_s"] > 0 and 0 < result["startup_s"] < result["wall_s"]
    assert set(result["losses"]) == {"1", "2", "3"} and result["peak_rss_mib"] > 500  # a 68.8M model in fp32


@pytest.mark.slow
@pytest.mark.skipif(not (SHARED / "data" / "dpo_en_demo.json").exists(), reason="../shared fixtures absent")
@pytest.mark.parametrize("trainer", ["dpo", "kto", "orpo"])
def test_padding_free_tiny_mode(tmp_path, trainer):
    out = bench("padding_free.py", "--trainer", trainer, "--rows", "24", "--rounds", "1", "--hidden", "64", "--max-length", "256",
                "--warmup", "1", "--json", str(tmp_path / "r.json"))
    measured = json.loads((tmp_path / "r.json").read_text())
    assert measured["max_loss_diff"] <= 1e-5
    assert measured["real"]["True"] == measured["real"]["False"] and measured["real"]["True"][0] > 0
    ratio = float(out.split("ratio padding-free/padded tokens/s: ")[1].split()[0])
    assert ratio == pytest.approx(measured["ratio"], abs=0.005)


def test_real_positions_count_padding_out_of_every_mask_shape():
    """How the step recorder counts real tokens: 2D masks (LLaMA-Factory's neat packing numbers the
    samples 1, 2, ...), 4D boolean and additive masks (a padded query row attends to nothing), none."""
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from _bench import real_positions

    ids = torch.zeros(2, 5, dtype=torch.long)
    assert real_positions(ids, torch.tensor([[1, 1, 2, 2, 0], [1, 0, 0, 0, 0]])) == 5
    allowed = torch.zeros(2, 1, 5, 5, dtype=torch.bool)
    allowed[0, 0, :3, :3] = torch.ones(3, 3, dtype=torch.bool).tril()
    allowed[1, 0, 0, 0] = True
    assert real_positions(ids, allowed) == 4
    additive = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)
    assert real_positions(ids, additive) == 4
    assert real_positions(ids, None) == 10


@pytest.mark.slow
def test_prepare_scale_tiny_mode(tmp_path):
    """Each size (the tiny mode's one) is prepared by the ``ftcore prepare`` command (which drops the few rows
    its filters call non-text) and raw-tokenized, the peaks are the process's own, and a preparation killed
    halfway reuses the shards it finished and ends with the whole data's counts."""
    out = bench("prepare_scale.py", "--tiny", "--json", str(tmp_path / "r.json"))
    measured = json.loads((tmp_path / "r.json").read_text())
    sizes = [r["rows"] for r in measured["results"]]
    assert sizes == [4_000]
    for r in measured["results"]:
        pr = r["prepare"]
        assert r["raw"]["rows"] == r["rows"] and 0.99 * r["rows"] <= pr["rows"] <= r["rows"] < pr["tokens"]
        assert 0 < pr["tokenize_seconds"] < pr["seconds"]
        assert pr["peak_rss_mib"] > pr["rss_before_mib"] > 0 and pr["peak_above_mib"] > 0
        rate = pr["tokens"] / pr["tokenize_seconds"] / (r["raw"]["tokens"] / r["raw"]["seconds"])
        assert f"| {r['rows']:,} |" in out and f"| {rate:.2f} |" in out
    resume = measured["resume"]
    assert resume["shards"] == 8 and 4 <= resume["finished_when_killed"] <= resume["shards_reused"] < 8
    assert resume["tokens"] == measured["results"][-1]["prepare"]["tokens"]
    assert f"the rerun reused {resume['shards_reused']} and took" in out


def test_dedup_memory_tiny_mode(tmp_path):
    """Both dedup kinds keep every generated row (they are all new) and the table prints what was
    measured; near dedup's index holds more than exact dedup's digests."""
    out = bench("dedup_memory.py", "--tiny", "--json", str(tmp_path / "r.json"))
    results = json.loads((tmp_path / "r.json").read_text())
    assert [(r["rows"], r["kind"]) for r in results] == [(5_000, "exact"), (5_000, "near"), (10_000, "exact"),
                                                          (10_000, "near")]
    for r in results:  # (exact's 8 bytes a row may fit in the heap's free space: no growth to see at 5,000)
        assert r["kept"] == r["rows"]
        assert f"| {r['rows']:,} | {r['kind']} | {r['kept']:,} | {r['bytes'] / 2**20:.1f} |" in out
    exact, near = results[2], results[3]
    assert near["bytes"] > exact["bytes"] and near["bytes"] > 0


def test_split_memory_tiny_mode(tmp_path):
    """The split holds out a tenth of the rows it measured over, and the table prints what was measured."""
    out = bench("split_memory.py", "--tiny", "--json", str(tmp_path / "r.json"))
    r = json.loads((tmp_path / "r.json").read_text())
    assert (r["rows"], r["train"], r["validation"]) == (20_000, 18_000, 2_000)
    assert r["peak_above_mib"] >= r["held_mib"]
    assert (f"| 20,000 | 18,000 | 2,000 | {r['peak_above_mib']:.0f} | {r['held_mib']:.0f} | "
            f"{r['seconds']:.1f} |") in out


@pytest.mark.slow
@pytest.mark.skipif(not (SHARED / "tokenizers" / "qwen25").exists(), reason="../shared fixtures absent")
def test_streaming_tiny_mode(tmp_path):
    """A streaming pretrain run trains every step on full blocks, and the report is its own record."""
    out = bench("streaming.py", "--tiny", "--json", str(tmp_path / "r.json"))
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["steps"] == 5 and r["train_tokens"] == 5 * 4 * 256
    assert 0 < r["load_to_first_step_s"] < r["start_to_first_step_s"]
    assert r["rss_mib"]["first"] > 100 and r["peak_rss_mib"] >= r["rss_mib"]["last"]
    assert f"from the source's load to the first step: {r['load_to_first_step_s']:.1f} s" in out


@pytest.mark.slow
@pytest.mark.skipif(not (SHARED / "tokenizers" / "qwen25").exists(), reason="../shared fixtures absent")
def test_real_size_tiny_mode(tmp_path):
    """The 0.5B benchmark's plans, shortened: both run every phase, the trained model's perplexity
    moves, every export is measured, and the table prints what was measured."""
    out = bench("real_size.py", "--tiny", "--json", str(tmp_path / "r.json"), timeout=1800)
    measured = json.loads((tmp_path / "r.json").read_text())
    runs = {r["kind"]: r for r in measured["results"]}
    assert set(runs) == {"lora", "qlora"}
    assert {p for p in runs["lora"]["memory"] if p.startswith("export:")} == {"export:adapter", "export:merged",
                                                                              "export:gguf"}
    assert {p for p in runs["qlora"]["memory"] if p.startswith("export:")} == {"export:merged"}
    for kind, r in runs.items():
        assert r["perplexity"]["after"] != r["perplexity"]["before"]
        assert all(v["rss_before_mib"] > 0 for p, v in r["memory"].items() if p.startswith("export:"))
        trained = r["memory"]["sft: trained"]["peak_rss_mib"]
        assert f"| {kind} | train (" in out and f"| {trained:,.0f} | {r['estimate_mib']:,.0f} |" in out
    assert "time model:" in out and runs["lora"]["predicted_step_s"] > 0


@pytest.mark.slow
def test_sweep_tiny_mode(tmp_path):
    """Three arms of a 2-trial sweep: the table and ratios are the measured ones, and the plain and
    shared arms (the same sampler, no pruning) try the same trials, so they find the same best."""
    out = bench("sweep.py", "--tiny", "--json", str(tmp_path / "r.json"), timeout=1800)
    result = json.loads((tmp_path / "r.json").read_text())
    arms = result["arms"]
    assert set(arms) == {"plain", "shared", "pruned"}
    assert arms["plain"]["best"] == arms["shared"]["best"] and arms["plain"]["best_params"] == arms["shared"]["best_params"]
    assert arms["plain"]["models"] is None and arms["shared"]["models"]["built"] == 2
    for arm in arms.values():
        assert arm["complete"] + arm["pruned"] == 2
    rows = {r[0]: r for r in table_rows(out)}
    assert float(rows["plain"][3]) == arms["plain"]["wall_seconds"]
    ratio = arms["shared"]["wall_seconds"] / arms["plain"]["wall_seconds"]
    assert f"shared stages and base kept: {ratio:.2f}x" in out


@pytest.mark.slow
def test_template_parity_tiny_mode(tmp_path):
    """Both templates run through the example package, installed where only the benchmark's runs see it
    and built from a copy (the package folder is left as it was); the table and the means agree with the
    per-run results."""
    before = sorted(p.name for p in (ROOT / "examples" / "ftcore-example-data").iterdir())
    out = bench("template_parity.py", "--tiny", "--json", str(tmp_path / "r.json"), timeout=1800)
    measured = json.loads((tmp_path / "r.json").read_text())
    runs = {r["template"]: r for r in measured["results"]}
    assert sorted(runs) == ["chatml", "turns"] and all(r["answers"] == 100 for r in runs.values())
    header, row, mean = table_rows(out)
    assert header[0] == "seed"
    assert row == ["1", f"{runs['turns']['exact_match']:.2f}", f"{runs['turns']['stopped']}/100",
                   f"{runs['chatml']['exact_match']:.2f}", f"{runs['chatml']['stopped']}/100"]
    assert mean[1] == f"{measured['mean']['turns']:.3f}" and mean[3] == f"{measured['mean']['chatml']:.3f}"
    diff = float(out.split("over 1 seed(s): ")[1].split()[0])
    assert diff == pytest.approx(measured["mean"]["turns"] - measured["mean"]["chatml"], abs=5e-4)
    assert sorted(p.name for p in (ROOT / "examples" / "ftcore-example-data").iterdir()) == before


@pytest.mark.slow
def test_new_tokens_tiny_mode(tmp_path):
    """The quickstart plan with chatml, with chatml on a tokenizer without its markers, with llama3 and with
    chatml's own markers frozen under LoRA: the new-token arms did add their tokens (the chatml ones none),
    and the table, means, spreads and differences agree with the per-run results."""
    before = sorted(p.name for p in (ROOT / "examples" / "quickstart").iterdir())
    out = bench("new_tokens.py", "--tiny", "--jobs", "4", "--json", str(tmp_path / "r.json"), timeout=1800)
    measured = json.loads((tmp_path / "r.json").read_text())
    runs = {r["arm"]: r for r in measured["results"]}
    assert sorted(runs) == ["chatml", "chatml-frozen", "chatml-new", "llama3"]
    assert all(r["answers"] == 10 for r in runs.values())
    assert runs["chatml"]["added"] == runs["chatml-frozen"]["added"] == []
    assert runs["chatml-new"]["added"] == ["<|im_start|>", "<|im_end|>"]
    assert runs["llama3"]["added"] == ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    header, row, mean, std = table_rows(out)
    assert header[0] == "seed" and row[0] == "1"
    arms = ["chatml", "chatml-new", "llama3", "chatml-frozen"]
    assert row[1:] == [c for a in arms for c in (f"{runs[a]['exact_match']:.2f}", f"{runs[a]['stopped']}/10")]
    assert mean[1::2] == [f"{measured['mean'][a]:.3f}" for a in arms]
    assert std[1::2] == ["0.000"] * 4  # one seed
    for arm in arms:
        loss = runs[arm]["sft_last_loss"]
        assert loss is None or f"{arm}: last logged SFT loss {loss:.3f} to {loss:.3f} (mean {loss:.3f})" in out
    for arm in arms[1:]:
        diff = float(out.split(f"{arm} - chatml, mean exact match over 1 seed(s): ")[1].split()[0])
        assert diff == pytest.approx(measured["mean"][arm] - measured["mean"]["chatml"], abs=5e-4)
    assert sorted(p.name for p in (ROOT / "examples" / "quickstart").iterdir()) == before


def test_expert_lora_memory_tiny_mode(tmp_path):
    """peft's LoRA on the experts and ftcore's grouped path compute the same (every gradient element), peft's path
    saves a copy of the whole expert stack that the grouped one does not, what ftcore estimate counts for the grouped
    path is what it saved, and the table prints what was measured."""
    out = bench("expert_lora_memory.py", "--tiny", "--json", str(tmp_path / "r.json"))
    runs = {r["arm"]: r for r in json.loads((tmp_path / "r.json").read_text())}
    assert sorted(runs) == ["frozen", "grouped", "peft"]
    peft, grouped, frozen = runs["peft"], runs["grouped"], runs["frozen"]
    assert peft["grads"].keys() == grouped["grads"].keys() and len(peft["grads"]) == 8  # A, B, norms of 2 tensors
    for key, values in peft["grads"].items():
        assert values == pytest.approx(grouped["grads"][key], rel=1e-4, abs=1e-7), key
    # peft's saves the matmuls' inputs, as the grouped path does, and W + s B A of both tensors: the expert stack's size
    assert peft["saved_bytes"] - frozen["saved_bytes"] == peft["expert_bytes"] + peft["estimate_bytes"]["inputs"]
    assert grouped["saved_bytes"] - frozen["saved_bytes"] < 0.5 * peft["expert_bytes"]  # no copy of the stack
    assert peft["estimate_bytes"]["copies"] == 2 * 8 * 64 * 64 * 4  # W + s B A of gate_up twice (its gradient)
    # The grouped path: B copies (8 experts x r 4 x out 64, of each tensor) and, per routed token, the inputs (64, 32)
    # and the rank-4 intermediates.
    assert grouped["estimate_bytes"] == {"copies": 8 * 4 * (64 + 64) * 4, "inputs": 64 * 2 * (64 + 32 + 2 * 4) * 4}
    assert grouped["saved_bytes"] - frozen["saved_bytes"] == sum(grouped["estimate_bytes"].values())
    for r in runs.values():
        assert (f"| float32 | {r['arm']} | {r['expert_bytes'] / 2**20:,.1f} | {r['saved_bytes'] / 2**20:,.1f} | "
                f"{r['peak_above_mib']:,.1f} | {r['seconds']:.2f} |") in out
    assert f"peft and grouped agree within {grouped['agreement']:.1e}" in out
    for arm in (peft, grouped):
        counted = arm["estimate_bytes"]
        assert (f"{arm['arm']}'s peak above the frozen experts': "
                f"{arm['peak_above_mib'] - frozen['peak_above_mib']:,.1f} MiB; "
                f"ftcore estimate counts {(counted['copies'] + counted['inputs']) / 2**20:,.1f} MiB") in out


def test_tiled_mlp_tiny_mode():
    """Both arms train the same row to the same losses; the tiled one in more than one shard."""
    out = bench("tiled_mlp.py", "--tokens", "400", "--hidden", "64", "--intermediate", "256", "--layers", "1",
                "--steps", "3")
    rows = {r[0]: r for r in table_rows(out)}
    assert sorted(rows) == ["tiled", "untiled"], out
    assert rows["untiled"][2] == "1" and int(rows["tiled"][2]) > 1
    assert rows["tiled"][6] == rows["untiled"][6]  # the losses
    # ftcore estimate counts the tiled MLP: fewer activations than untiled
    assert float(rows["tiled"][4].replace(",", "")) < float(rows["untiled"][4].replace(",", ""))
    assert "tiled_mlp: " in out and "saved by tiling: " in out


@pytest.mark.slow
def test_sequence_parallel_memory_tiny_mode(tmp_path):
    """Issue #43: two processes under sp_size 2, started as two nodes of one machine (the form one GPU needs), hold
    less activation memory per rank than one process training the same 4,096-token rows, ftcore estimate's
    activation figure is within 15% of the measured one for both, and the table prints what was measured. (Four
    `ftcore run`s, two of them two-process DeepSpeed runs: minutes.)"""
    out = bench("sequence_parallel_memory.py", "--tiny", "--split-nodes", "--json", str(tmp_path / "r.json"),
                timeout=1200)
    measured = json.loads((tmp_path / "r.json").read_text())
    # sp2 as one GPU runs it: two single-process nodes of this machine, each on LOCAL_RANK 0, a rank each
    assert measured["split_nodes"] and "sp2 as two single-process nodes" in out
    (row,) = measured["results"]
    assert sorted(row["sp2"]["sampled_peak_mib"]) == ["0", "1"], row
    assert row["length"] == 4096 and row["ratio"] < 1, row
    for arm, size in (("sp1", 1), ("sp2", 2)):
        a = row[arm]
        assert abs(a["error_percent"]) <= 15, (arm, a)
        assert a["measured_mib"] == pytest.approx(a["delta_mib"] - a["control_delta_mib"], abs=0.051)
        assert (f"| {arm} | 4,096 | {4096 // size:,} | {a['delta_mib']:.1f} | {a['control_delta_mib']:.1f} | "
                f"{a['measured_mib']:.1f} | {a['estimate_mib']:.1f} | {a['error_percent']:+.1f}% |") in out
    assert f"4,096 tokens: SP2/SP1 activation memory per rank {row['ratio']:.3f} measured" in out
    sp2 = next(r for r in measured["runs"] if r["arm"] == "sp2" and r["length"] == 4096)
    assert any(a.startswith("sequence parallel sp_size 2") for a in sp2["estimate_axes"])


def test_sequence_parallel_memory_gpu_plans(tmp_path):
    """The GPU form of the benchmark (issue #43's device command, unmeasured on a GPU so far): on one GPU sp2's two
    ranks are two single-process nodes over gloo (NCCL takes one device a rank), on two or more one node over
    NCCL; ftcore validates both, and its estimate has sp2 hold about half of sp1's activations a rank, with sp1's
    65,536-token row within one H200 (139 GiB)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("spm", ROOT / "benchmarks" / "sequence_parallel_memory.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    one_gpu = module.plan_text("sp2", 65536, 3, 29500, "cuda", split=True)
    several = module.plan_text("sp2", 65536, 3, 29500, "cuda", split=False)
    assert "nproc_per_node = 1\nnnodes = 2" in one_gpu and 'backend = "gloo"' in one_gpu
    assert "nproc_per_node = 2\n" in several and 'backend = "auto"' in several
    assert 'architecture = "qwen2"' in one_gpu and "hidden_size = 896" in one_gpu and "num_layers = 24" in one_gpu
    totals = {}
    for name, text in (("sp1", module.plan_text("sp1", 65536, 3, 29500, "cuda")), ("sp2", one_gpu),
                       ("sp2-nccl", several)):
        plan = tmp_path / f"{name}.toml"
        plan.write_text(text)
        checked = run_cli("validate", str(plan), cwd=tmp_path)
        assert checked.returncode == 0, checked.stderr
        r = run_cli("estimate", str(plan), "--device", "cuda", "--json", cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        totals[name] = json.loads(r.stdout)["stages"][0]["bytes"]
    assert totals["sp2"] == totals["sp2-nccl"]
    assert 0.45 < totals["sp2"]["activations"] / totals["sp1"]["activations"] < 0.6, totals
    assert totals["sp1"]["total"] < 139 * 2**30


@pytest.mark.slow
@pytest.mark.skipif(not (SHARED / "tokenizers" / "qwen25").exists(), reason="../shared fixtures absent")
def test_quantizer_memory_tiny_mode(tmp_path):
    """Issue #44's memory table, shortened (six `ftcore run`s of one step: minutes): a row per quantizer with
    what was measured, and every quantized model holds fewer weight bytes than the unquantized one."""
    out = bench("quantizer_memory.py", "--tiny", "--jsonl", str(tmp_path / "r.jsonl"), timeout=1800)
    runs = {r["config"]: r for r in json_lines(tmp_path / "r.jsonl")}
    assert list(runs) == ["none", "bnb-nf4", "hqq", "torchao-int8", "quanto-int8", "quanto-int4"]
    rows = {r[0]: r for r in table_rows(out) if r[0] != "quantizer"}
    assert list(rows) == list(runs)
    assert runs["none"]["quantized_bytes"] == 0
    for config, r in runs.items():
        assert rows[config][1:3] == [f"{r['weights_bytes'] / 2**20:,.1f}", f"{r['estimate_weights_bytes'] / 2**20:,.1f}"]
        assert rows[config][5] == f"{r['trained_peak_rss_mib']:,.0f}" and r["trained_peak_rss_mib"] > 0
        assert r["weights_ratio"] == r["estimate_weights_bytes"] / r["weights_bytes"]
        if config != "none":
            assert 0 < r["quantized_bytes"] and r["weights_bytes"] < runs["none"]["weights_bytes"], config
