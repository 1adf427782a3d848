"""Every per-device default is decided from the device the stage trains on (``device_defaults``), never from
where the loaded model happens to sit: an unquantized model is loaded on the CPU and moved to the GPU only
by the Trainer, after the stage has chosen its paths."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from ftcore_plugins.common.device_defaults import CPU, CUDA, loss_kernel_for, training_device, \
    triton_problem  # noqa: E402


def _sft(**options):
    from ftcore_plugins.trainers.sft import SFT

    return SFT(SFT.Options(max_steps=2, batch_size=4, max_length=200, **options))


@pytest.mark.parametrize("packing", [True, False])
def test_a_stage_that_trains_on_a_gpu_takes_every_gpu_default_while_its_model_is_on_the_cpu(ftcore_stage, packing):
    """The training device is the decision's input: "cuda" here is where the Trainer would put the model,
    and the model is still on the CPU when the stage decides, as the ``hf`` loader leaves an unquantized
    model. Before this was fixed the stage read ``model_device(ctx.model)`` and took every CPU default."""
    ctx = ftcore_stage()
    assert next(ctx.model.parameters()).device.type == "cpu"
    chosen = _sft(packing=packing).device_choices(ctx, "cuda")
    assert chosen["loss_kernel"] == loss_kernel_for("cuda") == next(
        k for k in CUDA.loss_kernels if k != "liger" or (triton_problem() is None and _installed("liger_kernel")))
    assert chosen["loss_chunk_elements"] == CUDA.loss_chunk_elements != CPU.loss_chunk_elements
    assert chosen["optimizer"] == CUDA.optimizer == "adamw_torch_fused"
    if packing:
        # varlen needs flash-attn (not installed here, nor on the GPU image): the next of the GPU's order
        expected = "varlen" if _installed("flash_attn") else "flex"
        assert chosen["packed_attention"] == expected != CPU.packed_attention[0]
        if expected == "flex":
            assert chosen["packed_attention_note"] == "not varlen: varlen flash attention needs the flash-attn " \
                                                      "package, which is not installed"
            assert chosen["packed_width"] == 256  # max_length 200 rounded up to flex's block of 128
    else:
        assert chosen["packed_attention"] is chosen["packed_width"] is None
    # The same stage on the CPU it is on: every CPU default.
    cpu = _sft(packing=packing).device_choices(ctx, "cpu")
    assert (cpu["loss_kernel"], cpu["loss_chunk_elements"], cpu["optimizer"]) == \
        ("chunked", CPU.loss_chunk_elements, CPU.optimizer)
    assert cpu["packed_attention"] == ("sdpa_per_sample" if packing else None)
    assert cpu["packed_attention_note"] is cpu["packed_width"] is None


def test_the_training_device_is_where_the_trainer_puts_the_model(ftcore_stage, tmp_path):
    """``training_device`` is what transformers' TrainingArguments gives as the device, and the stage's run
    logs the choices of that device."""
    from transformers import TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), report_to="none")
    assert training_device() == args.device.type
    ctx = ftcore_stage()
    stage = _sft(packing=True, logging_steps=1, save_steps=100)
    stage.train(ctx)
    first = next(r for r in ctx.reporter.records if r.get("step") == 0 and "loss_kernel" in r)
    chosen = stage.device_choices(ctx, training_device())
    assert (first["loss_kernel"], first["packed_attention"]) == (chosen["loss_kernel"], chosen["packed_attention"])


def test_triton_paths_need_a_c_compiler(monkeypatch, tmp_path):
    """flex attention and Liger are Triton kernels, whose launchers Triton builds with $CC, gcc or clang: without
    one, auto passes them over and an explicit choice is refused, before anything loads."""
    import importlib.util

    from ftcore_plugins.trainers._packing import choose_path, passed_over, path_problem

    assert triton_problem() is None  # this machine has gcc
    monkeypatch.setenv("PATH", str(tmp_path))  # no compiler on it
    monkeypatch.delenv("CC", raising=False)
    problem = triton_problem()
    assert problem and "C compiler" in problem
    assert "Triton" in path_problem("flex", "cuda")
    monkeypatch.setenv("CC", "/nowhere/cc")
    assert "/nowhere/cc" in triton_problem()

    class Model(torch.nn.Module):
        config = type("Config", (), {"_attn_implementation": "sdpa"})()
        _supports_flash_attn = _supports_flex_attn = True

    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name in ("flash_attn", "liger_kernel")
                        else find(name, *a))
    path = choose_path("auto", Model(), "cuda")  # varlen needs no Triton; flash-attn is "installed" here
    assert path == "varlen" and passed_over("auto", Model(), "cuda", path) is None
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "liger_kernel"
                        else None if name == "flash_attn" else find(name, *a))
    path = choose_path("auto", Model(), "cuda")
    assert path == "sdpa_block"
    note = passed_over("auto", Model(), "cuda", path)
    assert note.startswith("not varlen: ") and "; not flex: flex attention is compiled to Triton kernels" in note
    assert loss_kernel_for("cuda") == "chunked"  # Liger "installed", but no compiler for it
    Model.config._attn_implementation = "eager"  # the plan's own kernel: its path, nothing passed over
    assert choose_path("auto", Model(), "cuda") == "eager" and passed_over("auto", Model(), "cuda", "eager") is None


def _installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None
