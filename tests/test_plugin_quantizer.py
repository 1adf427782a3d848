"""docs/writing-plugins.md's third-party quantizer, the code as the docs print it: registered through the
same hook as the built-in ones, it trains a LoRA on float8 weights through a plan, refuses what it cannot
do at validation, and its run's merged export folds the adapter into the full-precision base."""

from __future__ import annotations

import json
import re
import shutil
import types
from pathlib import Path

import pytest

from conftest import chat_rows, write_jsonl

DOCS = Path(__file__).resolve().parent.parent / "docs" / "writing-plugins.md"
PLAN = """
[run]
name = "q"
seed = 3

[model]
use = "hf"
path = "base"

[quantizer]
use = "acme-fp8"

[template]
use = "chatml"
{adapter}
[data.chat]
use = "jsonl"
path = "chat.jsonl"

[[stage]]
name = "sft"
trainer = "sft"
data = "chat"
max_steps = 8
batch_size = 8
max_length = 64
learning_rate = 1e-2
logging_steps = 1

[[export]]
use = "merged"
"""
LORA = '\n[adapter]\nuse = "lora"\nr = 8\n'


def docs_plugin() -> types.ModuleType:
    block = re.search(r"```python\n(# acme_ftcore_quant/__init__\.py.*?)```", DOCS.read_text(), re.S).group(1)
    module = types.ModuleType("acme_ftcore_quant")
    exec(compile(block, str(DOCS), "exec"), module.__dict__)
    return module


def plugin_manager():
    from ftcore.plugins import PluginInfo, get_plugin_manager

    pm = get_plugin_manager(entry_points=False)
    pm.add_plugin(docs_plugin(), PluginInfo("acme_quant", "acme-ftcore-quant", "1.0", "entry point"))
    pm.check_pending()
    assert not pm.registry().problems
    return pm


def load(folder: Path, body: str, pm=None):
    from ftcore.plan import load_plan

    (folder / "plan.toml").write_text(body)
    return load_plan(folder / "plan.toml", (pm or plugin_manager()).registry())


@pytest.fixture
def project(tmp_path, tiny_llama):
    shutil.copytree(tiny_llama, tmp_path / "base")
    write_jsonl(tmp_path / "chat.jsonl", chat_rows(64))
    return tmp_path


def test_the_docs_quantizer_registers_and_refuses_full_fine_tuning(project):
    from ftcore.errors import PlanError

    registry = plugin_manager().registry()
    assert registry.resolve("quantizer", "acme-fp8").cls.__name__ == "QuantoFloat8"
    with pytest.raises(PlanError) as err:
        load(project, PLAN.format(adapter=""))
    assert "stage 'sft': quantizer 'acme-fp8' trains a peft adapter only" in str(err.value)


@pytest.mark.slow
def test_the_docs_quantizer_trains_lora_on_float8_weights_and_merges_into_full_precision(project):
    pytest.importorskip("optimum.quanto")
    import torch
    from rich.console import Console
    from transformers import AutoModelForCausalLM

    from ftcore.runner import Runner

    pm = plugin_manager()
    plan = load(project, PLAN.format(adapter=LORA), pm)
    seen = {}
    cls = pm.registry().resolve("quantizer", "acme-fp8").cls
    original = cls.prepare

    def prepare(self, model):  # look at the loaded model: the docs' code leaves it to transformers and quanto
        seen["weights"] = {type(m.weight).__name__ for n, m in model.named_modules() if n.endswith("q_proj")}
        seen["dtype"] = {m.weight._data.dtype for n, m in model.named_modules() if n.endswith("q_proj")}
        return original(self, model)

    cls.prepare = prepare
    with open(project / "console.txt", "w") as out:
        Runner(plan, pm, Console(file=out, width=200)).run()
    assert seen == {"weights": {"WeightQBytesTensor"}, "dtype": {torch.float8_e4m3fn}}
    run = project / "runs" / "q"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if r.get("stage") == "sft" and "loss" in r]
    assert len(losses) == 8 and losses[-1] < losses[0] - 0.5, losses
    export = next(r for r in rows if r.get("stage") == "export:merged")
    assert export["max_abs_logit_diff"] <= 1e-4 < export["max_abs_logit_diff_vs_quantized_adapter"]
    merged = AutoModelForCausalLM.from_pretrained(run / "exports" / "merged")
    assert next(merged.parameters()).dtype == torch.float32
