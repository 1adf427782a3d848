"""A chat template's tokens that the tokenizer had already (the scratch tokenizer carries chatml's
markers): frozen under LoRA unless ``train_template_tokens`` asks for their rows to train, as the rows
of tokens a template adds always do (issue #30, benchmarks/new_tokens.py)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")


def _lora(tmp_path, **options):
    from ftcore.context import AdapterContext
    from ftcore.testing import RecordingReporter, tiny_model

    from ftcore_plugins.adapters.lora import LoraAdapter

    tiny = tiny_model(tmp_path / "m", hidden_size=32, num_heads=2)
    ids = tiny.tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    run = type("Run", (), {"is_main": True, "plan": type("Plan", (), {"seed": 0})()})()
    adapter = LoraAdapter(LoraAdapter.Options(r=4, **options))
    return adapter, adapter.apply(tiny.model, AdapterContext(run, RecordingReporter(), None)), tiny.tokenizer, ids


def test_lora_trains_the_template_tokens_the_tokenizer_had_only_on_request(tmp_path):
    adapter, model, tokenizer, ids = _lora(tmp_path)
    assert not [n for n, p in model.named_parameters() if p.requires_grad and "trainable_tokens" in n]

    adapter, model, tokenizer, ids = _lora(tmp_path, train_template_tokens=True)
    assert ids[0] < len(tokenizer) - 2  # in the tokenizer from the start, not added by the template
    layers = [m for m in model.modules() if type(m).__name__ == "TrainableTokensLayer"]
    assert layers and all(sorted(m.token_indices["default"]) == sorted(ids) for m in layers)
    # A step moves those rows and no other row of the embedding.
    embedding = model.get_input_embeddings()
    before = embedding.weight.detach().clone() if hasattr(embedding, "weight") else None
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    text = "<|im_start|>user\nWhich is an animal? red cat tree<|im_end|>\n<|im_start|>assistant\nthe cat<|im_end|>\n"
    batch = tokenizer(text, return_tensors="pt", add_special_tokens=False)
    model(**batch, labels=batch["input_ids"]).loss.backward()
    optimizer.step()
    after = model.get_input_embeddings().weight.detach()
    moved = (after - before).abs().sum(dim=1).nonzero().flatten().tolist()
    assert moved == sorted(ids)


def test_options_added_later_leave_the_adapters_initialisation_as_it_was_while_off():
    """vision_tower, train_projector (while off) and train_template_tokens are not part of the seed of
    LoRA's random A matrices: a plan that does not use them initialises as it did before they existed
    (the seed is the one of the options' JSON without them), and train_template_tokens never moves it."""
    import hashlib

    from ftcore_plugins.adapters.lora import LoraAdapter

    before = '{"r":16,"lora_alpha":32,"lora_dropout":0.0,"target_modules":"all-linear","bias":"none",' \
             '"modules_to_save":null,"use_rslora":false}'  # LoraOptions' JSON before those options came
    seed = int.from_bytes(hashlib.sha256(f"42:adapter:lora:{before}".encode()).digest()[:8], "big") % 2**63
    assert LoraAdapter(LoraAdapter.Options(r=16, lora_alpha=32)).init_seed(42) == seed
    assert LoraAdapter(LoraAdapter.Options(r=16, lora_alpha=32, train_template_tokens=True)).init_seed(42) == seed
    assert LoraAdapter(LoraAdapter.Options(r=16, lora_alpha=32, vision_tower=True)).init_seed(42) != seed
