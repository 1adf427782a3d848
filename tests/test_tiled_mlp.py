"""tiled_mlp = true: each decoder layer's MLP runs over shards of the row by DeepSpeed's TiledMLP while a
stage trains. It must train as the untiled MLP does (same losses, same weights), with several shards used,
leave the model's own forwards in place afterwards, and be refused in one line where it cannot run."""

from __future__ import annotations

import copy
import importlib.util
import random

import pytest

from ftcore.testing import ANIMALS, OTHERS, run_ftcore, stage_context, tiny_model, write_jsonl, write_plan

pytest.importorskip("deepspeed")

HIDDEN = 32  # shards = ceil(tokens / hidden_size): rows of ~200 tokens run in 7


def long_rows(n: int, words: int = 180, seed: int = 0) -> list[dict]:
    """Chat rows of ~``words`` + 10 tokens (the tiny tokenizer has a token per word)."""
    rng = random.Random(seed)
    return [{"messages": [{"role": "user", "content": " ".join(rng.choice(ANIMALS + OTHERS) for _ in range(words))},
                          {"role": "assistant", "content": f"the {rng.choice(ANIMALS)}"}]} for _ in range(n)]


def _plan(tmp_path, tiled: bool, **stage):
    write_jsonl(tmp_path / "long.jsonl", long_rows(8))
    return write_plan(tmp_path, {
        "run": {"name": f"tiled{int(tiled)}"},
        "model": {"hidden_size": HIDDEN, "intermediate_size": 64, "num_heads": 2, "max_position_embeddings": 512},
        "data": {"long": {"use": "jsonl", "path": "long.jsonl"}},
        "stage": [{"name": "s", "trainer": "sft", "data": "long", "adapter": "lora", "max_steps": 4, "batch_size": 2,
                   "max_length": 256, "learning_rate": 0.01, "logging_steps": 1, "save_steps": 100,
                   "tiled_mlp": tiled, **stage}]}, name=f"tiled{int(tiled)}.toml")


@pytest.mark.slow
def test_tiled_mlp_trains_as_the_whole_mlp(tmp_path):
    """Four LoRA SFT steps on rows of ~200 tokens: the same losses and the same adapter weights with and
    without tiling, and the tiled run did run its MLPs in several shards."""
    from safetensors.torch import load_file

    runs = {t: run_ftcore("run", _plan(tmp_path, t), cwd=tmp_path, in_process=True).check() for t in (False, True)}
    losses = {t: r.losses("s") for t, r in runs.items()}
    assert len(losses[True]) == 4 and losses[True] == pytest.approx(losses[False], abs=1e-5)
    tiled = [m for m in runs[True].metrics if "tiled_mlp_shards" in m]
    assert len(tiled) == 1 and tiled[0]["tiled_mlp_layers"] == 2, tiled  # the tiny model's 2 layers
    assert tiled[0]["tiled_mlp_shards"] > 1, tiled  # ceil(~200 / 32) = 7
    assert not any("tiled_mlp_shards" in m for m in runs[False].metrics)
    log = (runs[True].run_dir / "run.log").read_text()
    assert log.count("tiled_mlp: 2 MLPs (LlamaMLP) of 2 decoder layers tiled") == 1, log
    weights = {t: load_file(r.run_dir / "stages" / "s" / "output" / "adapter_model.safetensors")
               for t, r in runs.items()}
    assert weights[True].keys() == weights[False].keys()
    assert any("mlp" in k for k in weights[True])  # the tiled MLPs' LoRA weights trained too
    for key, value in weights[False].items():
        assert (weights[True][key] - value).abs().max().item() < 1e-5, key


def test_forwards_are_restored_after_the_stage(tmp_path, monkeypatch):
    """While the stage trains, each MLP runs through TiledMLP; afterwards the MLPs run their class's forward
    again (no TiledMLP call in a forward with gradients, nor in generation), and an instance's own forward
    that was there before is put back."""
    import torch
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    from ftcore_plugins.trainers.sft import SFT

    calls = []
    apply = TiledMLP.apply
    monkeypatch.setattr(TiledMLP, "apply", staticmethod(lambda *a: calls.append(a[3]) or apply(*a)))
    rows = long_rows(4)
    tiny = tiny_model(tmp_path, hidden_size=HIDDEN, num_heads=2, intermediate_size=64, max_position_embeddings=512,
                      rows=rows)
    layers = tiny.model.model.layers
    own = layers[1].mlp.forward  # an instance's own forward (a bound method, as a hook library leaves)
    layers[1].mlp.forward = own
    trainer = SFT(SFT.Options(max_steps=1, batch_size=2, max_length=256, logging_steps=1, save_steps=100,
                              tiled_mlp=True))
    ctx = stage_context(tiny, tmp_path, rows)
    trainer.train(ctx)
    assert calls and max(calls) > 1, calls  # both MLPs, several shards
    assert any("tiled_mlp: 2 MLPs" in line for line in ctx.reporter.infos), ctx.reporter.infos
    mlps = [layer.mlp for layer in ctx.model.model.layers]
    assert "forward" not in mlps[0].__dict__ and mlps[0].forward.__func__ is type(mlps[0]).forward
    assert mlps[1].__dict__["forward"] is own
    calls.clear()
    ids = tiny.tokenizer(rows[0]["messages"][0]["content"], return_tensors="pt").input_ids
    ctx.model.train()
    ctx.model(input_ids=ids, labels=ids).loss.backward()
    ctx.model.eval()
    ctx.model.generate(ids[:, :50], max_new_tokens=3, do_sample=False)
    assert not calls


def _llama(**config):
    import torch
    import transformers

    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        **config))


def test_an_mlp_that_alone_trains_gets_its_gradients():
    """Only the MLPs train (as with LoRA on their projections alone): the first layer's MLP input needs no
    gradient, and a Function's backward runs only for an input that does; the weights' gradients must still
    be the untiled ones."""
    import torch

    from ftcore_plugins.trainers._tiled_mlp import tiled_mlps

    model = _llama()
    for name, p in model.named_parameters():
        p.requires_grad_(".mlp." in name)
    ids = torch.randint(0, 64, (2, 100))
    model(input_ids=ids, labels=ids).loss.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    with tiled_mlps(model, True) as seen:
        model(input_ids=ids, labels=ids).loss.backward()
    assert seen == {"layers": 2, "shards": 4}  # ceil(100 / 32)
    assert all("forward" not in layer.mlp.__dict__ for layer in model.model.layers)  # the class's forward again
    for name, grad in expected.items():
        got = dict(model.named_parameters())[name].grad
        assert got is not None and torch.allclose(got, grad, atol=1e-6), name


def test_models_without_a_dense_mlp_and_dropout_are_refused():
    """A mixture of experts is not a dense MLP: a model of them alone has nothing to tile, and one with
    both gets its dense MLPs tiled only; dropout inside an MLP (which the backward would redraw) is refused."""
    import transformers

    from ftcore.errors import FtcoreError
    from ftcore_plugins.trainers._tiled_mlp import tiled_mlps

    moe = transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=64, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_local_experts=4, num_experts_per_tok=2))
    with pytest.raises(FtcoreError, match=r"^stage s: tiled_mlp: MixtralForCausalLM has 2 decoder layers and their "
                                          r"feed-forward blocks are mixtures of experts \(MixtralSparseMoeBlock\)"):
        with tiled_mlps(moe, True, stage="s"):
            pass
    model = _llama()
    mixed = copy.deepcopy(model)
    mixed.model.layers[1].mlp.experts = transformers.models.llama.modeling_llama.LlamaMLP(model.config)
    with tiled_mlps(mixed, True) as seen:
        assert seen["layers"] == 1 and "forward" in mixed.model.layers[0].mlp.__dict__
        assert "forward" not in mixed.model.layers[1].mlp.__dict__
    from peft import LoraConfig, get_peft_model

    lora = get_peft_model(model, LoraConfig(r=4, target_modules=["up_proj"], lora_dropout=0.1))
    with pytest.raises(FtcoreError, match=r"tiled_mlp: the MLPs hold dropout \(p = 0.1"):
        with tiled_mlps(lora, True):
            pass
    assert all("forward" not in layer.mlp.__dict__ for layer in lora.base_model.model.model.layers)
    with pytest.raises(FtcoreError, match="only DeepSpeed's engine waits"):
        with tiled_mlps(_llama(), True, distributed_engine=False):
            pass


def _validate(tmp_path, overrides):
    r = run_ftcore("validate", write_plan(tmp_path, overrides), cwd=tmp_path, in_process=True)
    return r.exit_code, (r.stdout + r.stderr).strip().splitlines()


def _stage(**options):
    return {"stage": [{"name": "s", "trainer": "sft", "data": "chat", "adapter": "lora", "tiled_mlp": True, **options}]}


def test_validate_refuses_without_deepspeed(tmp_path, monkeypatch):
    code, lines = _validate(tmp_path, _stage())
    assert code == 0, lines
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: None if name == "deepspeed" else find_spec(name, *a, **k))
    code, lines = _validate(tmp_path, _stage())
    assert code == 2 and len(lines) == 1, lines
    assert "stage[0].tiled_mlp: runs each MLP with DeepSpeed's TiledMLP, and DeepSpeed is not installed" in lines[0]
    code, lines = _validate(tmp_path, {"stage": [{"name": "s", "trainer": "sft", "data": "chat", "tiled_mlp": False}]})
    assert code == 0, lines  # off: DeepSpeed is not needed


@pytest.mark.parametrize("overrides,expected", [
    ({**_stage(), "distributed": {"nproc_per_node": 2}},
     "stage[0].tiled_mlp: the backward of a tiled MLP adds its weights' gradients shard by shard, which "
     "engine = \"ddp\""),
    ({**_stage(), "model": {"architecture": "t5"}},
     "stage[0].tiled_mlp: tiles a decoder-only model's MLPs, and this model is an encoder-decoder (t5)"),
    ({"stage": [{"name": "s", "trainer": "ppo", "data": "chat", "tiled_mlp": True, "reward": ["r"]}],
      "reward": {"r": {"use": "contains", "words": ["cat"]}}},
     "stage[0].tiled_mlp: trainer 'ppo' runs its own rollout and update loop, which does not tile the MLPs"),
])
def test_validate_refuses_where_it_cannot_run(tmp_path, overrides, expected):
    code, lines = _validate(tmp_path, overrides)
    assert code == 2 and len(lines) == 1 and expected in lines[0], lines
