"""DPO on preference pairs with images (issue #31): ftcore's data path (a source reads the pairs, the plan's
template renders them, the images stay references until a batch is built) into TRL's own DPOTrainer and its
vision collator. The batches and the per-step losses are those of TRL's VLM DPO run as a TRL user runs it
(conversational rows, PIL images, the processor); a short run raises the held-out reward accuracy; no image
token is ever in an answer's (completion) tokens; what this path does not do is one line."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from conftest import run_cli
from test_vision_labels import FAMILIES, TOKENIZERS, built, native, png
from test_vision_sft import plan_head

pytestmark = pytest.mark.skipif(not TOKENIZERS.is_dir(), reason="../shared/fixtures/tokenizers is absent")

COLORS = ("red", "blue", "green", "yellow")
QUESTIONS = ("What colour is this square?", "Colour?", "Which colour do you see here, please?", "Name the colour.")
# The families TRL's DPO collator batches (Llama 3.2 Vision's cross-attention mask it gives the prompt only).
DPO_FAMILIES = [f for f in FAMILIES if f != "mllama"]


def pair_rows(n: int = 16) -> list[dict]:
    """Pairs in TRL's conversational form: the image a content part of the prompt (a file name), the chosen
    answer names its colour, the rejected one another colour; questions and answers of several lengths."""
    rows = []
    for i in range(n):
        color, other = COLORS[i % len(COLORS)], COLORS[(i + 1 + (i // 4) % 3) % len(COLORS)]
        rows.append({"prompt": [{"role": "user", "content": [{"type": "image", "image": f"{color}.png"},
                                                             {"type": "text", "text": QUESTIONS[(i + i // 4) % 4]}]}],
                     "chosen": [{"role": "assistant", "content": f"It is {color}."}],
                     "rejected": [{"role": "assistant", "content": f"It is {other}" + ", I think" * (i % 3) + "."}]})
    return rows


def write_pairs(folder: Path, n: int = 16) -> Path:
    data = folder / "data"
    data.mkdir(parents=True, exist_ok=True)
    for color in COLORS:
        (data / f"{color}.png").write_bytes(png(color))
    (data / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in pair_rows(n)))
    return data / "pairs.jsonl"


def read_pairs(folder: Path, n: int = 16):
    """The pairs as ftcore's jsonl source reads them: an `<image>` placeholder in the prompt, a reference per image."""
    from test_bad_data import source
    from test_sources import load_data

    write_pairs(folder, n)
    return load_data(folder, source("jsonl", "data/pairs.jsonl")).ds


def trl_rows(folder: Path, n: int = 16) -> list[dict]:
    """The same pairs as a TRL user gives them to TRL's DPOTrainer: content parts, the images decoded in `images`."""
    from PIL import Image

    out = []
    for row in pair_rows(n):
        image = row["prompt"][0]["content"][0].pop("image")
        out.append({**row, "images": [Image.open(folder / "data" / image).convert("RGB")]})
    return out


def stage(tmp_path: Path, family: str, train, evaluation=None, adapter: str = "lora"):
    """The tiny ``family`` VLM (its processor attached to the tokenizer, as the loader gives it), its adapter
    applied as the runner applies it, and a StageContext whose reporter writes metrics.jsonl."""
    from ftcore.context import AdapterContext, RunInfo, StageContext
    from ftcore.reporter import Reporter

    from ftcore_plugins.adapters.full import FullAdapter
    from ftcore_plugins.adapters.lora import LoraAdapter
    from ftcore_plugins.common.vision import attach_processor

    base, processor = built(family)
    model = copy.deepcopy(base)
    reporter = Reporter(None, tmp_path / "metrics.jsonl", None, None)
    run = RunInfo(plan=type("Plan", (), {"seed": 7, "stages": [], "data": {}})(), run_dir=tmp_path)
    component = LoraAdapter(LoraAdapter.Options(r=8, lora_alpha=16)) if adapter == "lora" else FullAdapter()
    model = component.apply(model, AdapterContext(run, reporter, None))
    tokenizer = attach_processor(processor.tokenizer, processor)
    return StageContext(run, reporter, "dpo", model, tokenizer, native(), train, evaluation, tmp_path / "stage",
                        tmp_path / "stage" / "checkpoints", None, 7, adapter=component)


def options(**kw):
    from ftcore_plugins.trainers.dpo import DPOTrainer

    base = dict(max_steps=4, batch_size=2, max_length=128, learning_rate=1e-2, beta=0.1, save_steps=1000,
                logging_steps=1)
    return DPOTrainer.Options(**{**base, **kw})


def logged(path: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, path.read_text().splitlines()) if "loss" in r and r.get("step")}


def test_dpo_on_image_pairs_is_trls_own_vlm_dpo(tmp_path):
    """Acceptance: on the same rows, ftcore's batches are TRL's (token for token, pixel for pixel), and
    four steps of ftcore's dpo stage have TRL's own VLM DPO losses, rewards and log-probabilities within 1e-5."""
    import datasets
    import torch
    from trl import DPOConfig
    from trl import DPOTrainer as TrlDPOTrainer
    from trl.trainer.dpo_trainer import DataCollatorForVisionPreference

    from ftcore_plugins.trainers._vision import vision_pairs
    from ftcore_plugins.trainers.dpo import DPOTrainer

    ctx = stage(tmp_path, "llava", read_pairs(tmp_path))
    theirs = trl_rows(tmp_path)
    processor = ctx.tokenizer.ftcore_processor
    user_model = copy.deepcopy(ctx.model)  # the same LoRA adapter, before training

    # The same batch: ftcore's rows through its collator, the TRL user's rows through TRL's.
    o = options()
    train, _, collator = vision_pairs(ctx, o, "dpo")
    assert train.column_names == ["prompt", "chosen", "rejected", "images", "__index"]
    assert all(isinstance(r, str) for r in train[0]["images"])  # references, decoded in the collator
    ours = collator([train[i] for i in range(8)])
    expected = DataCollatorForVisionPreference(processor, max_length=o.max_length)(copy.deepcopy(theirs[:8]))
    assert sorted(ours) == sorted(expected) and "pixel_values" in ours
    for key in expected:
        assert torch.equal(ours[key], expected[key]), key
    assert (ours["attention_mask"] == 0).any()  # rows of several lengths: padding is part of what matches

    metrics = DPOTrainer(o).train(ctx)
    ftcore_steps = logged(tmp_path / "metrics.jsonl")

    args = DPOConfig(output_dir=str(tmp_path / "trl"), max_steps=4, per_device_train_batch_size=2, max_length=128,
                     learning_rate=1e-2, beta=0.1, logging_steps=1, save_strategy="no", report_to="none",
                     seed=7, bf16=False, gradient_checkpointing=False, use_cpu=True, dataloader_pin_memory=False)
    trainer = TrlDPOTrainer(model=user_model, args=args, train_dataset=datasets.Dataset.from_list(theirs),
                            processing_class=processor)
    trainer.train()
    trl_steps = {h["step"]: h for h in trainer.state.log_history if "loss" in h}

    assert sorted(ftcore_steps) == sorted(trl_steps) == [1, 2, 3, 4]
    worst = {}
    for key in ("loss", "rewards/margins", "rewards/accuracies", "logps/chosen", "logps/rejected"):
        worst[key] = max(abs(ftcore_steps[s][key] - trl_steps[s][key]) for s in trl_steps)
    print("largest difference from TRL's own VLM DPO, per metric:", worst)
    assert worst["loss"] < 1e-5, worst
    assert all(v < 1e-5 * max(1.0, abs(trl_steps[4][k])) for k, v in worst.items()), worst
    # The policy moved away from its reference: the later steps' losses are not DPO's starting log(2).
    assert abs(trl_steps[4]["loss"] - 0.6931) > 1e-2 and metrics["global_step"] == 4
    assert (ctx.output / "processor_config.json").is_file()  # the stage output loads as a VLM
    assert set(ctx.model.peft_config) == {"default"}  # TRL's `ref` adapter is gone again


@pytest.mark.parametrize("family", DPO_FAMILIES)
def test_image_tokens_are_never_in_the_answers(tmp_path, family):
    """Every family TRL's DPO batches: the answers' (completion) tokens decode to exactly each answer's text
    and its end of turn, and hold no image or vision-placeholder token; the prompts hold the image's tokens. The
    lengths the stage's data report gives (each prompt's image counted from its size, none decoded) are the
    batch's."""
    from ftcore_plugins.common.vision import image_template, vision_token_ids
    from ftcore_plugins.trainers._vision import pair_tokens, vision_pairs

    ctx = stage(tmp_path, family, read_pairs(tmp_path, 8))
    train, _, collator = vision_pairs(ctx, options(max_length=512), "dpo")
    tokenizer = collator.tokenizer
    never = vision_token_ids(tokenizer)
    closer = FAMILIES[family][2]
    batch = collator([train[i] for i in range(8)])
    rows = pair_rows(8)
    for k in range(16):
        ids, answer = batch["input_ids"][k], batch["completion_mask"][k].bool()
        attended = batch["attention_mask"][k].bool()
        assert not any(t in never for t in ids[answer].tolist())
        assert any(t in never for t in ids[attended & ~answer].tolist())  # the check can fail: the prompt has them
        text = rows[k % 8]["chosen" if k < 8 else "rejected"][0]["content"]
        # (SmolVLM's template writes the space after "Assistant:" with the answer)
        assert tokenizer.decode(ids[answer]).removeprefix(" " if family == "idefics3" else "") == text + closer
    lengths = batch["attention_mask"].sum(1).tolist()
    assert [p + a for p, a in pair_tokens(collator, image_template(native()), train)] == \
        [max(lengths[k], lengths[k + 8]) for k in range(8)]


def test_a_short_dpo_run_on_image_pairs_raises_reward_accuracy(tmp_path):
    """`ftcore run` on a LLaVA plan: on the held-out pairs (the train rows) the DPO loss falls from log(2), and
    the implicit reward accuracy and the policy's chosen-over-rejected margin rise; the stage output holds the
    processor. Rows with no image may share the data: their batches have no pixels."""
    data = write_pairs(tmp_path, 16)
    with open(data, "a") as f:  # two pairs with no image
        for color, other in (("red", "blue"), ("green", "yellow")):
            f.write(json.dumps({"prompt": [{"role": "user", "content": f"Say {color}."}],
                                "chosen": [{"role": "assistant", "content": f"{color}."}],
                                "rejected": [{"role": "assistant", "content": f"{other}."}]}) + "\n")
    plan = tmp_path / "plan.toml"
    plan.write_text(plan_head("llava") + f"""
[data.pairs]
use = "jsonl"
path = "data/pairs.jsonl"

[[stage]]
name = "dpo"
trainer = "dpo"
data = "pairs"
eval_data = "pairs"
adapter = {{ use = "lora", r = 8, lora_alpha = 16 }}
max_steps = 12
eval_steps = 12
batch_size = 4
learning_rate = 1e-2
beta = 0.5
max_length = 128
logging_steps = 1
save_steps = 100
""")
    done = run_cli("run", str(plan), cwd=tmp_path, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / "runs" / "plan"
    steps = logged(run / "metrics.jsonl")
    losses = [steps[s]["loss"] for s in sorted(steps)]
    summary = json.loads((run / "summary.json").read_text())["stages"]["dpo"]
    # Held out, the loss starts at log(2) (the policy is its reference); TRL's evaluation after 12 steps.
    assert len(losses) == 12 and losses[0] == pytest.approx(0.6931, abs=1e-4), losses
    assert summary["eval_loss"] < 0.6931 - 0.1, summary
    assert summary["eval_pairs"] == 18
    assert summary["eval_reward_accuracy"] >= 0.8 and summary["eval_reward_margin"] > 0.2, summary
    assert summary["eval_logp_margin"] > summary["eval_logp_margin_before"] + 0.5, summary
    assert summary["reference_logp_max_diff"] < 1e-3  # TRL's reference is the policy as the stage started
    assert (run / "stages" / "dpo" / "output" / "processor_config.json").is_file()
    # The pairs' lengths reported as text pairs' are (the table, data_report.json), and no library's chatter.
    report = json.loads((run / "data_report.json").read_text())
    assert report["dpo/train"]["rows"] == report["dpo/train"]["kept"] == 18 and report["dpo/train"]["length_max"] > 0
    assert "data for stage dpo" in done.stdout
    assert "hashed" not in done.stderr and "Parameter 'function'" not in done.stderr, done.stderr


def test_what_dpo_on_image_pairs_does_not_do_is_one_line(tmp_path):
    """An answer that holds an image token, a prompt (with its image's tokens) that fills max_length,
    Llama 3.2 Vision (mllama), padding_free, a text model, and kto/orpo/reward on pairs with images."""
    from types import SimpleNamespace

    import datasets

    from ftcore.errors import FtcoreError
    from ftcore_plugins.trainers._preference import require_data
    from ftcore_plugins.trainers._vision import vision_pairs

    def refusal(call) -> str:
        with pytest.raises(FtcoreError) as info:
            call()
        assert "\n" not in str(info.value)
        return str(info.value)

    pairs = read_pairs(tmp_path, 4)
    ctx = stage(tmp_path, "llava", pairs)
    train, _, collator = vision_pairs(ctx, options(max_length=8), "dpo")
    assert refusal(lambda: collator([train[1]])) == "stage dpo train data, row 2: its prompt is 18 tokens with its " \
        "images, and max_length = 8 leaves no token of its answers; raise max_length"
    _, _, collator = vision_pairs(ctx, options(), "dpo")
    bad = {**train[2], "rejected": "It is <image> blue.<|eot_id|>"}
    assert refusal(lambda: collator([train[0], bad])) == "stage dpo train data, row 3: the rejected answer holds " \
        "the image token '<image>'; a pair's images go in its prompt"
    assert refusal(lambda: vision_pairs(ctx, options(padding_free=True), "dpo")) == \
        "stage dpo: padding_free = true is not supported for rows with images yet"
    assert "the rows hold images, but the model is a text model" in \
        refusal(lambda: vision_pairs(SimpleNamespace(**{**vars(ctx), "tokenizer": SimpleNamespace()}), options(), "dpo"))
    mllama = stage(tmp_path, "mllama", pairs)
    assert refusal(lambda: vision_pairs(mllama, options(), "dpo")) == \
        "stage dpo: trainer 'dpo' does not train a mllama model on rows with images: TRL's DPO batches give its " \
        "cross-attention mask to the prompt only; sft does (docs/vision.md)"
    rows = datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": "<image>?"}],
                                        "chosen": [{"role": "assistant", "content": "Red."}],
                                        "rejected": [{"role": "assistant", "content": "Blue."}], "images": ["/x.png"]}])
    for trainer in ("kto", "orpo", "reward"):
        assert refusal(lambda: require_data(SimpleNamespace(train_data=rows, eval_data=None, stage="s"), trainer,
                                            ("pairs",))) == \
            f"stage s: trainer '{trainer}' does not train on rows with images yet (its data has an 'images' " \
            "column); dpo (on preference pairs) and sft do (docs/vision.md)"
