"""Packed batches attend sample by sample (``plugins/trainers/_packing.py``): the same logits and
gradients as each sample alone, on today's families, and the model's own attention afterwards."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

from ftcore_plugins.trainers._packing import PER_SAMPLE_SDPA, BinnedBatches, block_causal_mask, per_sample_sdpa, \
    register  # noqa: E402

FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "phi3", "gemma", "gemma3_text"]


def _model(model_type: str, head_dim: int = 8, **extra):
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(
        model_type, vocab_size=120, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=head_dim, max_position_embeddings=256, pad_token_id=0, **extra)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").float()
    return model.train()  # dropout is 0 in these configs; train() is what a stage runs in


def _packed_row(lengths: list[int], seed: int = 0):
    """One row as TRL's padding-free collator makes it from best-fit bins, and the samples in it."""
    from trl.data_utils import pack_dataset
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    rng = random.Random(seed)
    samples = [[rng.randrange(3, 120) for _ in range(n)] for n in lengths]
    bins = pack_dataset(datasets.Dataset.from_list([{"input_ids": s, "labels": s} for s in samples]),
                        max(lengths) * 2, strategy="bfd")
    batch = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)(list(bins))
    assert "attention_mask" not in batch and len(bins) > 1  # several bins, concatenated into one row
    return batch, bins


def _alone(model, batch, bins):
    """Each sample's logits from a forward pass of it alone, in the order of the packed row."""
    pieces = []
    for row in bins:
        start = 0
        for length in row["seq_lengths"]:
            ids = torch.tensor([row["input_ids"][start:start + length]], device=model.device)
            pieces.append(model(input_ids=ids, use_cache=False).logits)
            start += length
    return torch.cat(pieces, dim=1)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_each_sample_gets_the_logits_and_gradients_it_has_alone(model_type, monkeypatch):
    extra = {"sliding_window": 6} if model_type in ("mistral", "gemma3_text") else {}  # windows inside samples too
    model = _model(model_type, **extra)
    batch, bins = _packed_row([5, 9, 14, 22, 7, 30, 3, 12], seed=len(model_type))
    inputs = {k: v for k, v in batch.items() if k != "labels"}

    reference = _alone(model, batch, bins)
    reference.square().mean().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    register()
    model.set_attn_implementation(PER_SAMPLE_SDPA)
    sdpa, calls = torch.nn.functional.scaled_dot_product_attention, []
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, **k: calls.append(k.get("attn_mask")) or sdpa(*a, **k))
    packed = model(**inputs, use_cache=False).logits
    monkeypatch.undo()
    # No mask over the row was built: one causal call per sample and layer (a mask only for windows).
    samples = sum(len(row["seq_lengths"]) for row in bins)
    assert len(calls) == samples * model.config.num_hidden_layers
    assert all(m is None or m.shape[-1] <= 30 for m in calls)
    packed.square().mean().backward()
    assert (packed - reference).abs().max().item() < 1e-5
    for got, want in zip((p.grad for p in model.parameters()), expected):
        assert (got - want).abs().max().item() < 1e-5

    # The check can fail: one causal pass over the row lets samples see each other.
    model.set_attn_implementation("sdpa")
    crossed = model(input_ids=batch["input_ids"], use_cache=False).logits
    assert (crossed - reference).abs().max().item() > 1e-3


def test_the_mask_it_builds_for_other_paths_is_transformers_own():
    """Inputs only transformers' SDPA handles (softcap, sinks, ...) get the mask transformers would
    build for the packed row, sliding window included."""
    from transformers.masking_utils import and_masks, causal_mask_function, packed_sequence_mask_function, \
        sdpa_mask, sliding_window_overlay

    edges = [0, 4, 11, 12, 20]
    sample = torch.repeat_interleave(torch.arange(4), torch.tensor(edges).diff())[None]
    for window in (None, 3):
        function = and_masks(causal_mask_function, packed_sequence_mask_function(sample))
        if window:
            function = and_masks(function, sliding_window_overlay(window))
        want = sdpa_mask(batch_size=1, q_length=20, kv_length=20, mask_function=function, allow_is_causal_skip=False)
        assert torch.equal(block_causal_mask(edges, window, "cpu"), want)


def test_padded_batches_and_generation_are_unchanged():
    """Everything but a packed row goes to transformers' SDPA with its mask: a padded batch gives
    the same logits, and generation with a cache the same tokens."""
    model = _model("qwen2").eval()
    ids = torch.randint(3, 120, (2, 12))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding, as generation pads
    want = model(input_ids=ids, attention_mask=mask).logits
    generated = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    register()
    model.set_attn_implementation(PER_SAMPLE_SDPA)
    assert (model(input_ids=ids, attention_mask=mask).logits - want).abs().max().item() < 1e-6
    assert torch.equal(model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False),
                       generated)


def test_only_a_packed_stage_on_sdpa_switches_and_it_switches_back():
    model = _model("llama")
    with per_sample_sdpa(model, packed=False) as path:
        assert path is None and model.config._attn_implementation == "sdpa"
    with pytest.raises(RuntimeError), per_sample_sdpa(model, packed=True) as path:
        assert path == "sdpa_per_sample" and model.config._attn_implementation == PER_SAMPLE_SDPA
        raise RuntimeError("a stage that fails")
    assert model.config._attn_implementation == "sdpa"
    model.set_attn_implementation("eager")
    with per_sample_sdpa(model, packed=True) as path:  # what the plan asked for is kept
        assert path == "eager" and model.config._attn_implementation == "eager"


def _binned(lengths: list[int], seed: int = 0):
    """The batch of the binned paths (``flex``, ``sdpa_block``): one row per best-fit bin."""
    from trl.data_utils import pack_dataset

    from ftcore_plugins.trainers._packing import BinnedBatches

    rng = random.Random(seed)
    samples = [[rng.randrange(3, 120) for _ in range(n)] for n in lengths]
    bins = pack_dataset(datasets.Dataset.from_list([{"input_ids": s, "labels": s} for s in samples]),
                        max(lengths) * 2, strategy="bfd")
    batch = BinnedBatches(pad_token_id=0)(list(bins))
    assert "attention_mask" not in batch and batch["input_ids"].shape[0] == len(bins) > 1
    return batch, bins


def _unbinned(logits, bins):
    """The samples' logits of a binned batch, in the order :func:`_alone` gives them (padding left out)."""
    return torch.cat([logits[row:row + 1, :len(b["input_ids"])] for row, b in enumerate(bins)], dim=1)


def _binned_against_alone(path: str, model_type: str, *, grads: bool, device: str = "cpu", head_dim: int = 8):
    from ftcore_plugins.trainers._packing import KERNELS, attention_for

    extra = {"sliding_window": 6} if model_type in ("mistral", "gemma3_text") else {}  # windows inside samples too
    model = _model(model_type, head_dim, **extra).to(device)
    batch, bins = _binned([5, 9, 14, 22, 7, 30, 3, 12], seed=len(model_type))
    batch = {k: v.to(device) if hasattr(v, "to") else v for k, v in batch.items()}
    assert batch[BinnedBatches.REAL_TOKENS] == sum(len(b["input_ids"]) for b in bins)
    with torch.set_grad_enabled(grads):
        reference = _alone(model, batch, bins)
        if grads:
            reference.square().mean().backward()
            expected = [p.grad.clone() for p in model.parameters()]
            model.zero_grad()
        with attention_for(model, path):
            assert model.config._attn_implementation == KERNELS[path]
            out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
            packed = _unbinned(out, bins)
            if grads:
                packed.square().mean().backward()
        assert model.config._attn_implementation == "sdpa"
        assert (packed - reference).abs().max().item() < 1e-5
        if grads:
            for got, want in zip((p.grad for p in model.parameters()), expected):
                assert (got - want).abs().max().item() < 1e-5
        # The check can fail: the same bins with causal attention over each whole bin let samples see each other.
        crossed = _unbinned(model(input_ids=batch["input_ids"], use_cache=False).logits, bins)
        assert (crossed - reference).abs().max().item() > 1e-3


@pytest.mark.parametrize("model_type", FAMILIES)
def test_sdpa_block_gives_each_sample_its_logits_and_gradients_alone(model_type):
    """The GPU's fallback path, run here: SDPA with transformers' block-diagonal mask per bin, built once a
    forward pass from the collator's position ids (sliding windows included)."""
    _binned_against_alone("sdpa_block", model_type, grads=True)


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text"])
def test_flex_gives_each_sample_its_logits_alone(model_type):
    """flex attention's BlockMask per bin, on a CPU: the forward pass (torch 2.13 has no flex backward on a
    CPU, so validation refuses the path there; the gradients are checked on a GPU, below)."""
    from ftcore_plugins.trainers._packing import path_problem

    assert "no backward pass on a CPU" in path_problem("flex", "cpu")
    _binned_against_alone("flex", model_type, grads=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="flex attention's backward runs on a GPU only")
@pytest.mark.parametrize("model_type", ["llama", "gemma3_text"])
def test_flex_gives_each_sample_its_logits_and_gradients_alone_on_a_gpu(model_type):
    # head_dim 16: torch's CUDA lowering of flex attention refuses a smaller one ("NYI: embedding dimension").
    _binned_against_alone("flex", model_type, grads=True, device="cuda", head_dim=16)


@pytest.mark.slow
def test_flex_compiles_once_for_batches_of_every_fill():
    """transformers compiles flex attention and its block mask, and each shape it has not seen compiles them
    again. A flex stage's batches are all one shape (rows of max_length rounded up to 128, a short batch
    filled with rows of padding), so 10 batches of varying fill, the last one short, compile 2 graphs.
    The check can fail: batches as long as their longest bin compile 2 more at the next width."""
    from torch._dynamo.utils import counters

    from ftcore_plugins.trainers._packing import fixed_width

    model = _model("llama", head_dim=16).eval()
    model.set_attn_implementation("flex_attention")
    rng = random.Random(0)

    def batches(collate, count):
        for step in range(count):
            bins = []
            for _ in range(4 if step < count - 1 else 2):
                lengths = [rng.randint(5, 60) for _ in range(rng.randint(1, 3))]
                ids = [rng.randrange(3, 120) for _ in range(sum(lengths))]
                bins.append({"input_ids": ids, "labels": ids, "seq_lengths": lengths})
            yield collate(bins)

    def graphs(collate, count):
        torch._dynamo.reset()
        counters.clear()
        shapes = set()
        with torch.no_grad():  # forward only: torch 2.13 has no flex backward on a CPU
            for batch in batches(collate, count):
                shapes.add(tuple(batch["input_ids"].shape))
                model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False)
        return counters["stats"]["unique_graphs"], shapes

    width = fixed_width("flex", 200)
    assert width == 256
    compiled, shapes = graphs(BinnedBatches(0, width, rows=4), 10)
    assert shapes == {(4, 256)} and compiled == 2
    compiled, shapes = graphs(BinnedBatches(0), 2)
    assert len(shapes) == 2 and compiled == 4
    torch._dynamo.reset()


def test_binned_batches_label_each_samples_first_token_and_the_padding_out():
    from ftcore_plugins.trainers._packing import BinnedBatches

    batch = BinnedBatches(pad_token_id=0)([
        {"input_ids": [5, 6, 7, 8, 9], "labels": [5, 6, 7, 8, 9], "seq_lengths": [2, 3]},
        {"input_ids": [3, 4], "labels": [-100, 4], "seq_lengths": [2]}])
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9], [3, 4, 0, 0, 0]]
    assert batch["position_ids"].tolist() == [[0, 1, 0, 1, 2], [0, 1, 2, 3, 4]]  # the padding follows the last sample
    assert batch["labels"].tolist() == [[-100, 6, -100, 8, 9], [-100, 4, -100, -100, -100]]
    assert batch[BinnedBatches.REAL_TOKENS] == 7
    # A fixed shape (flex): every row 8 wide, and the batch filled to 3 rows with a row of padding.
    fixed = BinnedBatches(pad_token_id=0, width=8, rows=3)([{"input_ids": [3, 4], "labels": [3, 4]}])
    assert fixed["input_ids"].tolist() == [[3, 4, 0, 0, 0, 0, 0, 0], [0] * 8, [0] * 8]
    assert fixed["labels"].tolist() == [[-100, 4, *[-100] * 6], [-100] * 8, [-100] * 8]
    assert fixed["position_ids"].tolist() == [list(range(8))] * 3
    assert fixed[BinnedBatches.REAL_TOKENS] == 2


def test_the_path_follows_the_device_and_what_is_installed(monkeypatch):
    """``auto`` takes the device's order (device_defaults): per-sample SDPA on a CPU; on a GPU varlen
    flash attention where flash-attn is installed, else flex attention, else SDPA's block mask."""
    import importlib.util

    from ftcore_plugins.trainers import _packing
    from ftcore_plugins.trainers._packing import choose_path

    model = _model("llama")
    assert choose_path("auto", model, "cpu") == "sdpa_per_sample"
    assert choose_path("sdpa_block", model, "cpu") == "sdpa_block"
    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "flash_attn" else find(name, *a))
    assert choose_path("auto", model, "cuda") == "flex"
    monkeypatch.setattr(_packing, "path_problem", lambda path, device: "absent" if path in ("varlen", "flex") else None)
    assert choose_path("auto", model, "cuda") == "sdpa_block"
    monkeypatch.setattr(_packing, "path_problem", lambda path, device: None)
    assert choose_path("auto", model, "cuda") == "varlen"
    model.set_attn_implementation("eager")  # what the plan asked for is kept, on the bins
    assert choose_path("auto", model, "cuda") == "eager"
