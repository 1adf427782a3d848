"""The same LoRA job in ftcore and in LLaMA-Factory, side by side on this machine.

    python benchmarks/peers.py [--rounds 3] [--packing] [--steps 60] [--json PATH]

The job (issue #16): a 68.9M-parameter Llama (hidden 256, 3 layers, random init, saved once as a
transformers folder) with the real Llama 3 tokenizer (../shared/fixtures/tokenizers/llama3, 128,256
tokens), the real ``alpaca_en_demo`` set, the llama3 template, LoRA r=16 (alpha 32, no dropout) on
every linear layer, ``max_length``/``cutoff_len`` 512, batch 4, 60 steps, learning rate 1e-4 with
linear decay and no warmup, fp32, seed 42, each tool's defaults otherwise. Both tools draw the
batches with transformers' seeded sampler over the same 999 rows, so they train on the same samples
in the same order (checked: the real tokens per step must be equal). ``--packing`` packs on both
sides: ftcore's ``packing = true`` and LLaMA-Factory's ``neat_packing`` (its packing without attention
across samples).

LLaMA-Factory 0.9.5 is installed by this script into its own virtual environment (``--venv``,
default ``~/.cache/ftcore-benchmarks/llamafactory``; 6.6 GB, about 6 minutes here) as a new user
would, with one pin: ``pip install llamafactory==0.9.5`` alone resolves torch 2.15.0 and torchaudio
2.11.0, and LLaMA-Factory then fails at import (torchaudio refuses a torch built for another CUDA),
so torch, torchvision and torchaudio are pinned to the matching 2.11.0 / 0.26.0 / 2.11.0. That torch
is PyPI's CUDA build, which runs on the CPU here; ftcore's arm runs on torch 2.13.0 (CPU). The
versions are printed with the results.

ftcore's arm runs the same way, in a virtual environment of its own made on first use (``--ftcore-venv``,
default ``~/.cache/ftcore-benchmarks/ftcore``): torch 2.13.0 (CPU) and this checkout installed editable with
its default dependencies, as ``pip install ftcore`` gives a user. A development environment holds more:
with the ``distributed`` and ``track`` extras installed, accelerate imports DeepSpeed as a trainer starts
(``extract_model_from_parallel`` looks for its engine), and DeepSpeed imports MLflow, about 3 s of
start-up that a run without them does not pay. ``--ftcore-python PATH`` runs the arm in another
interpreter (``--ftcore-python "$(which python)"``: the current environment).

Each arm runs in a process of its own, the arms alternating (``--rounds`` pairs). Measured the same
way in both, by a transformers callback installed in the process (``_bench.StepRecorder``): train
tokens/s (real tokens the model's forward saw, steps after the first ``--warmup``), the loss at steps
1/10/30/60, start-up (process start to the first step) and wall time from outside, peak RSS
(``ru_maxrss`` of the process) and CPU time.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SHARED = ROOT.parent / "shared" / "fixtures"
LLAMA3 = SHARED / "tokenizers" / "llama3"
ALPACA = SHARED / "data" / "alpaca_en_demo.json"
PEER = "llamafactory==0.9.5"
# torchaudio 2.11.0 is the newest; the torch and torchvision built with it (see the docstring).
PEER_PINS = ["torch==2.11.0", "torchvision==0.26.0", "torchaudio==2.11.0"]
MODEL = dict(vocab_size=128256, hidden_size=256, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
             intermediate_size=1024, tie_word_embeddings=False, max_position_embeddings=8192, rope_theta=500000.0)
LOSS_STEPS = (1, 10, 30, 60)


# -- the child: one arm in this process ------------------------------------------------------------
def child(arm: str, spec: dict) -> None:
    """Run one arm and write what it measured to ``spec["out"]`` (JSON). Runs in ftcore's venv for
    ftcore, and in LLaMA-Factory's for it: only the two tools and transformers are imported."""
    sys.path.insert(0, str(HERE))
    from _bench import StepRecorder, quiet

    recorder = StepRecorder().install()
    first_step: list[float] = []
    recorder_begin = recorder.on_step_begin

    def on_step_begin(*args, **kwargs):
        if not first_step:
            first_step.append(time.time())
        return recorder_begin(*args, **kwargs)

    recorder.on_step_begin = on_step_begin
    if arm == "llamafactory":
        from llamafactory.train.tuner import run_exp

        with quiet():
            run_exp(spec["config"])
    else:
        from _bench import run_ftcore

        run_ftcore(Path(spec["plan"]))
    usage = resource.getrusage(resource.RUSAGE_SELF)
    seconds = recorder.step_seconds(spec["warmup"])
    timed = recorder.real[spec["warmup"]:spec["warmup"] + len(seconds)]
    Path(spec["out"]).write_text(json.dumps({
        "tokens_per_s": sum(timed) / sum(seconds), "real_per_step": recorder.real, "steps": len(recorder.begins),
        "losses": {str(k): v for k, v in recorder.losses.items()}, "first_step_at": first_step[0],
        "peak_rss_mib": usage.ru_maxrss / 1024, "cpu_s": usage.ru_utime + usage.ru_stime}))


# -- setup ------------------------------------------------------------------------------------------
def venv_python(venv: Path, check: str, what: str, *installs: list[str]) -> Path:
    """The python of ``venv``, made on first use: a venv, then each ``pip install`` of ``installs`` in turn,
    until ``check`` (Python source) runs there."""
    python = venv / "bin" / "python"
    checked = [str(python), "-c", check]
    if python.exists() and subprocess.run(checked, capture_output=True).returncode == 0:
        return python
    print(f"installing {what} into {venv} (once) ...", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    for packages in installs:
        subprocess.run([str(python), "-m", "pip", "install", "-q", *packages], check=True)
    subprocess.run(checked, check=True)
    return python


def peer_python(venv: Path) -> Path:
    """LLaMA-Factory's venv (several GB)."""
    return venv_python(venv, "import llamafactory.train.tuner", PEER, [PEER, *PEER_PINS])


def ftcore_python(venv: Path) -> Path:
    """ftcore as a user installs it (default dependencies, torch 2.13.0 CPU first), this checkout editable."""
    return venv_python(venv, "import ftcore_plugins, peft, trl", "ftcore (default dependencies)",
                       ["torch==2.13.0"], ["-e", str(ROOT)])


def build_model(folder: Path) -> None:
    """The Llama of the job, random init (seed 0), with the real Llama 3 tokenizer, saved once."""
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**MODEL)).float()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(LLAMA3))
    model.config.bos_token_id, model.config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def ftcore_plan(work: Path, model: Path, args, name: str) -> Path:
    plan = work / f"{name}.toml"
    plan.write_text(f"""
[run]
name = "{name}"
seed = 42
output_dir = "{work / 'runs'}"

[model]
use = "hf"
path = "{model}"

[template]
use = "llama3"

[data.alpaca]
use = "json"
path = "{ALPACA}"

[[stage]]
name = "sft"
trainer = "sft"
data = "alpaca"
adapter = {{ use = "lora", r = 16, lora_alpha = 32, lora_dropout = 0.0, target_modules = "all-linear" }}
max_steps = {args.steps}
batch_size = 4
max_length = 512
learning_rate = 1e-4
lr_scheduler = "linear"
precision = "fp32"
logging_steps = 1
save_steps = 100000
packing = {str(args.packing).lower()}
""")
    return plan


def peer_config(work: Path, model: Path, args, name: str) -> dict:
    data = work / "peer-data"
    if not data.exists():
        data.mkdir()
        shutil.copy(ALPACA, data / ALPACA.name)
        (data / "dataset_info.json").write_text(json.dumps({"alpaca_en_demo": {"file_name": ALPACA.name}}))
    return {"model_name_or_path": str(model), "stage": "sft", "do_train": True, "finetuning_type": "lora",
            "lora_rank": 16, "lora_alpha": 32, "lora_dropout": 0.0, "lora_target": "all",
            "dataset": "alpaca_en_demo", "dataset_dir": str(data), "template": "llama3", "cutoff_len": 512,
            "overwrite_cache": True, "output_dir": str(work / "runs" / name), "overwrite_output_dir": True,
            "logging_steps": 1, "save_strategy": "no", "per_device_train_batch_size": 4,
            "gradient_accumulation_steps": 1, "learning_rate": 1e-4, "max_steps": args.steps,
            "lr_scheduler_type": "linear", "warmup_ratio": 0.0, "bf16": False, "fp16": False, "report_to": "none",
            "seed": 42, "packing": args.packing, "neat_packing": args.packing, "plot_loss": False}


def run_arm(arm: str, python: Path, spec: dict, work: Path, name: str) -> dict:
    out = work / f"{name}.json"
    spec = {**spec, "out": str(out)}
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "WANDB_DISABLED": "true",
           "DISABLE_VERSION_CHECK": "1", "FTCORE_CACHE_DIR": str(work / "cache")}
    start = time.time()
    done = subprocess.run([str(python), __file__, "--child", arm, json.dumps(spec)], env=env, cwd=work,
                          capture_output=True, text=True)
    wall = time.time() - start
    if done.returncode:
        sys.exit(f"{arm} arm failed ({done.returncode}):\n{done.stderr[-4000:]}")
    result = json.loads(out.read_text())
    result.update(wall_s=wall, startup_s=result.pop("first_step_at") - start)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="pairs of runs, alternating which goes first")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps at the start of each run")
    parser.add_argument("--packing", action="store_true", help="pack on both sides")
    parser.add_argument("--venv", type=Path, default=Path.home() / ".cache" / "ftcore-benchmarks" / "llamafactory")
    parser.add_argument("--ftcore-venv", type=Path, default=Path.home() / ".cache" / "ftcore-benchmarks" / "ftcore",
                        help="ftcore's arm's venv (default dependencies; made on first use)")
    parser.add_argument("--ftcore-python", type=Path, help="run ftcore's arm in this interpreter instead")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--tiny", action="store_true",
                        help="the test's mode: ftcore's arm of the job alone, 3 steps (no peer installed)")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child[0], json.loads(args.child[1]))
    if not (LLAMA3.exists() and ALPACA.exists()):
        sys.exit(f"needs the Llama 3 tokenizer and the Alpaca demo set under {SHARED}")
    if args.tiny:
        return tiny(args)

    sys.path.insert(0, str(HERE))
    from _bench import machine

    python = peer_python(args.venv)
    ours = args.ftcore_python or ftcore_python(args.ftcore_venv)
    ours_version = subprocess.run([ours, "-c", "import importlib.metadata as m, sys; print(', '.join("
                                   "f'{d} {m.version(d)}' for d in ('torch', 'transformers', 'peft', 'trl')), "
                                   "'; DeepSpeed installed:', any(d.metadata['Name'] == 'deepspeed' "
                                   "for d in m.distributions()))"], capture_output=True, text=True).stdout.strip()
    peer_version = subprocess.run([python, "-c", "import importlib.metadata as m; print(', '.join("
                                   "f'{d} {m.version(d)}' for d in ('llamafactory', 'torch', 'transformers', "
                                   "'peft', 'trl')))"], capture_output=True, text=True).stdout.strip()
    work = Path(tempfile.mkdtemp(prefix="ftcore-peers-"))
    try:
        model = work / "llama3-68m"
        build_model(model)
        runs: dict[str, list[dict]] = {"ftcore": [], "llamafactory": []}
        for i in range(args.rounds):
            for arm in (("llamafactory", "ftcore") if i % 2 == 0 else ("ftcore", "llamafactory")):
                name = f"{arm}{i}"
                if arm == "ftcore":
                    spec = {"plan": str(ftcore_plan(work, model, args, name)), "warmup": args.warmup}
                    runs[arm].append(run_arm(arm, ours, spec, work, name))
                else:
                    spec = {"config": peer_config(work, model, args, name), "warmup": args.warmup}
                    runs[arm].append(run_arm(arm, python, spec, work, name))
                print(f"  {name}: {runs[arm][-1]['tokens_per_s']:.0f} tokens/s, "
                      f"{runs[arm][-1]['wall_s']:.1f} s wall", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report(runs, args, peer_version, machine(), ours_version)


def tiny(args) -> None:
    """ftcore's arm of the job for 3 steps, printed as the full run prints an arm."""
    args.steps, args.warmup = 3, 1
    work = Path(tempfile.mkdtemp(prefix="ftcore-peers-"))
    try:
        model = work / "llama3-68m"
        build_model(model)
        spec = {"plan": str(ftcore_plan(work, model, args, "ftcore")), "warmup": args.warmup}
        result = run_arm("ftcore", Path(sys.executable), spec, work, "ftcore")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result))


def report(runs: dict[str, list[dict]], args, peer_version: str, where: str, ours_version: str) -> None:
    med = {arm: {k: statistics.median(r[k] for r in rs) for k in
                 ("tokens_per_s", "peak_rss_mib", "wall_s", "startup_s", "cpu_s")} for arm, rs in runs.items()}
    same = runs["ftcore"][0]["real_per_step"] == runs["llamafactory"][0]["real_per_step"]
    gaps = [abs(runs["ftcore"][0]["losses"][s] - runs["llamafactory"][0]["losses"][s])
            for s in runs["ftcore"][0]["losses"] if s in runs["llamafactory"][0]["losses"]]
    print(f"machine: {where}")
    print(f"ftcore: {ours_version}")
    print(f"peer: {peer_version}")
    print(f"job: {args.steps} steps, batch 4, max_length 512, LoRA r=16 all linear, fp32, "
          f"{'packing on both sides' if args.packing else 'no packing'}; {args.rounds} alternating pairs; "
          f"same real tokens at every step: {same} ({sum(runs['ftcore'][0]['real_per_step']):,} in all); "
          f"largest loss difference at any step: {max(gaps):.4f}")
    print()
    print("| measure (median of runs) | ftcore | LLaMA-Factory | ratio ftcore/LLaMA-Factory |")
    print("|---|---:|---:|---:|")
    for key, label, fmt in (("tokens_per_s", "train tokens/s", "{:.0f}"), ("peak_rss_mib", "peak RSS (MiB)", "{:.0f}"),
                            ("wall_s", "wall time (s)", "{:.1f}"), ("startup_s", "start-up to first step (s)", "{:.1f}"),
                            ("cpu_s", "CPU time (s)", "{:.1f}")):
        a, b = med["ftcore"][key], med["llamafactory"][key]
        print(f"| {label} | {fmt.format(a)} | {fmt.format(b)} | {a / b:.2f} |")
    for step in LOSS_STEPS:
        a = runs["ftcore"][0]["losses"].get(str(step))
        b = runs["llamafactory"][0]["losses"].get(str(step))
        if a is not None and b is not None:
            print(f"| loss at step {step} (first run) | {a:.4f} | {b:.4f} | |")
    ratios = [f["tokens_per_s"] / p["tokens_per_s"] for f, p in zip(runs["ftcore"], runs["llamafactory"])]
    print()
    print(f"tokens/s ratio per pair: {', '.join(f'{r:.2f}' for r in ratios)}")
    if args.json:
        args.json.write_text(json.dumps({"runs": runs, "median": med, "same_tokens": same, "peer": peer_version,
                                         "ftcore": ours_version}))


if __name__ == "__main__":
    main()
