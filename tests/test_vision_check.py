"""`ftcore check` and `ftcore lr-find` on rows with images (issue #31): the rows are shown as the model reads
them, each image's tokens as one run (the token and its count), never trained; the gradient and overfit
checks run on the run's own batches, pixels and all."""

from __future__ import annotations

import re
import shutil

import pytest

from conftest import ROOT, run_cli
from test_vision_labels import TOKENIZERS
from test_vision_sft import write_data, write_plan

pytestmark = pytest.mark.skipif(not TOKENIZERS.is_dir(), reason="../shared/fixtures/tokenizers is absent")


def test_check_shows_the_image_tokens_and_what_is_trained(tmp_path):
    """LLaVA with LoRA on the real Llama 3 tokenizer: each row's image is its <image> token times the
    processor's count (28 x 28 pixels, patch 14, with the class token: 5), and only the answer and its
    end of turn are trained."""
    write_data(tmp_path)
    plan = write_plan(tmp_path, "llava")
    # LoRA r 8 on a random model with a 128k vocabulary moves the loss slowly (11.78 -> 11.15 in 30 steps):
    # the overfit bar is lowered, since this test is about the rows
    done = run_cli("check", str(plan), "--rows", "2", "--threshold", "0.98", cwd=tmp_path, env={"COLUMNS": "200"},
                   timeout=1200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert "trained / not trained / image tokens" in out
    rows = re.findall(r"row \d+: (\d+) tokens, (\d+) trained, (\d+) image tokens", out)
    assert len(rows) == 2 and all(int(images) == 5 for _, _, images in rows), out
    assert all(int(trained) == len(["It", " is", " red", ".", "<|eot_id|>"]) for _, trained, _ in rows), out
    assert out.count("<image>×5") == 2
    assert "gradients: each of" in out and "all checks passed (1 stage)" in out


def test_check_on_the_vision_example_leaves_out_what_full_cannot_train(tmp_path):
    """examples/vision trains every weight (adapter "full"); LLaVA reads its CLIP tower before the tower's
    final norm, so that norm's two parameters get no gradient: a note, not a failed check."""
    example = tmp_path / "vision"
    shutil.copytree(ROOT / "examples" / "vision", example, ignore=shutil.ignore_patterns("runs"))
    done = run_cli("check", str(example / "plan.toml"), "--rows", "1", cwd=tmp_path, env={"COLUMNS": "200"},
                   timeout=1200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "note: 2 parameters are not on the loss's path (first: model.vision_tower.post_layernorm.weight)" \
        in done.stdout
    assert "<image>×17" in done.stdout  # 56 x 56 pictures, patch 14, and the class token


def test_lr_find_on_image_rows(tmp_path):
    write_data(tmp_path)
    plan = write_plan(tmp_path, "llava")
    done = run_cli("lr-find", str(plan), "--steps", "10", cwd=tmp_path, timeout=1200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "suggested" in done.stdout.lower(), done.stdout


def test_estimate_counts_the_vision_tower_and_says_what_it_leaves_out(tmp_path):
    """The estimate's weights include the tower and the projector (their sizes from the model built on the meta
    device, Qwen's projector inside its tower counted once), and a note says their activations are not modeled."""
    from test_vision_labels import built

    write_data(tmp_path)
    for family in ("llava", "qwen2_5_vl"):
        plan = write_plan(tmp_path, family)
        done = run_cli("estimate", str(plan), cwd=tmp_path, env={"COLUMNS": "400"}, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        model, _ = built(family)
        from ftcore_plugins.common.vision import vision_parts

        tower, projector = vision_parts(model)
        size = {path: sum(p.numel() for p in model.get_submodule(path).parameters()) for path in (*tower, *projector)}
        tower_n = size[tower[0]] - sum(size[p] for p in projector if p.startswith(tower[0] + "."))
        note = " ".join(done.stdout.split())
        assert f"the vision tower ({tower[0]}: {tower_n:,} parameters) and the projector ({projector[0]}: " \
               f"{size[projector[0]]:,})" in note, note
        assert "the vision tower's own activations (each image's patches through its layers) are not modeled" in note


def test_the_qlora_estimate_leaves_the_vision_tower_unquantized():
    """As the bitsandbytes quantizers load a VLM (llm_int8_skip_modules: the tower and the projector), the
    estimate counts 4-bit weights for the language model's linear layers only."""
    from test_vision_labels import built

    from ftcore_plugins.common.estimate import convertible_linears
    from ftcore_plugins.common.vision import keep_vision_unquantized, vision_parts

    for family in ("llava", "qwen2_5_vl"):
        model, _ = built(family)
        tower, projector = vision_parts(model)
        quantized = convertible_linears(model, [])
        assert quantized and all(".language_model." in path for path in quantized), sorted(quantized)[:5]
        from transformers import BitsAndBytesConfig

        skipped = keep_vision_unquantized(BitsAndBytesConfig(load_in_4bit=True), model).llm_int8_skip_modules
        assert set(tower) | set(projector) <= set(skipped)
