"""``[distributed]``: validation, and real 2-process CPU runs (gloo) that ``ftcore run`` launches itself.

Parity: a 2-process run with half the per-device batch has the same global batch as a 1-process run, so
its per-step losses (read from metrics.jsonl) must match. SGD keeps the comparison sharp: Adam turns
float rounding in near-zero gradients into full-size steps. Engines: DDP, FSDP2, DeepSpeed ZeRO-2 and
ZeRO-3 (the first DeepSpeed run on a machine JIT-builds its shared-memory op, then cached).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import TINY_HEADER, chat_rows, run_cli, text_rows, write_jsonl
from ftcore.testing import complete_checkpoints

STAGE = """
[[stage]]
name = "pre"
trainer = "pretrain"
data = "text"
max_steps = 8
max_length = 16
batch_size = {batch}
learning_rate = 0.5
optimizer = "sgd"
logging_steps = 1
save_steps = {save}
precision = "fp32"
"""


def write_plan(folder: Path, name: str, batch: int, distributed: str = "", save: int = 4) -> Path:
    if not (folder / "text.jsonl").exists():
        write_jsonl(folder / "text.jsonl", text_rows(64))
        write_jsonl(folder / "chat.jsonl", chat_rows(8))
        write_jsonl(folder / "chat_eval.jsonl", chat_rows(8))
    path = folder / f"{name}.toml"
    header = TINY_HEADER.replace('name = "tiny"', f'name = "{name}"').replace('"text", "chat"', '"text"')
    path.write_text(header + STAGE.format(batch=batch, save=save) + distributed, encoding="utf-8")
    return path


def losses(run_dir: Path) -> dict[int, float]:
    """The logged training loss per step; after a resume, the last record of a step wins."""
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["stage"] == "pre" and "loss" in record:
            out[record["step"]] = record["loss"]
    return out


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """The reference: one process, batch 8."""
    folder = tmp_path_factory.mktemp("dist")
    r = run_cli("run", str(write_plan(folder, "single", 8)), env={"OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    return folder, losses(folder / "runs" / "single")


def test_bad_distributed_values_are_one_line_problems(tmp_path):
    plan = write_plan(tmp_path, "bad", 4, '\n[distributed]\nengine = "horovod"\nnproc_per_nod = 2\nnode_rank = 1\n')
    r = run_cli("validate", str(plan))
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert any("distributed.engine: input should be 'ddp', 'fsdp' or 'deepspeed'" in line for line in lines), lines
    assert any("distributed.nproc_per_nod: unknown key; did you mean 'nproc_per_node'?" in line for line in lines), lines

    plan = write_plan(tmp_path, "bad2", 4, '\n[distributed]\nengine = "fsdp"\nnode_rank = 1\n'
                                           'fsdp_sharding = "no_shard"\nzero_stage = 3\n')
    r = run_cli("validate", str(plan))
    assert r.returncode == 2
    text = r.stderr
    assert "distributed.node_rank: must be below nnodes (1), got 1" in text
    assert "distributed.fsdp_sharding: \"no_shard\" was FSDP1's" in text
    assert "distributed.zero_stage: only used with engine = \"deepspeed\" (engine is \"fsdp\")" in text
    assert len(text.strip().splitlines()) == 3

    # The command-line flags override the plan and are checked the same way.
    plan = write_plan(tmp_path, "flag", 4, '\n[distributed]\nzero_stage = 3\n')
    r = run_cli("run", str(plan), "--engine", "ddp", "--nproc-per-node", "2")
    assert r.returncode == 2 and "distributed.zero_stage: only used with engine" in r.stderr
    assert not (tmp_path / "runs").exists()


def test_distributed_is_not_part_of_the_fingerprint(tmp_path):
    from ftcore.plan import load_plan
    from ftcore.plugins import get_plugin_manager

    registry = get_plugin_manager().registry()
    one = load_plan(write_plan(tmp_path, "a", 4), registry)
    two = load_plan(write_plan(tmp_path, "a", 4, '\n[distributed]\nnproc_per_node = 2\n'), registry)
    assert one.fingerprint() == two.fingerprint()
    assert two.distributed.processes == 2 and one.distributed.processes == 1


# DeepSpeed on CPU: its CPU accelerator, gloo, and its shared-memory op (JIT-built on first use, cached).
ENGINES = {"ddp": 'engine = "ddp"', "fsdp": 'engine = "fsdp"',
           "zero2": 'engine = "deepspeed"\nzero_stage = 2', "zero3": 'engine = "deepspeed"\nzero_stage = 3'}


def weight_difference(run_dir: Path, reference_dir: Path) -> float:
    """The largest difference between the stage outputs' weights (the full weights, gathered from the
    shards under FSDP and ZeRO-3)."""
    from safetensors.torch import load_file

    weights = load_file(run_dir / "stages" / "pre" / "output" / "model.safetensors")
    reference = load_file(reference_dir / "stages" / "pre" / "output" / "model.safetensors")
    assert weights.keys() == reference.keys()
    return max((weights[k] - reference[k]).abs().max().item() for k in weights)


@pytest.mark.slow
@pytest.mark.parametrize("engine", list(ENGINES))
def test_two_processes_match_one(single, engine):
    folder, reference = single
    plan = write_plan(folder, engine, 4, f'\n[distributed]\n{ENGINES[engine]}\nnproc_per_node = 2\n')
    start = time.perf_counter()
    r = run_cli("run", str(plan))
    seconds = time.perf_counter() - start
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    got = losses(folder / "runs" / engine)
    assert sorted(got) == list(range(1, 9)) and sorted(reference) == list(range(1, 9))
    diff = max(abs(got[s] - reference[s]) for s in reference)
    print(f"{engine}: max loss difference over 8 steps {diff:.3g} ({seconds:.0f} s)")
    assert diff < 1e-4
    assert reference[8] < reference[1] - 1  # it trained: the comparison is not between two flat lines
    # Rank 0 alone prints: each stage line once; the other rank's output is not on the console.
    assert r.stdout.count("stage pre: trainer 'pretrain'") == 1
    assert r.stdout.count("run directory:") == 1
    run_dir = folder / "runs" / engine
    assert json.loads((run_dir / "manifest.json").read_text())["world_size"] == 2
    checkpoint = run_dir / "stages" / "pre" / "checkpoints" / "checkpoint-8"
    assert (checkpoint / "COMPLETE.json").exists()
    if engine == "fsdp":  # each rank wrote its shard
        assert (checkpoint / "pytorch_model_fsdp_0").is_dir()
    if engine.startswith("zero"):  # DeepSpeed's partitions: one optimizer state per rank
        assert {p.name for p in (checkpoint / "global_step8").glob("*optim_states.pt")} == \
            {"zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"}
    # The stage output holds the full trained weights, the ones one process trained.
    weights = weight_difference(run_dir, folder / "runs" / "single")
    print(f"{engine}: max weight difference {weights:.3g}")
    assert weights < 1e-4


def _worker_pids(launcher: int) -> list[int]:
    out = subprocess.run(["ps", "-eo", "pid,ppid,args"], capture_output=True, text=True).stdout.splitlines()[1:]
    rows = [line.split(None, 2) for line in out]
    children: dict[int, list[int]] = {}
    for pid, ppid, _ in rows:
        children.setdefault(int(ppid), []).append(int(pid))
    found, todo = [], [launcher]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["ddp", "zero3"])
def test_killed_distributed_run_resumes(single, engine):
    """SIGKILL the launcher's process group once a checkpoint is complete: the workers die with
    it, and --resume continues from that checkpoint (ZeRO-3: each rank's partition of the weights and
    optimizer state) to the losses and weights an uninterrupted run has."""
    folder, reference = single
    name = f"killed-{engine}"
    plan = write_plan(folder, name, 4, f'\n[distributed]\n{ENGINES[engine]}\nnproc_per_node = 2\n', save=2)
    errors = folder / f"{name}.stderr"  # read back if the run ends before its checkpoint
    with errors.open("w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "ftcore", "run", str(plan)], start_new_session=True,
                                stdout=subprocess.DEVNULL, stderr=stderr)
    # Any complete checkpoint will do: the first one is rotated away (save_total_limit) within steps.
    deadline = time.time() + 300
    run_dir = folder / "runs" / name
    while not complete_checkpoints(run_dir, "pre") and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    assert proc.poll() is None, f"the run ended (exit {proc.poll()}) before it could be killed: {errors.read_text()[-3000:]}"
    family = _worker_pids(proc.pid)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()

    def alive() -> list[int]:
        def running(pid: int) -> bool:
            try:
                return "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()
            except FileNotFoundError:  # gone (and reaped)
                return False
        return [pid for pid in family if running(pid)]

    gone = time.monotonic() + 3  # the workers have 3 s to die with it
    while alive() and time.monotonic() < gone:
        time.sleep(0.05)
    assert not alive(), f"workers outlived the killed launcher: {alive()}"
    assert json.loads((run_dir / "manifest.json").read_text())["status"] == "running"  # killed, not ended
    assert not (run_dir / "stages" / "pre" / "COMPLETE.json").exists()

    r = run_cli("run", str(plan), "--resume")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "resuming from checkpoint-" in r.stdout
    got = losses(run_dir)
    assert sorted(got) == list(range(1, 9))
    diff = max(abs(got[s] - reference[s]) for s in reference)
    print(f"{engine} killed and resumed: max loss difference to one process {diff:.3g}")
    assert diff < 1e-4
    weights = weight_difference(run_dir, folder / "runs" / "single")
    print(f"{engine} killed and resumed: max weight difference {weights:.3g}")
    assert weights < 1e-4
    assert json.loads((run_dir / "manifest.json").read_text())["status"] == "complete"
