"""The chunked loss (``loss_kernel = "chunked"``, the default of sft and pretrain) against the plain
loss from the whole logits: the same value and the same gradients, on the kernel alone and through
a real model with LoRA, full fine-tuning, packing, a prompt-tuning adapter and Gemma 2's softcap."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from ftcore_plugins.trainers._loss import add_chunked_head, chunked_cross_entropy, full_cross_entropy  # noqa: E402
from ftcore_plugins.common.model import strip_forward_patches  # noqa: E402


def _reference(hidden, weight, bias, targets, softcap=None, scale=1.0):
    z = hidden @ weight.t()
    if bias is not None:
        z = z + bias
    z = z * scale
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    logp = torch.log_softmax(z.double(), -1)
    nll = -logp.gather(1, targets[:, None]).sum()
    return nll, (z.argmax(-1) == targets).sum(), -(logp.exp() * logp).sum()


@pytest.mark.parametrize("softcap,scale,with_bias", [(None, 1.0, False), (30.0, 1.0, True), (None, 0.0625, False)])
@pytest.mark.parametrize("chunk_elements", [7 * 50, 1 << 24])  # 7 rows a chunk, or all rows at once
def test_kernel_matches_the_plain_loss(softcap, scale, with_bias, chunk_elements):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(37, 16, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(50, generator=g, dtype=torch.float64, requires_grad=True) if with_bias else None
    targets = torch.randint(0, 50, (37,), generator=g)
    nll, correct, entropy = chunked_cross_entropy(hidden, weight, bias, targets, softcap=softcap, scale=scale,
                                                  entropy=True, chunk_elements=chunk_elements)
    ref_nll, ref_correct, ref_entropy = _reference(hidden, weight, bias, targets, softcap, scale)
    assert nll.item() == pytest.approx(ref_nll.item(), rel=1e-6)
    assert correct.item() == ref_correct.item()
    assert entropy.item() == pytest.approx(ref_entropy.item(), rel=1e-6)
    inputs = [t for t in (hidden, weight, bias) if t is not None]
    mine = torch.autograd.grad(3.0 * nll, inputs)  # a scaled loss scales the gradients
    ref = torch.autograd.grad(3.0 * ref_nll, inputs)
    for a, b in zip(mine, ref):
        torch.testing.assert_close(a, b.to(a.dtype), rtol=1e-5, atol=1e-7)


def test_no_gradient_work_without_grad():
    hidden, weight = torch.randn(5, 8, requires_grad=True), torch.randn(11, 8, requires_grad=True)
    targets = torch.randint(0, 11, (5,))
    with torch.no_grad():
        nll, _, entropy = chunked_cross_entropy(hidden, weight, None, targets)
    assert not nll.requires_grad and entropy is None
    assert nll.item() == pytest.approx(_reference(hidden, weight, None, targets)[0].item(), rel=1e-5)


def _llama(vocab=300, **extra):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      **extra)
    return transformers.LlamaForCausalLM(config).float()


def _batch(vocab=300, rows=3, length=20):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (rows, length), generator=g)
    labels = ids.clone()
    labels[:, :6] = -100  # a prompt
    labels[0, 15:] = -100  # padding at the end of the first row
    mask = torch.ones_like(ids)
    mask[0, 15:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _compare(model, batch, trainable):
    """Loss and gradients of the plain loss and of the chunked one through the patched model."""
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    # use_cache=False as in training: with a cache, transformers does not read packed position ids as
    # separate samples.
    plain = full_cross_entropy(model(**inputs, use_cache=False), batch["labels"])
    plain_grads = torch.autograd.grad(plain, trainable)
    add_chunked_head(model, entropy=False)
    out = model(**batch, chunked_loss=True)
    assert out.tokens.item() == (batch["labels"][:, 1:] != -100).sum().item()
    chunked = out.loss / out.tokens
    grads = torch.autograd.grad(chunked, trainable)
    assert chunked.item() == pytest.approx(plain.item(), abs=1e-5)
    for a, b in zip(grads, plain_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    # Without the flag the forward is the original: logits, and the model's own loss.
    again = model(**inputs)
    assert again.logits.shape[-1] == model.config.vocab_size
    strip_forward_patches(model)
    assert "forward" not in (model.get_base_model() if hasattr(model, "get_base_model") else model).__dict__


def _autocast_against_fp32(device: str):
    """The chunked loss's gradients under bf16 autocast (the head's products in bf16, summed in fp32) against
    fp32's, within bf16's precision."""
    g = torch.Generator().manual_seed(0)
    hidden = (torch.randn(300, 64, generator=g) * 0.5).to(device)
    weight = (torch.randn(1000, 64, generator=g) * 0.1).to(device)
    targets = torch.randint(0, 1000, (300,), generator=g).to(device)
    grads = {}
    for precision in ("fp32", "bf16"):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        with torch.autocast(device, dtype=torch.bfloat16, enabled=precision == "bf16"):
            nll, _, _ = chunked_cross_entropy(h, w, None, targets, chunk_elements=64 * 1000)  # 5 chunks
        nll.backward()
        grads[precision] = (nll.item(), h.grad, w.grad)
    (loss, grad_h, grad_w), (loss16, grad_h16, grad_w16) = grads["fp32"], grads["bf16"]
    assert grad_w16.dtype == grad_h16.dtype == torch.float32  # the parameters' dtype, summed in fp32
    assert loss16 == pytest.approx(loss, rel=1e-2)
    for got, want in ((grad_w16, grad_w), (grad_h16, grad_h)):
        assert ((got - want).norm() / want.norm()).item() < 1e-2


def test_the_head_gradient_is_computed_in_the_models_precision():
    _autocast_against_fp32("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA's fp32-output product needs a GPU")
def test_the_head_gradient_is_one_bf16_product_with_fp32_output_on_a_gpu():
    from ftcore_plugins.trainers import _loss

    _autocast_against_fp32("cuda")
    assert _loss._FP32_OUT.get("cuda", True), "torch refused addmm(out_dtype=float32): the slower fallback ran"


def test_full_fine_tuning_matches_with_tied_embeddings():
    model = _llama(tie_word_embeddings=True)
    _compare(model, _batch(), [p for p in model.parameters()])


def test_lora_matches():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(_llama(), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"]))
    _compare(model, _batch(), [p for p in model.parameters() if p.requires_grad])


def test_prompt_tuning_labels_follow_the_virtual_tokens():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(_llama(), peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
    _compare(model, _batch(), [p for p in model.parameters() if p.requires_grad])


def test_packed_rows_with_position_ids():
    model = _llama()
    batch = _batch(rows=1, length=30)
    del batch["attention_mask"]
    batch["position_ids"] = torch.cat([torch.arange(12), torch.arange(18)])[None]  # two samples in one row
    batch["labels"][0, 12] = -100  # the second sample's first token is not predicted from the first
    _compare(model, batch, list(model.parameters()))


def test_gemma2_softcap():
    torch.manual_seed(0)
    config = transformers.Gemma2Config(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                       max_position_embeddings=128, final_logit_softcapping=2.0)
    model = transformers.Gemma2ForCausalLM(config).float()
    _compare(model, _batch(), list(model.parameters()))


@pytest.mark.slow
@pytest.mark.parametrize("trainer,data,adapter", [("sft", "chat", "lora"), ("pretrain", "text", "full")])
def test_kernels_train_the_same(tmp_path, trainer, data, adapter):
    """Whole runs with each loss_kernel: the same logged losses (gradient accumulation and
    evaluation included), token counts and token accuracy; entropy only when asked for."""
    from conftest import run_kit
    from ftcore.testing import write_plan

    runs = {}
    for kernel in ("chunked", "full", "trl"):
        stage = {"name": "s", "trainer": trainer, "data": data, "adapter": adapter, "max_steps": 6,
                 "batch_size": 2, "gradient_accumulation_steps": 2, "max_length": 64, "learning_rate": 3e-3,
                 "logging_steps": 1, "save_steps": 100, "loss_kernel": kernel, "log_entropy": kernel == "full"}
        if trainer == "sft":
            stage.update(eval_data="chat_eval", eval_steps=3)
        plan = write_plan(tmp_path, {"run": {"name": kernel}, "stage": [stage]}, name=f"{kernel}.toml")
        runs[kernel] = run_kit("run", plan, cwd=tmp_path).check()
    losses = {k: r.losses("s") for k, r in runs.items()}
    assert len(losses["chunked"]) == 6
    for kernel in ("full", "trl"):
        assert losses[kernel].keys() == losses["chunked"].keys()
        for step, value in losses["chunked"].items():
            assert value == pytest.approx(losses[kernel][step], abs=1e-5), (kernel, step)
    chunked = runs["chunked"].stage_metrics("s")
    assert chunked["train_tokens"] == runs["trl"].stage_metrics("s")["train_tokens"]
    if trainer == "sft":
        assert chunked["eval_loss"] == pytest.approx(runs["full"].stage_metrics("s")["eval_loss"], abs=1e-5)
    accuracy = {k: r.losses("s", "mean_token_accuracy") for k, r in runs.items()}
    assert accuracy["chunked"] == pytest.approx(accuracy["full"], abs=1e-6)
    assert runs["full"].losses("s", "entropy") and not runs["chunked"].losses("s", "entropy")
    assert {r.get("loss_kernel") for r in runs["chunked"].metrics} >= {"chunked"}


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3", "mistral", "phi3", "gemma"])
def test_other_families_match(model_type):
    """Today's families the fixtures hold tokenizers and templates for: the same loss and gradients."""
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(
        model_type, vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=128, pad_token_id=0,
        tie_word_embeddings=model_type != "mistral")
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    _compare(model, _batch(), list(model.parameters()))
