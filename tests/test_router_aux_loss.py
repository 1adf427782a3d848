"""The router's auxiliary (load-balancing) loss of a mixture of experts: one rule for every trainer.

Off unless the stage sets ``router_aux_loss_coef``, whatever the model's config says: TRL's DPOTrainer used to
add Qwen3-MoE's own 0.001 x aux (a step-1 loss of 0.6952 where ln 2 = 0.6931 is the loss against a fresh
reference) while ftcore's SFT loss added nothing. On a tiny Qwen3-MoE whose config asks for router logits,
each trainer's first logged loss is the same as on the same model without them; with the option, the logged
``aux_loss`` is positive and the loss is higher by exactly ``coef x aux_loss``. ``ftcore validate`` refuses the
option in one line where the model is known to have no router loss, or the trainer's loss cannot take it."""

from __future__ import annotations

import copy
import math

import pytest

from conftest import chat_rows, run_cli, text_rows
from test_preference import pair_rows

torch = pytest.importorskip("torch")
pytest.importorskip("trl")

MOE = dict(num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
           decoder_sparse_step=1, mlp_only_layers=[])
COEF = 0.5  # large enough that coef x aux stands far above float noise


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """A tiny Qwen3-MoE (ChatML) whose config asks for router logits, as a checkpoint's may."""
    from ftcore.testing import tiny_model

    rows = chat_rows(64) + text_rows(64)
    tiny = tiny_model(tmp_path_factory.mktemp("moe"), hidden_size=32, num_layers=2, num_heads=4, vocab_size=300,
                      rows=rows, architecture="qwen3_moe", intermediate_size=64, config=MOE)
    tiny.model.config.output_router_logits = True
    assert tiny.model.config.router_aux_loss_coef == 0.001  # the architecture's own, which TRL used to add
    return tiny


def stage(tmp_path, tiny, rows, trainer, adapter: str = "lora", **fields):
    """The trainer's StageContext on a fresh copy of the model, with its adapter applied as the runner does."""
    from ftcore.context import AdapterContext
    from ftcore.testing import RecordingReporter, stage_context
    from ftcore_plugins.adapters.full import FullAdapter
    from ftcore_plugins.adapters.lora import LoraAdapter

    model = tiny.copy()
    component = LoraAdapter(LoraAdapter.Options(r=8, lora_alpha=16)) if adapter == "lora" else FullAdapter()
    model.model = component.apply(model.model, AdapterContext(None, RecordingReporter(), None))
    return stage_context(model, tmp_path, rows, stage=trainer, adapter=component, continues_adapter=False, **fields)


def first_step(tmp_path, tiny, trainer: str, coef: float | None, rows, **options):
    """The first logged step's record (loss, aux_loss, ...) of ``trainer`` trained one step, and the config after."""
    from ftcore.plugins import get_plugin_manager

    registry = get_plugin_manager(entry_points=False).registry()
    cls = registry.resolve("trainer", trainer).cls
    o = cls.Options(max_steps=1, batch_size=4, max_length=64, logging_steps=1, save_steps=1000,
                    **({"router_aux_loss_coef": coef} if coef is not None else {}), **options)
    ctx = stage(tmp_path / f"{trainer}-{coef}", tiny, rows, trainer)
    cls(o).train(ctx)
    record = next(r for r in ctx.reporter.records if r.get("step") == 1 and "loss" in r)
    config = ctx.model.config
    return record, ctx.reporter, (config.output_router_logits, config.router_aux_loss_coef)


TRAINERS = {  # trainer: its rows and options
    "sft": (chat_rows(16), {}),
    "pretrain": (text_rows(16), {}),
    "dpo": (pair_rows(16, 0), {}),
    "kto": (pair_rows(16, 0), {}),
    "orpo": (pair_rows(16, 0), {}),
}


@pytest.mark.slow
@pytest.mark.parametrize("trainer", list(TRAINERS))
def test_the_router_loss_is_off_by_default_and_added_with_the_option(moe, tmp_path, trainer):
    rows, options = TRAINERS[trainer]
    plain = copy.copy(moe)
    plain.model = copy.deepcopy(moe.model)
    plain.model.config.output_router_logits = False  # the same weights, a config without router logits

    off, _, after = first_step(tmp_path, moe, trainer, None, rows, **options)
    without, _, _ = first_step(tmp_path / "plain", plain, trainer, None, rows, **options)
    on, reporter, after_on = first_step(tmp_path, moe, trainer, COEF, rows, **options)
    print(f"\n{trainer}: loss unset {off['loss']:.6f}, without router logits {without['loss']:.6f}, "
          f"router_aux_loss_coef = {COEF}: loss {on['loss']:.6f}, aux_loss {on['aux_loss']:.6f} "
          f"(loss - {COEF} x aux = {on['loss'] - COEF * on['aux_loss']:.6f})")

    # Unset: the loss of the model without router logits, whatever its config asked; no aux_loss logged.
    assert "aux_loss" not in off
    assert off["loss"] == pytest.approx(without["loss"], abs=1e-5)
    if trainer == "dpo":  # a fresh adapter: the policy is its reference, and DPO's loss is ln 2
        assert off["loss"] == pytest.approx(math.log(2), abs=1e-4)
    # Set: the load-balancing loss (>= 1 for top-k routing: num_experts x sum f_i P_i), logged apart,
    # and added with the coefficient.
    assert on["aux_loss"] > 0.5
    assert on["loss"] - off["loss"] == pytest.approx(COEF * on["aux_loss"], rel=1e-3, abs=1e-5)
    assert any("aux_loss" in r for r in reporter.records if r.get("step") == 1)
    # The option holds for its stage: the model's config is as it came afterwards.
    assert after == after_on == (True, 0.001)


ONLINE = {  # trainer: its options beside the reward; a record of the first step has this key
    "grpo": (dict(num_generations=2, max_completion_length=4, max_length=64), "reward"),
    "rloo": (dict(num_generations=2, max_completion_length=4, max_length=64), "reward"),
    "ppo": (dict(max_new_tokens=4, ppo_epochs=1), "loss/policy"),
}


@pytest.mark.slow
@pytest.mark.parametrize("trainer", list(ONLINE))
def test_generating_trainers_add_and_log_the_router_loss(moe, tmp_path, trainer):
    """The trainers that sample completions: with the option ``aux_loss`` is logged (it is in the loss they
    step on); unset, none is. Generation keeps the model's router logits off (transformers' MoE models fail to
    generate with them on)."""
    from ftcore.plugins import get_plugin_manager
    from ftcore_plugins.rewards.contains import Contains

    cls = get_plugin_manager(entry_points=False).registry().resolve("trainer", trainer).cls
    options, key = ONLINE[trainer]
    rewards = {"animal": Contains(Contains.Options(words=["cat", "dog", "bird", "fox"]))}
    logged = {}
    for coef in (None, COEF):
        ctx = stage(tmp_path / f"{trainer}-{coef}", moe, chat_rows(8), trainer, rewards=rewards)
        o = cls.Options(reward=["animal"], max_steps=1, batch_size=4, save_steps=100, logging_steps=1, **options,
                        **({"router_aux_loss_coef": coef} if coef else {}))
        cls(o).train(ctx)
        logged[coef] = next(r for r in ctx.reporter.records if any(k.startswith(key) for k in r))
        assert (ctx.model.config.output_router_logits, ctx.model.config.router_aux_loss_coef) == (True, 0.001)
    print(f"\n{trainer}: aux_loss {logged[COEF]['aux_loss']:.6f} with router_aux_loss_coef = {COEF}")
    assert "aux_loss" not in logged[None]
    assert logged[COEF]["aux_loss"] > 0.5


def test_the_option_on_a_model_without_router_loss_is_ignored_and_said(tmp_path):
    from ftcore.testing import RecordingReporter, tiny_model
    from ftcore_plugins.trainers._router import apply_router_aux
    from ftcore_plugins.trainers.sft import SFT

    from types import SimpleNamespace

    dense = tiny_model(tmp_path, hidden_size=32, num_layers=1, num_heads=2, vocab_size=300)
    ctx = SimpleNamespace(model=dense.model, reporter=RecordingReporter(), stage="sft")
    coef, restore = apply_router_aux(ctx, SFT.Options(router_aux_loss_coef=0.01))
    restore()
    assert coef == 0.0
    assert ctx.reporter.warnings == ["stage sft: router_aux_loss_coef = 0.01 ignored: the llama model has no router "
                                     "loss (not a mixture of experts, or one whose routers balance without an "
                                     "auxiliary loss)"]


@pytest.mark.parametrize("architecture,trainer,refused", [
    ("llama", "sft", "stage[0].router_aux_loss_coef: this 'llama' model has no router loss"),
    ("deepseek_v3", "sft", "stage[0].router_aux_loss_coef: this 'deepseek_v3' model has no router loss"),
    ("qwen3_moe", "reward", "stage[0].router_aux_loss_coef: trainer 'reward' trains a sequence-classification head"),
    ("qwen3_moe", "sft", None),
])
def test_validate_refuses_the_option_where_it_cannot_apply(tiny_project, architecture, trainer, refused):
    from conftest import write_jsonl

    write_jsonl(tiny_project.dir / "pairs.jsonl", pair_rows(8, 0))
    data = "pairs" if trainer == "reward" else "chat"
    plan = tiny_project(f'[data.pairs]\nuse = "jsonl"\npath = "pairs.jsonl"\n\n[[stage]]\nname = "s"\n'
                        f'trainer = "{trainer}"\ndata = "{data}"\nrouter_aux_loss_coef = 0.01\n')
    plan.write_text(plan.read_text().replace('use = "scratch"', f'use = "scratch"\narchitecture = "{architecture}"'))
    r = run_cli("validate", str(plan))
    if refused is None:
        assert r.returncode == 0, r.stdout + r.stderr
        return
    assert r.returncode == 2, r.stdout + r.stderr
    lines = [line for line in r.stderr.splitlines() if "router_aux_loss_coef" in line]
    assert len(lines) == 1 and f"{plan}: {refused}" in lines[0], r.stderr
