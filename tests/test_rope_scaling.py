"""``[model] rope_scaling`` (issue #43, long context): a tiny Llama trained at 4x its context with YaRN, the
scaling carried into the merged export and read back by plain transformers; the same plan without it refused in
one line naming the option; each bad setting one line from ``ftcore validate`` (exit 2), read from the files
alone; and the linear, dynamic and longrope configs built as transformers' own checks take them."""

from __future__ import annotations

import json
import logging

import pytest

from conftest import SHARED, chat_rows, one_line_refusal, run_cli, write_jsonl

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

CONTEXT = 64  # the tiny model's max_position_embeddings
SIZES = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
             intermediate_size=64, max_position_embeddings=CONTEXT)
TURNS = 10  # chat turns per row: about 220 tokens, between CONTEXT and 4 x CONTEXT

PLAN = """
[run]
name = "rope"
seed = 7

[model]
use = "hf"
path = "base"
{rope}
[template]
use = "native"

[data.chat]
use = "jsonl"
path = "chat.jsonl"

[[stage]]
name = "sft"
trainer = "sft"
adapter = {{ use = "lora", r = 8 }}
data = "chat"
max_steps = 6
batch_size = 2
max_length = 256
learning_rate = 1e-2
lr_scheduler = "constant"
logging_steps = 1

[[export]]
use = "merged"
"""
YARN = 'rope_scaling = { type = "yarn", factor = 4.0 }\n'


def tokenizer():
    folder = SHARED / "tokenizers" / "qwen25"
    if not folder.exists():
        pytest.skip("../shared/fixtures/tokenizers/qwen25 not present")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def config(model_type: str = "llama", **fields):
    from transformers import AutoConfig

    sizes = dict(n_embd=32, n_layer=1, n_head=2, n_positions=CONTEXT) if model_type == "gpt2" else SIZES
    return AutoConfig.for_model(model_type, **{**sizes, "vocab_size": 151665, **fields})


def model_folder(folder, tok, model_type: str = "llama", **fields):
    """A tiny random-init model saved with the real Qwen2.5 tokenizer."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config(model_type, eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
                                                    **fields))
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def long_rows(n: int) -> list[dict]:
    """Chat rows of TURNS turns each ("Which is an animal? ..." -> "the cat"): longer than CONTEXT tokens."""
    turns = chat_rows(n * TURNS)
    return [{"messages": [m for row in turns[i * TURNS:(i + 1) * TURNS] for m in row["messages"]]} for i in range(n)]


def project(tmp_path, rope: str, model_type: str = "llama", **fields):
    model_folder(tmp_path / "base", tokenizer(), model_type, **fields)
    write_jsonl(tmp_path / "chat.jsonl", long_rows(16))
    plan = tmp_path / "plan.toml"
    plan.write_text(PLAN.format(rope=rope), encoding="utf-8")
    return plan



# -- acceptance -------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_yarn_trains_at_four_times_the_context_and_the_merged_export_keeps_it(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    from ftcore_plugins.models._rope import RopeScaling, scale

    plan = project(tmp_path, YARN)
    done = run_cli("run", str(plan))
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / "runs" / "rope"
    report = json.loads((run / "data_report.json").read_text())["sft/train"]
    # Every row whole, and each far longer than the model's own context.
    assert report["kept"] == 16 and report["truncated"] == 0 and report["length_p50"] > 2 * CONTEXT, report
    losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()
              if '"loss"' in line and '"sft"' in line]
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.1, losses

    merged = run / "exports" / "merged"
    saved = json.loads((merged / "config.json").read_text())
    expected = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": CONTEXT, "rope_theta": 10000.0}
    assert saved["rope_parameters"] == expected and saved["max_position_embeddings"] == 4 * CONTEXT, saved
    assert AutoConfig.from_pretrained(merged).rope_parameters == expected

    # Plain transformers reads the merged folder as the model trained: the merged weights in the base config
    # scaled as ftcore scales it give its logits on a row 4x the base context; in the base config, others.
    reloaded = AutoModelForCausalLM.from_pretrained(merged).eval()
    ids = torch.arange(10, 10 + 4 * CONTEXT)[None]
    base = AutoConfig.from_pretrained(tmp_path / "base")
    scaled = AutoModelForCausalLM.from_config(scale(AutoConfig.from_pretrained(tmp_path / "base"),
                                                    RopeScaling(type="yarn", factor=4.0)))
    unscaled = AutoModelForCausalLM.from_config(base)
    for model in (scaled, unscaled):
        model.load_state_dict(reloaded.state_dict())
        model.eval()
    with torch.no_grad():
        logits = reloaded(ids).logits
        assert torch.allclose(logits, scaled(ids).logits, atol=1e-6)
        assert (logits - unscaled(ids).logits).abs().max() > 1e-3


@pytest.mark.slow
def test_without_rope_scaling_the_longer_max_length_is_refused_naming_it(tmp_path):
    plan = project(tmp_path, "")
    line = one_line_refusal(run_cli("run", str(plan)))
    assert line.startswith(f"{plan}: stage[0].max_length: 256 is longer than the model's context of {CONTEXT}"), line
    assert 'rope_scaling = { type = "yarn", factor = 4.0 }' in line, line
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_a_type_the_family_does_not_take_is_refused_before_the_weights_load(tmp_path):
    # Phi-3's config takes longrope alone (and would read a yarn back as longrope): transformers' own check says
    # so on the config, in the run's pre-flight.
    plan = project(tmp_path, YARN, "phi3", original_max_position_embeddings=CONTEXT)
    line = one_line_refusal(run_cli("run", str(plan)))
    assert line.startswith(f"{plan}: model.rope_scaling: model type 'phi3' does not take type \"yarn\": "), line
    assert "longrope" in line and not (tmp_path / "runs").exists()


# -- bad input: one line from validate, nothing heavy imported ---------------------------------------------

def _validate(plan):
    done = run_cli("validate", str(plan), env={"PYTHONPROFILEIMPORTTIME": "1"}, timeout=300)
    imported = [line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")]
    assert imported and "torch" not in imported and "transformers" not in imported  # read from the files alone
    done.stderr = "".join(line + "\n" for line in done.stderr.splitlines() if not line.startswith("import time:"))
    return done


BAD = {
    "unknown-type": ('{ type = "ntk", factor = 4.0 }', {},
                     "model.rope_scaling.type: input should be 'linear', 'dynamic', 'yarn' or 'longrope'"),
    "factor-1": ('{ type = "yarn", factor = 1.0 }', {}, "model.rope_scaling.factor: input should be greater than 1"),
    "longrope-no-lists": ('{ type = "longrope", factor = 4.0 }', {},
                          'model.rope_scaling.type: "longrope" needs short_factor and long_factor, each a list of 8 '
                          "numbers (head_dim / 2); missing: short_factor, long_factor"),
    "longrope-short-list": ("{ type = \"longrope\", factor = 4.0, short_factor = [1.0, 1.0, 1.0, 1.0], "
                            "long_factor = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0] }", {},
                            "model.rope_scaling.short_factor: 4 numbers, and this model's rotary embedding has 8 "
                            "frequencies (head_dim / 2): give 8"),
    "key-of-another-type": ('{ type = "linear", factor = 4.0, beta_fast = 16.0 }', {},
                            'model.rope_scaling.beta_fast: only with type "yarn" (type is "linear")'),
    "no-rope": ('{ type = "yarn", factor = 4.0 }', {"model_type": "gpt2"},
                "model.rope_scaling: {base}/config.json: model type 'gpt2' has no rotary position embeddings (RoPE)"),
    "already-scaled": ('{ type = "yarn", factor = 4.0 }', {"rope_parameters": {"rope_type": "linear", "factor": 2.0}},
                       "model.rope_scaling: {base}/config.json already sets a RoPE scaling (linear, factor 2.0)"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_rope_scaling_is_one_line_from_validate(tmp_path, case):
    setting, fields, expected = BAD[case]
    fields = dict(fields)
    model_type = fields.pop("model_type", "llama")
    config(model_type, **fields).save_pretrained(tmp_path / "base")  # validate reads config.json alone
    write_jsonl(tmp_path / "chat.jsonl", long_rows(2))
    plan = tmp_path / "plan.toml"
    plan.write_text(PLAN.format(rope=f"rope_scaling = {setting}\n"), encoding="utf-8")
    line = one_line_refusal(_validate(plan))
    assert line.startswith(f"{plan}: " + expected.format(base=tmp_path / "base")), line


def test_a_good_rope_scaling_validates_without_heavy_imports(tmp_path):
    config().save_pretrained(tmp_path / "base")
    write_jsonl(tmp_path / "chat.jsonl", long_rows(2))
    plan = tmp_path / "plan.toml"
    plan.write_text(PLAN.format(rope=YARN), encoding="utf-8")
    done = _validate(plan)
    assert done.returncode == 0 and f"{plan}: OK" in done.stdout, done.stderr


# -- the configs, as transformers takes them --------------------------------------------------------------

SCALINGS = {
    "linear": dict(type="linear", factor=4.0),
    "dynamic": dict(type="dynamic", factor=4.0),
    "yarn": dict(type="yarn", factor=4.0, beta_fast=16.0, beta_slow=2.0, attention_factor=1.2),
    # short factors of 1 (the model's own frequencies up to its context), long ones stretched to 4 at the lowest
    "longrope": dict(type="longrope", factor=4.0, short_factor=[1.0] * 8,
                     long_factor=[1.0 + 3 * i / 7 for i in range(8)]),
}


class Warnings(logging.Handler):
    """transformers' warnings, collected at its library logger (which does not propagate to pytest's)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())

    def __enter__(self):
        logging.getLogger("transformers").addHandler(self)
        return self.messages

    def __exit__(self, *exc):
        logging.getLogger("transformers").removeHandler(self)


def test_transformers_rope_checks_warn_where_they_do_not_take_a_setting():
    # what the test below relies on: transformers' RoPE checks warn (rather than raise), and are heard here
    with Warnings() as messages:
        config(rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 1.0, "beta_slow": 2.0}).validate_rope()
    assert any("beta_fast field must be greater than beta_slow" in m for m in messages), messages


@pytest.mark.parametrize("kind", list(SCALINGS))
def test_each_scaling_is_a_config_transformers_accepts_and_a_model_runs_at_four_times_the_context(kind, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    from ftcore_plugins.models._rope import RopeScaling, context_length, scale

    scaling = RopeScaling(**SCALINGS[kind])
    assert scaling.problems(config().to_dict()) == []
    with Warnings() as messages:
        scaled = scale(config(rope_parameters={"rope_type": "default", "rope_theta": 5e5}), scaling)
        scaled.save_pretrained(tmp_path)
        reread = AutoConfig.from_pretrained(tmp_path)
    # transformers' own checks of rope_parameters (modeling_rope_utils) warn on what they do not take
    assert [m for m in messages if "rope" in m.lower()] == [], messages
    assert reread.rope_parameters == scaled.rope_parameters
    rope = scaled.rope_parameters
    assert rope["rope_type"] == kind and rope["factor"] == 4.0 and rope["rope_theta"] == 5e5  # the model's theta kept
    # dynamic grows the base past max_position_embeddings, so that stays the length it starts from
    assert scaled.max_position_embeddings == (CONTEXT if kind == "dynamic" else 4 * CONTEXT)
    assert context_length(scaled) == 4 * CONTEXT
    if kind in ("yarn", "longrope"):
        assert rope["original_max_position_embeddings"] == CONTEXT

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(scaled).eval()
    plain = AutoModelForCausalLM.from_config(config(rope_parameters={"rope_type": "default", "rope_theta": 5e5}))
    plain.load_state_dict(model.state_dict())
    ids = torch.arange(10, 10 + 4 * CONTEXT)[None]
    with torch.no_grad():
        logits = model(ids).logits
        assert torch.isfinite(logits).all() and logits.shape[1] == 4 * CONTEXT
        assert (logits - plain.eval()(ids).logits).abs().max() > 1e-4  # the scaling changes the positions


def test_a_gguf_export_of_a_scaling_it_does_not_write_is_refused_before_training(tmp_path):
    """ftcore's GGUF writer writes linear scaling only; refused in validate, not after the run trained."""
    pytest.importorskip("gguf")
    config().save_pretrained(tmp_path / "base")
    write_jsonl(tmp_path / "chat.jsonl", long_rows(2))
    plan = tmp_path / "plan.toml"
    plan.write_text(PLAN.format(rope=YARN) + '\n[[export]]\nuse = "gguf"\n', encoding="utf-8")
    line = one_line_refusal(_validate(plan))
    assert "export[" in line and "a yarn rope_scaling is not written by ftcore's GGUF writer" in line, line
