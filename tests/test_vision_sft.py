"""SFT on rows with images (issue #31): for each of six VLM families, LoRA adapts the language model only
(vision tower and projector frozen unless asked) and a few steps on image rows lower the loss; a plan runs
through `ftcore run` as any text plan does; what the path does not do yet is one line, exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import run_cli
from test_vision_labels import FAMILIES, TOKENIZERS, built, images, native, png  # noqa: F401  (images: fixture)

pytestmark = pytest.mark.skipif(not TOKENIZERS.is_dir(), reason="../shared/fixtures/tokenizers is absent")

COLORS = ("red", "blue", "green", "yellow")


def write_data(folder: Path, n: int = 16) -> None:
    data = folder / "data"
    data.mkdir(parents=True, exist_ok=True)
    for color in COLORS:
        (data / f"{color}.png").write_bytes(png(color))
    with open(data / "train.jsonl", "w") as f:
        for i in range(n):
            color = COLORS[i % len(COLORS)]
            f.write(json.dumps({"messages": [{"role": "user", "content": "<image>What colour is this square?"},
                                             {"role": "assistant", "content": f"It is {color}."}],
                                "images": [f"{color}.png"]}) + "\n")


def plan_head(family: str) -> str:
    """The [run], [model] (a tiny scratch ``family`` VLM on its real tokenizer) and [template] tables of the
    vision tests' plans."""
    return f"""[run]
seed = 0
output_dir = "runs"

[model]
use = "scratch"
architecture = "{family}"
hidden_size = 32
num_layers = 2
num_heads = 2
tokenizer = "{TOKENIZERS / FAMILIES[family][0]}"

[template]
use = "native"
"""


def write_plan(folder: Path, family: str, extra: str = "") -> Path:
    plan = folder / "plan.toml"
    plan.write_text(plan_head(family) + f"""
[data.train]
use = "jsonl"
path = "data/train.jsonl"

[[stage]]
name = "sft"
trainer = "sft"
data = "train"
adapter = {{ use = "lora", r = 8, lora_alpha = 16 }}
max_steps = 6
batch_size = 4
learning_rate = 1e-2
max_length = 256
logging_steps = 1
save_steps = 100
{extra}""")
    return plan


def losses(run: Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def vision_parts_of(model) -> tuple[list[str], list[str]]:
    from ftcore_plugins.adapters._targets import vision_parts

    return vision_parts(model)


def vision_paths(model) -> list[str]:
    tower, projector = vision_parts_of(model)
    return tower + projector


@pytest.mark.parametrize("family", list(FAMILIES))
def test_lora_targets_the_language_model_only_by_default(family):
    from ftcore_plugins.adapters._targets import resolve

    model, _ = built(family)
    tower, projector = vision_parts_of(model)
    assert tower and projector, (family, tower, projector)
    under = lambda path, roots: any(path == r or path.startswith(r + ".") for r in roots)  # noqa: E731
    default = resolve(model, "all-linear")
    assert default.modules and not any(under(p, tower + projector) for p in default.modules)
    assert all(".language_model." in p or ".text_model." in p for p in default.modules), default.modules
    with_tower = resolve(model, "all-linear", vision=True)
    assert any(under(p, tower) for p in with_tower.modules)
    assert not any(under(p, projector) for p in with_tower.modules)  # the projector is trained whole, if at all


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_lora_targets_line_names_the_layers_as_on_a_text_model(family):
    """peft needs longer names on a VLM (its vision tower has q_proj too), but the line says what was adapted as a
    text model's says it: the layers' own names, in model order, and how many layers."""
    import copy
    import re
    from types import SimpleNamespace

    from ftcore_plugins.adapters._targets import resolve
    from ftcore_plugins.adapters.lora import LoraAdapter

    said = []
    reporter = SimpleNamespace(info=said.append, warn=said.append)
    model = copy.deepcopy(built(family)[0])
    LoraAdapter(LoraAdapter.Options()).apply(model, SimpleNamespace(run=None, reporter=reporter, quantizer=None))
    line = next(s for s in said if " targets " in s)
    names, layers = re.fullmatch(r"adapter lora: targets (.+) \((\d+) layers\)", line).groups()
    chosen = resolve(built(family)[0], "all-linear").modules
    assert int(layers) == len(chosen)
    assert names.split(", ") == list(dict.fromkeys(path.rsplit(".", 1)[1] for path in chosen)), line


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_few_steps_on_image_rows_lower_the_loss_with_the_vision_tower_frozen(family, images):
    """The batches the sft collator builds, the LoRA adapter sft applies, a few optimizer steps."""
    import copy

    import torch
    from peft import get_peft_model

    from ftcore_plugins.adapters.lora import LoraAdapter
    from ftcore_plugins.common.vision import VisionEncoder
    from test_vision_labels import rows

    base, processor = built(family)
    model = copy.deepcopy(base)

    class Ctx:
        class reporter:  # noqa: N801
            info = staticmethod(lambda *a, **k: None)

    model = get_peft_model(model, LoraAdapter(LoraAdapter.Options(r=8, lora_alpha=16, train_projector=False))
                           .peft_config(model, Ctx))
    frozen = {n: p.detach().clone() for n, p in model.named_parameters()
              if any(f".{v}." in n for v in vision_paths(base))}
    assert frozen and not any(p.requires_grad for n, p in model.named_parameters() if n in frozen)
    batch = VisionEncoder(processor, native())(list(rows(images).values()))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    torch.manual_seed(0)
    seen = []
    for _ in range(6):
        loss = model(**batch).loss
        seen.append(loss.item())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert seen[-1] < seen[0] - 0.05, (family, seen)
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if n in frozen)


def test_sft_plan_on_image_rows_then_the_merged_export_generates_from_an_image(tmp_path):
    """`ftcore run` on a LLaVA plan: the loss and the eval loss fall, the saved adapter is the language model's, and the merged
    export (model and processor) loads in plain transformers and generates from an image."""
    write_data(tmp_path)
    plan = write_plan(tmp_path, "llava", 'eval_data = "train"\neval_steps = 3\n\n[[export]]\nuse = "merged"\n')
    done = run_cli("run", str(plan), cwd=tmp_path, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / "runs" / "plan"
    seen = losses(run)
    assert len(seen) == 6 and seen[-1] < seen[0] - 0.05, seen
    evals = [r["eval_loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "eval_loss" in r]
    assert len(evals) >= 2 and evals[-1] < evals[0], evals  # eval rows with images, through the same collator
    from safetensors import safe_open

    with safe_open(run / "stages" / "sft" / "output" / "adapter_model.safetensors", "pt") as f:
        keys = list(f.keys())
    assert keys and all(".language_model." in k for k in keys), keys

    generates_from_an_image(run / "exports" / "merged", tmp_path / "data" / "red.png")
    assert (run / "stages" / "sft" / "output" / "processor_config.json").is_file()  # the output has its processor


def generates_from_an_image(folder: Path, image: Path) -> None:
    """The folder loads in plain transformers (model and processor) and generates from ``image``.

    Qwen2.5-VL's and Qwen3-VL's AutoProcessor also builds a video processor, which needs torchvision, and
    no torchvision wheel imports beside this machine's CPU torch 2.13.0. For them the test does the
    processor's one step by hand from the folder's own parts: AutoTokenizer's chat template, AutoImageProcessor's
    pixels and grid, and each <|image_pad|> repeated once per merged patch of the grid, as the processor
    repeats it."""
    from PIL import Image
    from transformers import AutoConfig, AutoImageProcessor, AutoModelForImageTextToText, AutoProcessor, AutoTokenizer

    model = AutoModelForImageTextToText.from_pretrained(folder)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is this square?"}]}]
    picture = Image.open(image).convert("RGB")
    if AutoConfig.from_pretrained(folder).model_type.startswith("qwen"):
        tokenizer, pixels = AutoTokenizer.from_pretrained(folder), AutoImageProcessor.from_pretrained(folder)
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        grid = pixels(images=[picture], return_tensors="pt")
        tokens = int(grid["image_grid_thw"].prod()) // pixels.merge_size ** 2
        text = text.replace("<|image_pad|>", "<|image_pad|>" * tokens)
        inputs = {**tokenizer([text], add_special_tokens=False, return_tensors="pt"), **grid}
    else:
        processor = AutoProcessor.from_pretrained(folder)
        text = processor.apply_chat_template(messages, add_generation_prompt=True)
        inputs = processor(text=[text], images=[[picture]], add_special_tokens=False, return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert out.shape[1] > inputs["input_ids"].shape[1]  # it generated from the image


@pytest.mark.slow
@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "llava"])
def test_sft_plan_on_image_rows_every_family(tmp_path, family):
    write_data(tmp_path)
    done = run_cli("run", str(write_plan(tmp_path, family, '\n[[export]]\nuse = "merged"\n')), cwd=tmp_path,
                   timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = losses(tmp_path / "runs" / "plan")
    assert seen[-1] < seen[0] - 0.05, seen
    generates_from_an_image(tmp_path / "runs" / "plan" / "exports" / "merged", tmp_path / "data" / "red.png")


def test_what_image_rows_do_not_do_yet_is_one_line():
    """Refused before any batch is built: packing where the family's attention would change, and a text model
    (no processor)."""
    from types import SimpleNamespace

    import datasets

    from ftcore.errors import FtcoreError
    from ftcore_plugins.trainers._vision import vision_splits

    rows = datasets.Dataset.from_list([{"messages": [{"role": "user", "content": "<image>?"},
                                                     {"role": "assistant", "content": "Red."}], "images": ["/x.png"]}])
    _, processor = built("llava")
    reporter = SimpleNamespace(info=lambda *a, **k: None)

    def refusal(tokenizer, model_type="llava", **options) -> str:
        o = SimpleNamespace(**{"max_length": 64, "train_on_inputs": False, "packing": False, **options})
        ctx = SimpleNamespace(tokenizer=tokenizer, train_data=rows, eval_data=None, stage="sft", reporter=reporter,
                              template=native(), model=SimpleNamespace(config=SimpleNamespace(model_type=model_type)))
        with pytest.raises(FtcoreError) as info:
            vision_splits(ctx, o, "sft")
        assert "\n" not in str(info.value)
        return str(info.value)

    from ftcore_plugins.common.vision import attach_processor

    tokenizer = attach_processor(processor.tokenizer, processor)
    assert refusal(tokenizer, "gemma3", packing=True) == (
        "stage sft: packing = true does not pack gemma3 rows with images: its image tokens attend to each other both "
        "ways, which packed attention does not keep; set packing = false")
    assert refusal(tokenizer, "mllama", packing=True) == (
        "stage sft: packing = true does not pack mllama rows with images: its cross-attention mask is built per row, "
        "not per packed sample; set packing = false")
    assert refusal(tokenizer, "llava_next", packing=True) == (
        "stage sft: packing = true does not pack llava_next rows with images: packing is verified on llava, idefics3, "
        "qwen2_5_vl, qwen3_vl only; set packing = false")
    assert "the rows hold images, but the model is a text model (its loader gave no processor)" in \
        refusal(SimpleNamespace())


def test_hf_loader_reads_a_vlm_folder_with_its_processor(tmp_path):
    """A saved VLM folder (model and processor) loads as AutoModelForImageTextToText, its processor attached,
    and passes the loader's preflight (a model type transformers builds, shapes that match the weights)."""
    from types import SimpleNamespace

    from ftcore_plugins.common.vision import processor_of
    from ftcore_plugins.models.hf import HFModelLoader

    model, processor = built("llava")
    model.save_pretrained(tmp_path / "vlm")
    processor.save_pretrained(tmp_path / "vlm")
    loader = HFModelLoader(HFModelLoader.Options(path=str(tmp_path / "vlm"), dtype="float32"))
    assert loader.vision() and loader.preflight(SimpleNamespace()) == []
    assert type(loader.meta_model()[0]).__name__ == "LlavaForConditionalGeneration"
    loaded, tokenizer = loader.load(SimpleNamespace(quantizer=SimpleNamespace(load_kwargs=lambda: {}), run=None))
    assert type(loaded).__name__ == "LlavaForConditionalGeneration"
    assert type(processor_of(tokenizer)).__name__ == "LlavaProcessor" and tokenizer.chat_template


def test_trainers_and_evaluators_that_do_not_take_images_say_so():
    """The pair trainers other than dpo (orpo, kto, reward) and the text tokenization (evaluators, pretrain)
    refuse rows with images in one line, rather than train on their text alone."""
    from types import SimpleNamespace

    import datasets

    from ftcore.errors import FtcoreError
    from ftcore_plugins.common.chat import chosen_as_chat
    from ftcore_plugins.common.prepare import prepare
    from ftcore_plugins.trainers._preference import require_data

    message = {"role": "user", "content": "<image>?"}
    pairs = datasets.Dataset.from_list([{"prompt": [message], "chosen": [{"role": "assistant", "content": "Red."}],
                                         "rejected": [{"role": "assistant", "content": "Blue."}],
                                         "images": ["/x.png"]}])
    with pytest.raises(FtcoreError) as info:
        require_data(SimpleNamespace(train_data=pairs, eval_data=None, stage="orpo"), "orpo", ("pairs",))
    assert str(info.value) == "stage orpo: trainer 'orpo' does not train on rows with images yet (its data has an " \
        "'images' column); dpo (on preference pairs) and sft do (docs/vision.md)"
    chat = chosen_as_chat(pairs)  # sft on pairs: the chosen conversation, with its images
    assert sorted(chat.column_names) == ["images", "messages"] and chat[0]["images"] == ["/x.png"]
    with pytest.raises(FtcoreError) as info:
        prepare(chat, None, None, max_length=8, where="data.eval (eval.jsonl)")
    assert str(info.value) == "data.eval (eval.jsonl): the rows hold images, which this stage or evaluator does " \
        "not take yet (trainer sft does; docs/vision.md)"


@pytest.mark.slow
def test_image_rows_killed_and_resumed_is_the_same_run(tmp_path):
    """A LLaVA stage killed after a checkpoint and run again with --resume trains the steps left to the
    same losses as a run never killed (the batches rebuilt from the rows, images decoded again)."""
    import signal

    from conftest import start_cli
    from ftcore.testing import complete_checkpoints, wait_until

    extra = "save_steps = 4\n"
    runs = {}
    for name in ("reference", "killed"):
        folder = tmp_path / name
        write_data(folder)
        plan = write_plan(folder, "llava", extra).read_text().replace("max_steps = 6", "max_steps = 24") \
            .replace("save_steps = 100\n", "")
        (folder / "plan.toml").write_text(plan)
        runs[name] = folder / "runs" / "plan"
        if name == "reference":
            done = run_cli("run", "plan.toml", cwd=folder, timeout=1200)
            assert done.returncode == 0, done.stderr[-3000:]
            continue
        proc = start_cli("run", "plan.toml", cwd=folder)
        wait_until(proc, lambda: complete_checkpoints(runs[name], "sft"), timeout=1200)
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
        assert not (runs[name] / "stages" / "sft" / "COMPLETE.json").exists()  # killed mid-stage
        done = run_cli("run", "plan.toml", "--resume", cwd=folder, timeout=1200)
        assert done.returncode == 0, done.stderr[-3000:]

    def by_step(run):
        out = {}
        for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()):
            if "loss" in r and r.get("step") is not None:
                out[r["step"]] = r["loss"]
        return out

    reference, resumed = by_step(runs["reference"]), by_step(runs["killed"])
    assert sorted(reference) == list(range(1, 25)) and max(resumed) == 24
    for step in range(21, 25):  # after the last checkpoint the kill can have left (step 20)
        assert resumed[step] == pytest.approx(reference[step], rel=1e-4), (step, resumed, reference)


def test_qlora_quantizes_the_language_model_and_keeps_the_vision_tower_in_compute_dtype(tmp_path, images):
    """bnb-nf4 on a VLM folder: the language model's linear layers are 4-bit, the vision tower's and the
    projector's stay float32, and LoRA on the 4-bit language model trains on image rows."""
    from types import SimpleNamespace

    import torch
    from peft import get_peft_model

    from ftcore_plugins.adapters.lora import LoraAdapter
    from ftcore_plugins.common.vision import VisionEncoder, processor_of
    from ftcore_plugins.models.hf import HFModelLoader
    from ftcore_plugins.quantizers.bnb_nf4 import NF4Quantizer
    from test_vision_labels import rows

    model, processor = built("llava")
    model.save_pretrained(tmp_path / "vlm")
    processor.save_pretrained(tmp_path / "vlm")
    quantizer = NF4Quantizer(NF4Quantizer.Options())
    loader = HFModelLoader(HFModelLoader.Options(path=str(tmp_path / "vlm"), dtype="float32"))
    loaded, tokenizer = loader.load(SimpleNamespace(quantizer=quantizer, run=None))
    tower, projector = vision_parts_of(loaded)
    kinds = {n: type(m).__name__ for n, m in loaded.named_modules() if type(m).__name__ in ("Linear4bit", "Linear")}
    under = lambda n, roots: any(n.startswith(r + ".") for r in roots)  # noqa: E731
    assert {k for n, k in kinds.items() if under(n, tower + projector)} == {"Linear"}
    assert {k for n, k in kinds.items() if ".language_model." in n} == {"Linear4bit"}
    loaded = quantizer.prepare(loaded)
    peft_model = get_peft_model(loaded, LoraAdapter(LoraAdapter.Options(r=8, lora_alpha=16)).peft_config(
        loaded, SimpleNamespace(reporter=SimpleNamespace(info=lambda *a, **k: None))))
    batch = VisionEncoder(processor_of(tokenizer), native())(list(rows(images).values()))
    loss = peft_model(**batch).loss
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for p in peft_model.parameters() if p.requires_grad)
