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


def test_the_option_leaves_the_adapters_initialisation_as_it_was_while_off(tmp_path):
    """Added while runs already existed: off, it is not part of the seed of LoRA's random A matrices."""
    from ftcore_plugins.adapters.lora import LoraAdapter

    plain = LoraAdapter(LoraAdapter.Options(r=4))
    key = f"7:adapter:lora:{plain.options.model_dump_json(exclude={'train_template_tokens'})}".encode()
    import hashlib

    assert plain.init_seed(7) == int.from_bytes(hashlib.sha256(key).digest()[:8], "big") % 2**63
    assert LoraAdapter(LoraAdapter.Options(r=4, train_template_tokens=True)).init_seed(7) != plain.init_seed(7)
