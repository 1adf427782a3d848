"""Operators and host syncs in one training step on a packed batch: ftcore's ``sft`` against TRL's
``SFTTrainer`` on the same batch, counted with ``torch.profiler`` on the CPU. A GPU proxy that CI holds:
on a GPU each operator is at least one kernel launch, and each host sync stalls the launches until the
GPU has caught up, so a step whose operators grow with the samples in it, or whose syncs grow with the
samples or the layers, is slow there whatever a CPU says.

    python benchmarks/step_ops.py                       # 2 and 4 layers x about 8 and 32 samples a step
    python benchmarks/step_ops.py --tiny                # what the tests run: 1 and 2 layers
    python benchmarks/step_ops.py --arms trl ftcore     # ftcore: the CPU's default path only

Every arm trains the same random-init Llama (hidden 64, LoRA r=16 on every linear layer) saved once, on
the same token ids (chat rows of a BPE tokenizer trained on them), packed best-fit into bins of
``max_length`` by TRL, batch of 4 bins, and is profiled from ``on_step_begin`` to ``on_step_end`` of
its third step (forward, backward, clipping, the stability guard, the optimizer step; the batch is
collated before the step begins). The arms:

* ``trl``: ``trl.SFTTrainer(packing=True)``: its padding-free row, SDPA with transformers' mask over
  the row, TRL's fused LM-head loss;
* ``ftcore``: ``ftcore run`` of a plan with ``packing = true`` and the defaults of this machine;
* ``ftcore:PATH``: the same with ``packed_attention = PATH`` (``sdpa_block``: the GPU's fallback, which
  runs here; ``sdpa_per_sample``: the CPU's default).

Counted: ``aten::`` operators (nested ones too: an ``aten::linear`` and the ``aten::addmm`` it calls
are two), and host syncs: ``aten::_local_scalar_dense`` (``.item()``, ``bool()``, ``float()`` of a
tensor), ``aten::nonzero`` (a shape that depends on the data: a GPU must finish first), and
``Tensor.tolist()`` calls (counted in Python; on a CPU they are no operator).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import random
import shutil
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bench import ROOT, machine, quiet, run_ftcore  # noqa: E402

PROFILED_STEP = 3  # the first steps build the optimizer's state and warm caches
SYNC_OPERATORS = ("aten::_local_scalar_dense", "aten::nonzero")
LORA = dict(r=16, lora_alpha=32, lora_dropout=0.0)
MAX_LENGTH, BATCH = 256, 4

PLAN = """
[run]
name = "{name}"
seed = 7
output_dir = "{runs}"

[model]
use = "hf"
path = "{model}"
dtype = "float32"

[template]
use = "chatml"

[data.rows]
use = "jsonl"
path = "{rows}"

[[stage]]
name = "sft"
trainer = "sft"
data = "rows"
adapter = {{ use = "lora", r = 16, lora_alpha = 32, lora_dropout = 0.0 }}
max_steps = {steps}
batch_size = {batch}
max_length = {max_length}
learning_rate = 2e-4
logging_steps = 1000
save_steps = 1000000
packing = true
{extra}
"""


class StepProfile:
    """A Trainer callback (installed into every Trainer built afterwards) that profiles one step."""

    def __init__(self, step: int):
        import torch
        from transformers import TrainerCallback

        self.step, self.result, self._profile, self._tolist = step, None, None, None
        outer = self

        class Callback(TrainerCallback):
            def on_step_begin(self, args, state, control, **kw):
                if state.global_step + 1 == outer.step:
                    outer._start(torch)

            def on_step_end(self, args, state, control, **kw):
                if outer._profile is not None:
                    outer._stop(torch)

            def on_train_begin(self, args, state, control, model=None, **kw):
                outer.samples, outer.positions = [], []
                outer._hook = model.register_forward_pre_hook(outer._count, with_kwargs=True)

            def on_train_end(self, args, state, control, **kw):
                outer._hook.remove()

        self.callback = Callback()

    def _count(self, module, args, kwargs):
        if self._profile is not None and module.training:
            self.positions.append(kwargs["input_ids"].numel())
            self.samples.append(kwargs["position_ids"])  # counted once the profile stops

    def _start(self, torch) -> None:
        calls = Counter()
        original = torch.Tensor.tolist

        def tolist(tensor):
            calls["tolist"] += 1
            return original(tensor)

        torch.Tensor.tolist, self._tolist = tolist, (original, calls)
        # with_stack: the Python frames become the operators' parents, which say where a sync comes from
        self._profile = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], with_stack=True)
        self._profile.__enter__()

    def _stop(self, torch) -> None:
        self._profile.__exit__(None, None, None)
        original, calls = self._tolist
        torch.Tensor.tolist = original
        events = self._profile.events()
        self._profile = None
        aten = [e for e in events if e.name.startswith("aten::")]
        syncs, host_steps, where = Counter({name: 0 for name in SYNC_OPERATORS}), 0, Counter()
        for e in aten:
            if e.name not in SYNC_OPERATORS:
                continue
            parents = list(ancestors(e))
            frames = [s for s in parents if ".py(" in s]
            # torch.optim's record_function scope, or its Python frames (torch 2.11's profiler links no
            # frames as parents, so the scope is what finds them there)
            if e.name == "aten::_local_scalar_dense" and any(
                    s.startswith("Optimizer.step#") or "torch/optim/" in s for s in parents):
                host_steps += 1  # torch's step counters: host tensors unless the optimizer is fused or capturable
                continue
            syncs[e.name] += 1
            caller = next((f for f in frames if "site-packages/torch/" not in f), "?")
            where[caller.split("site-packages/")[-1].split("/work/main/")[-1]] += 1
        syncs["tolist"] = calls["tolist"]
        self.result = {"operators": len(aten), "syncs": sum(syncs.values()), "sync_kinds": dict(syncs),
                       "sync_scopes": dict(where), "optimizer_host_steps": host_steps,
                       "positions": sum(self.positions),
                       # each sample starts at position 0 (the bins' padding continues the last sample)
                       "samples": sum(int((ids == 0).sum()) for ids in self.samples)}

    def install(self) -> StepProfile:
        import transformers.trainer

        defaults = transformers.trainer.DEFAULT_CALLBACKS
        defaults[:] = [c for c in defaults if not getattr(c, "_step_profile", False)] + [self.callback]
        self.callback._step_profile = True
        return self


def ancestors(event):
    """The names of the profiler scopes and operators an event ran inside, innermost first."""
    parent = event.cpu_parent
    while parent is not None:
        yield parent.name
        parent = parent.cpu_parent


def chat_rows(n: int, words: int, seed: int = 0) -> list[dict]:
    """Chat rows of about ``words`` words (log-normal lengths), a fifth of them the prompt."""
    rng = random.Random(seed)
    vocabulary = ["alpha", "beta", "gamma", "delta", "model", "train", "token", "data", "answer", "the", "a"]
    rows = []
    for _ in range(n):
        length = max(4, int(math.exp(rng.gauss(math.log(words), 0.5))))
        prompt = max(2, length // 5)
        rows.append({"messages": [{"role": "user", "content": " ".join(rng.choices(vocabulary, k=prompt))},
                                  {"role": "assistant", "content": " ".join(rng.choices(vocabulary, k=length))}]})
    return rows


def build_model(folder: Path, rows: list[dict], layers: int):
    """A BPE tokenizer trained on the rows and a random-init Llama with ``layers`` layers, saved."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator((m["content"] for r in rows for m in r["messages"]), trainers.BpeTrainer(
        vocab_size=512, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], show_progress=False))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                        additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    config = LlamaConfig(hidden_size=64, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=256, vocab_size=len(tokenizer), max_position_embeddings=MAX_LENGTH,
                         tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return tokenizer


def trl_arm(work: Path, folder: Path, token_ids, tokenizer, profile: StepProfile) -> None:
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM
    from trl import SFTConfig, SFTTrainer

    model = AutoModelForCausalLM.from_pretrained(folder, dtype="float32")
    args = SFTConfig(output_dir=str(work / "trl"), max_steps=PROFILED_STEP, per_device_train_batch_size=BATCH,
                     max_length=MAX_LENGTH, packing=True, learning_rate=2e-4, logging_steps=1000, save_strategy="no",
                     report_to="none", seed=7, bf16=False, dataset_num_proc=None)
    with quiet():
        SFTTrainer(model=model, args=args, train_dataset=token_ids, processing_class=tokenizer,
                   peft_config=LoraConfig(task_type="CAUSAL_LM", target_modules="all-linear", **LORA)).train()


def measure(layers: int, words: int, arms: list[str], rows_per_step: int) -> list[dict]:
    import datasets

    from ftcore_plugins.common.prepare import prepare
    from ftcore_plugins.templates.chatml import ChatMLTemplate

    work = Path(tempfile.mkdtemp(prefix="ftcore-step-ops-"))
    try:
        rows = chat_rows(rows_per_step * (PROFILED_STEP + 2), words)
        (work / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        tokenizer = build_model(work / "model", rows, layers)
        token_ids = prepare(datasets.Dataset.from_list(rows), tokenizer, ChatMLTemplate(),
                            max_length=MAX_LENGTH).dataset
        profile = StepProfile(PROFILED_STEP).install()
        results = []
        for arm in arms:
            profile.result = None
            if arm == "trl":
                trl_arm(work, work / "model", token_ids, tokenizer, profile)
            else:
                path = arm.partition(":")[2]
                plan = work / f"{arm.replace(':', '-')}.toml"
                plan.write_text(PLAN.format(name=arm.replace(":", "-"), runs=work / "runs", model=work / "model",
                                            rows=work / "rows.jsonl", steps=PROFILED_STEP, batch=BATCH,
                                            max_length=MAX_LENGTH,
                                            extra=f'packed_attention = "{path}"' if path else ""))
                run_ftcore(plan)
            if profile.result is None:
                raise SystemExit(f"step_ops: arm {arm} trained fewer than {PROFILED_STEP} steps")
            results.append({"arm": arm, "layers": layers, "words": words, **profile.result})
        return results
    finally:
        shutil.rmtree(work, ignore_errors=True)


def table(results: list[dict]) -> str:
    lines = ["| layers | samples in the step | arm | positions | aten operators | x TRL | host syncs | "
             "(_local_scalar_dense, nonzero, tolist) |", "|---:|---:|---|---:|---:|---:|---:|---|"]
    trl = {(r["layers"], r["words"]): r for r in results if r["arm"] == "trl"}
    for r in results:
        base = trl.get((r["layers"], r["words"]))
        ratio = f"{r['operators'] / base['operators']:.2f}" if base else "n/a"
        kinds = ", ".join(str(v) for v in r["sync_kinds"].values())
        lines.append(f"| {r['layers']} | {r['samples']} | {r['arm']} | {r['positions']} | {r['operators']:,} | "
                     f"{ratio} | {r['syncs']} | {kinds} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="1 and 2 layers (what the tests run)")
    parser.add_argument("--layers", type=int, nargs="+", help="layer counts (default 2 4; tiny 2)")
    parser.add_argument("--words", type=int, nargs="+", default=[48, 10],
                        help="median words a row: fewer words, more samples in a step (default 48 10)")
    parser.add_argument("--arms", nargs="+", default=["trl", "ftcore", "ftcore:sdpa_block"],
                        help="trl, ftcore, ftcore:PATH (a packed_attention value)")
    parser.add_argument("--json", type=Path, help="also write the measurements here (JSON lines)")
    parser.add_argument("--append-results", action="store_true", help="append the table to benchmarks/RESULTS.md")
    args = parser.parse_args()
    layers = args.layers or ([1, 2] if args.tiny else [2, 4])
    results = []
    for n in layers:
        for words in args.words:
            for result in measure(n, words, args.arms, rows_per_step=BATCH * 12):
                results.append(result)
                print(json.dumps(result), flush=True)
                if args.json:
                    with args.json.open("a", encoding="utf-8") as fh:
                        fh.write(json.dumps(result) + "\n")
    out = table(results)
    header = f"step {PROFILED_STEP} of each arm, batch {BATCH} bins of {MAX_LENGTH}; machine: {machine()}"
    print(header)
    print()
    print(out)
    if args.append_results:
        with (ROOT / "benchmarks" / "RESULTS.md").open("a", encoding="utf-8") as fh:
            fh.write(f"\n### step_ops, {datetime.date.today()}\n\n{header}\n\n{out}\n")


if __name__ == "__main__":
    main()
