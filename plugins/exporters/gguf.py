"""Exporter ``gguf``: the merged model as GGUF files for llama.cpp (and Ollama, LM Studio, ...),
written with the ``gguf`` package, one file per type, tokenizer and chat template embedded.

The metadata keys and tensor layouts follow llama.cpp's own ``convert_hf_to_gguf.py``
(``LlamaModel`` for llama and mistral, ``Qwen2Model`` for qwen2). The merge is verified as for
``merged``; then transformers' own GGUF reader (independent of the writer: it undoes llama.cpp's q/k
row order itself) loads each 16/32-bit file, and its logits must match the merged model's within
``tolerance``; for quantized files the difference is recorded, not checked, and computed by llama.cpp
itself where llama-cpp-python is installed."""

from __future__ import annotations

import importlib.util
import json
import tempfile
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

import ftcore
from ftcore.component import Component, Options
from ftcore.errors import FtcoreError

from ftcore_plugins.common.run_model import load_gguf
from ftcore_plugins.exporters._card import card_path, final_path, write_card
from ftcore_plugins.exporters.merged import TOLERANCES, logits, max_abs_diff, merge_verified, verification_inputs

# transformers model_type -> llama.cpp architecture (mistral is llama's layout in llama.cpp).
ARCHITECTURES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2"}

# Written by the gguf package itself (gguf.quants), block-quantized types falling back to f16 for a
# tensor whose rows do not fill whole blocks, as llama.cpp's converter does.
PYTHON_TYPES = ("f32", "f16", "bf16", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0")
# Need llama.cpp's quantizer (k-quants mix types per tensor), called through llama-cpp-python.
LLAMA_CPP_TYPES = ("q6_k", "q5_k_m", "q5_k_s", "q4_k_m", "q4_k_s", "q3_k_l", "q3_k_m", "q3_k_s", "q2_k")
GgufType = Literal[PYTHON_TYPES + LLAMA_CPP_TYPES]  # type: ignore[valid-type]

# Checked against the merged model (max abs logit difference): the 16/32-bit files.
CHECKED = {"f32": TOLERANCES["float32"], "f16": TOLERANCES["float16"], "bf16": TOLERANCES["bfloat16"]}

USAGE = """
# llama.cpp:  llama-cli -m {file} -cnv      (the chat template is in the file)
# Ollama:     printf 'FROM {file}\\n' > Modelfile && ollama create mymodel -f Modelfile
from llama_cpp import Llama  # pip install llama-cpp-python

llm = Llama("{file}")
print(llm.create_chat_completion([{{"role": "user", "content": "Hello!"}}])["choices"][0]["message"]["content"])
"""

PIP_GGUF = "pip install 'ftcore[gguf]'"
PIP_LLAMA_CPP = "pip install llama-cpp-python (it builds llama.cpp from source, about 10 minutes)"

# llama.cpp's name for a byte-level BPE pre-tokenizer (tokenizer.ggml.pre), by the regex that splits
# the text before BPE (src/llama-vocab.cpp implements each name with these regexes).
GPT2_PRE = "gpt-2"  # a plain ByteLevel pre-tokenizer: GPT-2's own regex
PRE_TOKENIZERS = {
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+":
        "llama-bpe",  # Llama 3
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+":
        "qwen2",  # Qwen2, Qwen2.5
}


def model_type(plan) -> str | None:
    """The plan's transformers model_type when it can be known without loading anything."""
    options = plan.model.options
    if plan.model.name == "scratch":
        return options.architecture
    config = Path(str(getattr(options, "path", ""))) / "config.json"
    if config.is_file():
        return json.loads(config.read_text(encoding="utf-8")).get("model_type")
    return None  # a hub id: checked when the model is loaded


def unsupported_architecture(kind: str | None) -> str | None:
    if kind is None or kind in ARCHITECTURES:
        return None
    return (f"exporter 'gguf' writes llama, mistral and qwen2 models; this model is {kind!r} "
            "(export it with use = \"merged\" and convert it with llama.cpp's convert_hf_to_gguf.py)")


class GgufExporter(Component):
    """GGUF files for llama.cpp, one per type (f16, q8_0, ...), with the tokenizer and chat template."""

    name = "gguf"
    merges = True  # runs after the exports that need the adapter model, and merges it in place

    class Options(Options):
        types: list[GgufType] = Field(default=["f16", "q8_0"], min_length=1)  # type: ignore[valid-type]
        pre_tokenizer: str | None = None  # llama.cpp's pre-tokenizer name; found from the tokenizer when unset
        # Max abs logit difference allowed between a 16/32-bit file (read back by transformers) and the
        # merged model; unset: 0.05 for f16, 0.25 for bf16, 1e-4 for f32 (and for the merge before it).
        tolerance: float | None = Field(None, ge=0)

    def check(self, plan) -> list[str]:
        problems = []
        if importlib.util.find_spec("gguf") is None:
            problems.append(f"use: exporter 'gguf' needs the gguf package, which is not installed: {PIP_GGUF}")
        if (why := unsupported_architecture(model_type(plan))) is not None:
            problems.append(f"use: {why}")
        native = [t for t in self.options.types if t in LLAMA_CPP_TYPES]
        if native and importlib.util.find_spec("llama_cpp") is None:
            problems.append(f"types: {', '.join(native)} need llama.cpp's quantizer, and llama-cpp-python is not "
                            f"installed: {PIP_LLAMA_CPP}; or choose from {', '.join(PYTHON_TYPES)}")
        return problems

    def export(self, ctx):
        import torch

        model, merge = merge_verified(ctx, "float32", self.options.tolerance, self.name)
        config = model.config
        if (why := unsupported_architecture(config.model_type)) is not None:
            raise FtcoreError(f"export '{ctx.name}': {why}")
        state = {name: t.detach().to("cpu", torch.float32).numpy() for name, t in model.state_dict().items()}
        if config.tie_word_embeddings:
            state.pop("lm_head.weight", None)  # llama.cpp uses token_embd when output.weight is absent
        ctx.path.mkdir(parents=True, exist_ok=True)
        stem = ctx.run.plan.run_name
        inputs = verification_inputs(ctx)
        expected = logits(model, inputs)
        verification = {f"merge {k}": v for k, v in merge.items()}
        targets = {t: ctx.path / f"{stem}-{t}.gguf" for t in self.options.types}
        with tempfile.TemporaryDirectory() as tmp:
            ctx.tokenizer.save_pretrained(tmp)
            for gguf_type, target in targets.items():
                if gguf_type in PYTHON_TYPES:
                    self._write(target, gguf_type, config, state, ctx.tokenizer, Path(tmp), stem)
                else:
                    source = ctx.path / f"{stem}-f16.gguf"
                    if "f16" not in self.options.types:
                        source = Path(tmp) / "f16.gguf"
                    if not source.exists():
                        self._write(source, "f16", config, state, ctx.tokenizer, Path(tmp), stem)
                    llama_cpp_quantize(source, target, gguf_type)
                ctx.reporter.info(f"gguf: wrote {target.name} ({target.stat().st_size / 2**20:.1f} MiB)")
            if ctx.consume and ctx.last and ctx.release_model is not None:
                # The files are written and the expected logits known: the model can go before
                # each file is read back as a second model.
                model = state = ctx.model = ctx.merged = None
                ctx.release_model()
            for gguf_type, target in targets.items():
                verification.update(self.verify(target, gguf_type, inputs, expected))
                verification[f"{gguf_type} bytes"] = target.stat().st_size
        ctx.reporter.log(f"export:{ctx.name}", {k: v for k, v in verification.items() if isinstance(v, (int, float))})
        write_card(ctx.path, ctx, title="GGUF model", library="gguf", tags=["gguf", "llama.cpp"],
                   usage=USAGE.format(file=card_path(ctx, final_path(ctx) / f"{stem}-{self.options.types[-1]}.gguf")),
                   verification=verification)
        return ctx.path

    def verify(self, path: Path, gguf_type: str, inputs, expected) -> dict[str, Any]:
        """The max abs logit difference of the file's model from the merged model: checked for 16/32-bit
        files, read by transformers' GGUF reader; recorded for quantized ones, computed by llama.cpp
        where llama-cpp-python is installed (their runtime, which keeps the weights quantized where
        transformers builds a float32 model: on Qwen2.5-0.5B's config the export's peak went from 1.09-1.22
        to 0.93 of its bound, benchmarks/RESULTS.md), else by transformers where it can read the type."""
        import torch
        from transformers import AutoModelForCausalLM

        if gguf_type not in CHECKED and importlib.util.find_spec("llama_cpp") is not None:
            diff = max_abs_diff(llama_cpp_logits(path, inputs), expected)
            return {f"{gguf_type} max_abs_logit_diff": diff, f"{gguf_type} read back by": "llama.cpp"}
        try:
            loaded = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
        except (ValueError, NotImplementedError, KeyError) as e:
            if gguf_type in CHECKED:
                raise FtcoreError(f"exporter 'gguf': transformers cannot read back {path.name}: {e}") from e
            return {}  # a llama.cpp type transformers does not dequantize
        diff = max_abs_diff(logits(loaded, inputs), expected)
        if gguf_type not in CHECKED:
            return {f"{gguf_type} max_abs_logit_diff": diff, f"{gguf_type} read back by": "transformers"}
        limit = self.options.tolerance if self.options.tolerance is not None else CHECKED[gguf_type]
        if diff > limit:
            path.unlink()  # ours, just written, and wrong
            raise FtcoreError(f"exporter 'gguf': {path.name} read back by transformers gives logits up to {diff:.3g} "
                              f"from the merged model's, above tolerance {limit:g}; it was removed")
        return {f"{gguf_type} max_abs_logit_diff": diff, f"{gguf_type} tolerance": limit}

    def _write(self, path: Path, gguf_type: str, config, state, tokenizer, tokenizer_dir: Path, name: str) -> None:
        import gguf

        arch = ARCHITECTURES[config.model_type]
        # Tensors go to a temporary file as they are made (in memory up to 256 MiB, then on disk),
        # not held until the header is written: no further copy of the model in memory.
        writer = gguf.GGUFWriter(path, arch, use_temp_file=True)
        writer.add_type(gguf.GGUFType.MODEL)
        writer.add_name(name)
        add_hyperparameters(writer, config, arch, file_type(gguf_type))
        add_tokenizer(writer, tokenizer, tokenizer_dir, config.vocab_size, self.options.pre_tokenizer)
        add_tensors(writer, config, arch, state, gguf.GGMLQuantizationType[gguf_type.upper()])
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()


def llama_cpp_logits(path: Path, inputs: list[Any]) -> list[Any]:
    """llama.cpp's float32 logits for each row of token ids, every position (as ``logits`` gives them)."""
    import numpy as np
    import torch

    llm = load_gguf(path, n_ctx=max(ids.shape[-1] for ids in inputs), logits_all=True, verbose=False)
    try:
        out = []
        for ids in inputs:
            llm.reset()
            llm.eval(ids[0].tolist())
            out.append(torch.from_numpy(np.array(llm.scores[: ids.shape[-1]]))[None])
        return out
    finally:
        llm.close()


def file_type(gguf_type: str) -> Any:
    import gguf

    return gguf.LlamaFileType.ALL_F32 if gguf_type == "f32" else gguf.LlamaFileType[f"MOSTLY_{gguf_type.upper()}"]


def add_hyperparameters(writer, config, arch: str, ftype) -> None:
    import gguf

    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") not in ("default", "linear"):
        raise FtcoreError(f"exporter 'gguf': rope_type {rope['rope_type']!r} is not supported (default and linear are)")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(rope.get("rope_theta", 10000.0))
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if arch == "llama":
        writer.add_vocab_size(config.vocab_size)
        writer.add_rope_dimension_count(head_dim)
    writer.add_file_type(ftype)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def pre_tokenizer_name(tokenizer) -> str | None:
    """llama.cpp's name for this byte-level BPE tokenizer's pre-tokenizer, or None if it is not one it knows."""
    pre = json.loads(tokenizer.backend_tokenizer.to_str()).get("pre_tokenizer") or {}
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True) and not pre.get("add_prefix_space"):
        return GPT2_PRE
    parts = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else []
    if len(parts) == 2 and parts[0].get("type") == "Split" and parts[1].get("type") == "ByteLevel" \
            and not parts[1].get("use_regex", True):
        return PRE_TOKENIZERS.get(parts[0].get("pattern", {}).get("Regex"))
    return None


def add_tokenizer(writer, tokenizer, tokenizer_dir: Path, vocab_size: int, pre_tokenizer: str | None) -> None:
    """A byte-level BPE tokenizer as llama.cpp's "gpt2" model: tokens, types, merges, special ids, template."""
    import gguf

    backend = json.loads(tokenizer.backend_tokenizer.to_str()) if getattr(tokenizer, "is_fast", False) else {}
    if backend.get("model", {}).get("type") != "BPE" or backend.get("model", {}).get("byte_fallback"):
        raise FtcoreError("exporter 'gguf' embeds byte-level BPE tokenizers (GPT-2, Llama 3, Qwen2 style); this "
                          "tokenizer is not one: convert the 'merged' export with llama.cpp's convert_hf_to_gguf.py")
    pre = pre_tokenizer or pre_tokenizer_name(tokenizer)
    if pre is None:
        raise FtcoreError("exporter 'gguf': llama.cpp has no pre-tokenizer known to match this tokenizer's; set "
                          "pre_tokenizer = \"<name>\" in the [[export]] (a name from llama.cpp's llama-vocab.cpp)")
    vocab = {i: token for token, i in tokenizer.get_vocab().items()}
    added = tokenizer.added_tokens_decoder
    tokens, types = [], []
    for i in range(vocab_size):  # the embedding may have more rows than the tokenizer has tokens
        token = vocab.get(i)
        if token is None:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        else:
            tokens.append(token)
            types.append(gguf.TokenType.NORMAL if i not in added
                         else gguf.TokenType.CONTROL if added[i].special else gguf.TokenType.USER_DEFINED)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    special = gguf.SpecialVocab(tokenizer_dir, load_merges=True, n_vocab=vocab_size)
    # What the tokenizer really does, whatever its config files say.
    probe = tokenizer("a")["input_ids"]
    special.add_special_token["bos"] = tokenizer.bos_token_id is not None and probe[:1] == [tokenizer.bos_token_id]
    special.add_special_token["eos"] = tokenizer.eos_token_id is not None and probe[-1:] == [tokenizer.eos_token_id]
    special.add_to_gguf(writer, quiet=True)
    if special.chat_template is None and getattr(tokenizer, "chat_template", None):
        writer.add_chat_template(tokenizer.chat_template)


def permute_for_rope(weights, n_head: int):
    """llama.cpp's rotary layout for q/k rows (the converter's ``LlamaModel.permute``): HF's rotate-half
    pairs (i, i + d/2) become adjacent rows (2i, 2i + 1)."""
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def add_tensors(writer, config, arch: str, state: dict[str, Any], qtype) -> None:
    import gguf

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config.num_hidden_layers)
    for hf_name, data in state.items():
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            if hf_name.endswith("rotary_emb.inv_freq"):
                continue
            raise FtcoreError(f"exporter 'gguf': no llama.cpp tensor for {hf_name!r} in a {config.model_type} model")
        if arch == "llama" and ".self_attn.q_proj." in hf_name:
            data = permute_for_rope(data, config.num_attention_heads)
        elif arch == "llama" and ".self_attn.k_proj." in hf_name:
            data = permute_for_rope(data, config.num_key_value_heads)
        # Norms, biases and other 1-D tensors stay f32, as llama.cpp expects.
        tensor_type = qtype if data.ndim > 1 else gguf.GGMLQuantizationType.F32
        try:
            packed = quantize_rows(data, tensor_type)
        except gguf.QuantError:  # rows not a whole number of blocks
            tensor_type = gguf.GGMLQuantizationType.F16
            packed = quantize_rows(data, tensor_type)
        writer.add_tensor(name, packed, raw_dtype=tensor_type)


QUANTIZE_ELEMENTS = 1 << 22  # elements quantized at once (16 MiB of f32)


def quantize_rows(data: Any, tensor_type: Any) -> Any:
    """``gguf.quants.quantize`` a slab of rows at a time (blocks run along a row, so slabs give the same
    bytes): its numpy code makes several full-size temporaries, over 1.5 GiB for a 150k-token embedding."""
    import gguf
    import numpy as np

    step = max(1, QUANTIZE_ELEMENTS // max(1, data.shape[-1]))
    if data.ndim < 2 or data.shape[0] <= step:
        return gguf.quants.quantize(np.ascontiguousarray(data), tensor_type)
    return np.concatenate([gguf.quants.quantize(np.ascontiguousarray(data[i:i + step]), tensor_type)
                           for i in range(0, data.shape[0], step)])


def llama_cpp_quantize(source: Path, target: Path, gguf_type: str) -> None:
    """Quantize with llama.cpp's own quantizer (the llama-quantize tool's library call)."""
    import gguf

    try:
        import llama_cpp
    except ImportError:
        raise FtcoreError(f"exporter 'gguf': type {gguf_type} needs llama.cpp's quantizer: {PIP_LLAMA_CPP}") from None
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = int(gguf.LlamaFileType[f"MOSTLY_{gguf_type.upper()}"])
    if llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(), params) != 0:
        raise FtcoreError(f"exporter 'gguf': llama.cpp could not quantize {source.name} to {gguf_type}")


@ftcore.hookimpl
def register_exporters(register):
    register(GgufExporter)
