"""Exporter ``gguf``: the merged model as GGUF files for llama.cpp (and Ollama, LM Studio, ...),
one file per type, tokenizer, chat template and end-of-turn token embedded, with an Ollama Modelfile.

Two writers. Llama, Mistral and Qwen2 models are written here with the ``gguf`` package; the metadata
keys and tensor layouts follow llama.cpp's own ``convert_hf_to_gguf.py`` (``LlamaModel`` for llama and
mistral, ``Qwen2Model`` for qwen2), and it names the pre-tokenizer of a byte-level BPE tokenizer from
its regex, so tokenizers trained from scratch export too. Every other architecture (Qwen3, Gemma 1/2/3,
Phi-3 and the rest of llama.cpp's list) goes through llama.cpp's converter itself, run from where it is
installed (:mod:`ftcore_plugins.exporters.llama_cpp_converter`); ``converter = "llama.cpp"`` sends the
three families there too.

The merge is verified as for ``merged``. Then each 16/32-bit file is read back and its logits must
match the merged model's: by llama.cpp, the program the files are for, where llama-cpp-python is
installed (within ``tolerance``, else a bound relative to the largest logit, since llama.cpp computes
with its own kernels and a 16-bit KV cache); otherwise by transformers' own GGUF reader for this
module's files (it undoes llama.cpp's q/k row order itself; within ``tolerance``), which builds a
float32 model and takes 25-30 s for a 128k-151k vocabulary where llama.cpp takes under a second. The
converter's files need llama.cpp (transformers' reader mis-sizes Qwen3's heads and Gemma's attention
scale). For quantized files the difference is recorded, not checked, computed by the same reader."""

from __future__ import annotations

import ast
import functools
import importlib.util
import json
import tempfile
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

import ftcore
from ftcore.component import Component, Options
from ftcore.errors import FtcoreError

from ftcore_plugins.common import seq2seq
from ftcore_plugins.common.cache import cache_dir
from ftcore_plugins.common.run_model import load_gguf
from ftcore_plugins.exporters import llama_cpp_converter as converter
from ftcore_plugins.exporters._card import card_path, final_path, write_card
from ftcore_plugins.exporters._ollama import modelfile
from ftcore_plugins.exporters._vision import plan_vision_model, refusal, refuse_loaded
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
# The same files read back by llama.cpp (wherever it is installed): a fraction of the largest logit.
# Its own kernels and 16-bit KV cache add to the weights' rounding (tiny Qwen3/Gemma f16: 0.1-0.2%).
CHECKED_BY_LLAMA_CPP = {"f32": 0.01, "f16": 0.02, "bf16": 0.05}
# The types llama.cpp's converter writes itself; the others are quantized from its f16 file.
CONVERTER_TYPES = ("f32", "f16", "bf16", "q8_0")

USAGE = """
# llama.cpp:  llama-cli -m {file} -cnv      (the chat template is in the file)
# Ollama:     ollama create mymodel -f {modelfile}      (the Modelfile below)
from llama_cpp import Llama  # pip install llama-cpp-python

llm = Llama("{file}")
print(llm.create_chat_completion([{{"role": "user", "content": "Hello!"}}])["choices"][0]["message"]["content"])
"""

PIP_GGUF = "pip install 'ftcore[gguf]'"
PIP_LLAMA_CPP = "pip install llama-cpp-python (it builds llama.cpp from source, about 10 minutes)"
PIP_SENTENCEPIECE = "pip install sentencepiece"

# llama.cpp's names for byte-level BPE pre-tokenizers, by their regex (shared with the converter's process).
GPT2_PRE, PRE_TOKENIZERS = converter.GPT2_PRE, converter.PRE_TOKENIZERS


def model_type(plan) -> str | None:
    """The plan's transformers model_type when it can be known without loading anything."""
    options = plan.model.options
    if plan.model.name == "scratch":
        return options.architecture
    config = Path(str(getattr(options, "path", ""))) / "config.json"
    if config.is_file():
        return json.loads(config.read_text(encoding="utf-8")).get("model_type")
    return None  # a hub id: checked when the model is loaded


def model_classes(plan) -> list[str] | None:
    """The plan's transformers architecture class names (``Qwen3ForCausalLM``), where known without loading."""
    options = plan.model.options
    if plan.model.name == "scratch":
        return class_names(options.architecture, None)
    config = Path(str(getattr(options, "path", ""))) / "config.json"
    if config.is_file():
        data = json.loads(config.read_text(encoding="utf-8"))
        return class_names(data.get("model_type"), data.get("architectures"))
    return None


def class_names(kind: str | None, architectures: list[str] | None) -> list[str]:
    if architectures:
        return list(architectures)
    name = causal_lm_names().get(kind or "")
    return [name] if isinstance(name, str) else list(name or [])


@functools.cache
def causal_lm_names() -> dict[str, str]:
    """transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` (model type -> class name), read from its source:
    importing ``modeling_auto`` imports torch, which ``ftcore validate`` never does."""
    spec = importlib.util.find_spec("transformers")
    source = Path(spec.origin).parent / "models" / "auto" / "modeling_auto.py"
    for node in ast.parse(source.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"
                                                for t in node.targets):
            return dict(ast.literal_eval(node.value.args[0]))
    return {}


def uses_converter(choice: str, kind: str | None) -> bool:
    """Whether llama.cpp's converter writes this model (else this module's writer)."""
    return choice == "llama.cpp" or (choice == "auto" and kind is not None and kind not in ARCHITECTURES)


def unsupported_architecture(kind: str | None, classes: list[str] | None = None, choice: str = "auto",
                             converter_path: str | None = None) -> str | None:
    """Why this model cannot be exported, or None (also when it is not known yet)."""
    if kind is None or not uses_converter(choice, kind):
        return None if choice != "ftcore" or kind is None or kind in ARCHITECTURES else \
            f"converter = \"ftcore\" writes llama, mistral and qwen2 models; this model is {kind!r}"
    tree = converter.find_converter(converter_path)
    if tree is None:
        where = f"converter_path {converter_path!r} holds no {converter.SCRIPT}" if converter_path else \
            f"it is not installed: {converter.FETCH} (once, with the network; it takes llama-cpp-python's source)"
        return (f"exporter 'gguf' writes llama, mistral and qwen2 models itself and this model ({kind!r}) with "
                f"llama.cpp's convert_hf_to_gguf.py, and {where}")
    known = converter.registered(tree)
    if classes and not any(c in known for c in classes):
        return f"llama.cpp's converter in {tree} does not convert {', '.join(classes)} (model type {kind!r})"
    return None


# What llama.cpp's converter reads of a tokenizer: copied, with config.json, into the folder its check runs on.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja")


def model_file(source: str | None, name: str, revision: str | None = None) -> Path | None:
    """``name`` in the model folder ``source``, or in the hub cache for a hub id (nothing is downloaded)."""
    if not source:
        return None
    if Path(source).is_dir():
        path = Path(source) / name
        return path if path.is_file() else None
    if Path(source).is_absolute() or Path(source).exists():
        return None
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(source, name, revision=revision)
    except Exception:  # noqa: BLE001 - not a hub id
        return None
    return Path(cached) if isinstance(cached, str) else None


def converter_job(plan, folder: Path) -> dict[str, Any] | None:
    """The plan's model for llama.cpp's converter's check (``_converter_process.check``): its config.json and
    tokenizer files copied into ``folder`` (no weights); for the scratch loader, its options (the check builds
    the config and tokenizer with the loader's own code). None where the config is not known before loading."""
    import shutil

    options = plan.model.options
    job: dict[str, Any] = {"folder": str(folder), "architectures": model_classes(plan) or [], "tokenizer": True}
    if plan.model.name == "scratch":
        return {**job, "scratch": options.model_dump(mode="json")}
    revision = getattr(options, "revision", None)
    config = model_file(getattr(options, "path", None), "config.json", revision)
    if config is None:
        return None
    shutil.copyfile(config, folder / "config.json")
    source = getattr(options, "tokenizer", None) or getattr(options, "path", None)
    for name in TOKENIZER_FILES:
        if (found := model_file(source, name, revision)) is not None:
            shutil.copyfile(found, folder / name)
    job["tokenizer"] = any((folder / name).exists() for name in ("tokenizer.json", "tokenizer.model", "vocab.json"))
    return job


def check_key(tree: Path, job: dict[str, Any], pre_tokenizer: str | None) -> str:
    """What a converter check's answer depends on: the converter and the libraries it runs with, ftcore's
    side of it, the job's options and every file it read."""
    import hashlib
    from importlib.metadata import PackageNotFoundError, version

    digest = hashlib.sha256()
    versions = {}
    for package in ("transformers", "llama-cpp-python", "ftcore"):
        try:
            versions[package] = version(package)
        except PackageNotFoundError:
            versions[package] = None
    described = {k: v for k, v in job.items() if k != "folder"}
    digest.update(json.dumps([str(tree), (tree / converter.SCRIPT).stat().st_mtime_ns, versions, pre_tokenizer,
                              described], sort_keys=True, default=str).encode())
    for module in ("_converter_process.py", "llama_cpp_converter.py"):  # ftcore's side of the converter
        digest.update(Path(__file__).with_name(module).read_bytes())
    for path in sorted(Path(job["folder"]).iterdir()):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def writer_tokenizer_problem(plan, kind: str, pre_tokenizer: str | None) -> str | None:
    """Why this exporter's own writer cannot embed the plan's tokenizer (read from its tokenizer.json), or None,
    also when that file is not known before loading. The scratch loader's trained tokenizer is one it embeds."""
    options = plan.model.options
    if plan.model.name == "scratch" and getattr(options, "tokenizer", None) is None:
        return None
    source = getattr(options, "tokenizer", None) or getattr(options, "path", None)
    found = model_file(str(source) if source else None, "tokenizer.json", getattr(options, "revision", None))
    if found is None:
        return None
    backend = json.loads(found.read_text(encoding="utf-8"))
    model = backend.get("model") or {}
    if model.get("type") != "BPE" or model.get("byte_fallback"):
        return (f"exporter 'gguf' writes {kind!r} models itself with byte-level BPE tokenizers (GPT-2, Llama 3, "
                f"Qwen2 style), and this model's is {model.get('type', 'another kind')}"
                f"{' with byte fallback (SentencePiece style)' if model.get('byte_fallback') else ''}; set "
                "converter = \"llama.cpp\" (llama.cpp's converter reads it)")
    if pre_tokenizer is None and converter.bpe_pre_tokenizer(backend) is None:
        return ("llama.cpp has no pre-tokenizer known to split text as this tokenizer's does; set pre_tokenizer = "
                "\"<name>\" on the [[export]] (a name from llama.cpp's llama-vocab.cpp), or converter = \"llama.cpp\" "
                "(its converter knows published tokenizers by a hash of their ids)")
    return None


# Why a vision-language model is refused (plugins/exporters/_vision.py).
VISION_WHY = "llama.cpp runs one from two files, the language model and its vision tower and projector (mmproj), " \
    "and this exporter writes the language model only"
# Why an encoder-decoder (T5, BART) is refused (common/seq2seq.py).
SEQ2SEQ_WHY = "it writes and checks causal LMs (llama.cpp runs a T5 through an encoder pass of its own, which " \
    "this export does not check, and converts no BART)"
SEQ2SEQ_FIX = "export it with \"merged\" or \"adapter\""


class GgufExporter(Component):
    """GGUF files for llama.cpp, one per type (f16, q8_0, ...), with the tokenizer and chat template."""

    name = "gguf"
    merges = True  # runs after the exports that need the adapter model, and merges it in place

    class Options(Options):
        types: list[GgufType] = Field(default=["f16", "q8_0"], min_length=1)  # type: ignore[valid-type]
        pre_tokenizer: str | None = None  # llama.cpp's pre-tokenizer name; found from the tokenizer when unset
        # Max abs logit difference allowed between a 16/32-bit file and the merged model; unset: 2%, 5%,
        # 1% of the largest logit for f16, bf16, f32 read back by llama.cpp (where llama-cpp-python is
        # installed), else 0.05, 0.25, 1e-4 read back by transformers; 1e-4 for the merge before it.
        tolerance: float | None = Field(None, ge=0)
        # Who writes the file: "auto" (this exporter for llama, mistral and qwen2, llama.cpp's
        # convert_hf_to_gguf.py for every other architecture), "llama.cpp" or "ftcore" for all.
        converter: Literal["auto", "llama.cpp", "ftcore"] = "auto"
        # Where llama.cpp's converter is: a llama.cpp tree or a llama-cpp-python sdist; unset:
        # $FTCORE_LLAMA_CPP, then where `python -m ftcore_plugins.exporters.llama_cpp_converter` put it.
        converter_path: str | None = None

    def check(self, plan) -> list[str]:
        if (vlm := plan_vision_model(plan)) is not None:
            return [f"use: {refusal(self.name, vlm, VISION_WHY)}"]
        if (family := seq2seq.plan_encoder_decoder(plan)) is not None:
            return [f"use: {seq2seq.refusal(f'exporter {self.name!r}', family, SEQ2SEQ_WHY, SEQ2SEQ_FIX)}"]
        problems = []
        if importlib.util.find_spec("gguf") is None:
            problems.append(f"use: exporter 'gguf' needs the gguf package, which is not installed: {PIP_GGUF}")
        kind = model_type(plan)
        if (why := self.unsupported(kind, model_classes(plan) if kind else None)) is not None:
            problems.append(f"{'converter' if self.options.converter != 'auto' else 'use'}: {why}")
        converted = uses_converter(self.options.converter, kind)
        if converted and importlib.util.find_spec("sentencepiece") is None:
            problems.append(f"use: llama.cpp's converter, which writes {kind!r} models, needs sentencepiece: "
                            f"{PIP_SENTENCEPIECE}")
        scaling = getattr(plan.model.options, "rope_scaling", None)  # the hf loader's [model] rope_scaling
        if scaling is not None and (converted or scaling.type != "linear"):
            # The converter's check reads the base model's config.json, which has no scaling yet.
            writer = "llama.cpp's converter (its check reads the unscaled config)" if converted else \
                "ftcore's GGUF writer (it writes linear scaling only)"
            problems.append(f"use: a {scaling.type} rope_scaling is not written by {writer}; export \"merged\" and "
                            "convert that, or leave the gguf export out")
        if not problems and kind is not None:
            # What the writer will do with this config and tokenizer, before any training.
            why = self.converter_problem(plan, kind) if converted else writer_tokenizer_problem(
                plan, kind, self.options.pre_tokenizer)
            if why is not None:
                problems.append(f"use: {why}")
        native = [t for t in self.options.types if t in LLAMA_CPP_TYPES or (converted and t not in CONVERTER_TYPES)]
        if native and importlib.util.find_spec("llama_cpp") is None:
            choose = CONVERTER_TYPES if converted else PYTHON_TYPES
            problems.append(f"types: {', '.join(native)} need llama.cpp's quantizer, and llama-cpp-python is not "
                            f"installed: {PIP_LLAMA_CPP}; or choose from {', '.join(choose)}")
        return problems

    def unsupported(self, kind: str | None, classes: list[str] | None) -> str | None:
        return unsupported_architecture(kind, classes, self.options.converter, self.options.converter_path)

    def converter_problem(self, plan, kind: str) -> str | None:
        """Why llama.cpp's converter cannot write the plan's model, from its config and tokenizer alone
        (``llama_cpp_converter.check``: the converter's own code on the tensors' shapes, without the weights, and
        llama.cpp loading the file without its data), or None, also when
        neither is known before loading (a hub id not in the local cache). It runs in a process that imports
        torch and the converter, several seconds; the answer is cached by the files and options it read."""
        tree = converter.find_converter(self.options.converter_path)
        with tempfile.TemporaryDirectory(prefix="ftcore-gguf-check-") as tmp:
            job = converter_job(plan, Path(tmp))
            if job is None:
                return None
            classes = job["architectures"] or [kind]
            key = check_key(tree, job, self.options.pre_tokenizer)
            saved = cache_dir() / "gguf-check" / f"{key}.json"
            if saved.is_file():
                why = json.loads(saved.read_text(encoding="utf-8"))["problem"]
            else:
                [why] = converter.check(tree, [job], self.options.pre_tokenizer)
                if why is None or not why.startswith("its check "):  # not a check that could not run
                    saved.parent.mkdir(parents=True, exist_ok=True)
                    saved.write_text(json.dumps({"problem": why}), encoding="utf-8")
        return None if why is None else \
            f"llama.cpp's converter ({tree.name}) cannot write this {kind!r} model ({classes[0]}): {why}"

    def export(self, ctx):
        refuse_loaded(ctx, ctx.model, self.name, VISION_WHY)
        model, merge = merge_verified(ctx, "float32", self.options.tolerance, self.name)
        config = model.config
        kind = config.model_type
        if (why := self.unsupported(kind, class_names(kind, getattr(config, "architectures", None)))) is not None:
            raise FtcoreError(f"export '{ctx.name}': {why}")
        ctx.path.mkdir(parents=True, exist_ok=True)
        stem = ctx.run.plan.run_name
        inputs = verification_inputs(ctx)
        expected = logits(model, inputs)
        verification = {f"merge {k}": v for k, v in merge.items()}
        targets = {t: ctx.path / f"{stem}-{t}.gguf" for t in self.options.types}
        end_of_turn = end_of_turn_token(ctx.template, ctx.tokenizer)
        eot = ctx.tokenizer.convert_tokens_to_ids(end_of_turn) if end_of_turn is not None else None
        converted = uses_converter(self.options.converter, kind)
        # In the export's own folder: a model's worth of disk, which /tmp may not have.
        with tempfile.TemporaryDirectory(dir=ctx.path, prefix=".work-") as tmp:
            if converted:
                tree = converter.find_converter(self.options.converter_path)
                folder = Path(tmp) / "model"
                model.save_pretrained(folder)
                ctx.tokenizer.save_pretrained(folder)
                complete_tokenizer_files(folder, ctx.tokenizer, ctx.run.plan)
                model = None
                self._release(ctx)
                self._convert(tree, folder, targets, stem, eot, Path(tmp))
                verification["written by"] = f"llama.cpp's convert_hf_to_gguf.py ({tree.name})"
            else:
                self._write_all(ctx, model, targets, stem, eot, Path(tmp))
                model = None
                self._release(ctx)
            for gguf_type, target in targets.items():
                ctx.reporter.info(f"gguf: wrote {target.name} ({target.stat().st_size / 2**20:.1f} MiB)")
            # llama.cpp reads a file in under a second where transformers' reader builds a float32 model
            by_llama_cpp = converted or importlib.util.find_spec("llama_cpp") is not None
            for gguf_type, target in targets.items():
                check = self.verify_llama_cpp if by_llama_cpp else self.verify
                verification.update(check(target, gguf_type, inputs, expected))
                verification[f"{gguf_type} bytes"] = target.stat().st_size
        if end_of_turn is not None:
            verification["end of turn"] = f"{end_of_turn} ({eot})"
        ctx.reporter.log(f"export:{ctx.name}", {k: v for k, v in verification.items() if isinstance(v, (int, float))})
        shown = self.options.types[-1]
        text = ollama_modelfile(ctx, f"./{stem}-{shown}.gguf", end_of_turn)
        (ctx.path / "Modelfile").write_text(text, encoding="utf-8")
        write_card(ctx.path, ctx, title="GGUF model", library="gguf", tags=["gguf", "llama.cpp"],
                   usage=USAGE.format(file=card_path(ctx, final_path(ctx) / f"{stem}-{shown}.gguf"),
                                      modelfile=card_path(ctx, final_path(ctx) / "Modelfile")),
                   verification=verification,
                   extra=f"Ollama: `Modelfile` beside the files (its TEMPLATE is the chat template as Ollama's Go "
                         f"template, its stop the end-of-turn token):\n\n```\n{text}```\n")
        return ctx.path

    @staticmethod
    def _release(ctx) -> None:
        """Where the run gives the model up, it goes once the expected logits are known and it is
        written: each file is read back, or converted, without it in memory."""
        if ctx.consume and ctx.last and ctx.release_model is not None:
            ctx.model = ctx.merged = None
            ctx.release_model()

    def _write_all(self, ctx, model, targets: dict[str, Path], stem: str, eot: int | None, tmp: Path) -> None:
        import torch

        config = model.config
        state = {name: t.detach().to("cpu", torch.float32).numpy() for name, t in model.state_dict().items()}
        if config.tie_word_embeddings:
            state.pop("lm_head.weight", None)  # llama.cpp uses token_embd when output.weight is absent
        tokenizer_dir = tmp / "tokenizer"
        ctx.tokenizer.save_pretrained(tokenizer_dir)
        for gguf_type, target in targets.items():
            if gguf_type in PYTHON_TYPES:
                self._write(target, gguf_type, config, state, ctx.tokenizer, tokenizer_dir, stem, eot)
            else:
                source = targets.get("f16", tmp / "f16.gguf")
                if not source.exists():
                    self._write(source, "f16", config, state, ctx.tokenizer, tokenizer_dir, stem, eot)
                llama_cpp_quantize(source, target, gguf_type)

    def _convert(self, tree: Path, folder: Path, targets: dict[str, Path], stem: str, eot: int | None,
                 tmp: Path) -> None:
        """The files llama.cpp's converter writes (f32, f16, bf16, q8_0), in one run of it; the other types by
        llama.cpp's quantizer from its f16 file."""
        written = {t: path for t, path in targets.items() if t in CONVERTER_TYPES}
        if any(t not in CONVERTER_TYPES for t in targets) and "f16" not in written:
            written["f16"] = tmp / "f16.gguf"
        convert_with_llama_cpp(tree, folder, written, stem, eot, self.options.pre_tokenizer)
        for gguf_type, target in targets.items():
            if gguf_type not in CONVERTER_TYPES:
                llama_cpp_quantize(written["f16"], target, gguf_type)

    def verify_llama_cpp(self, path: Path, gguf_type: str, inputs, expected) -> dict[str, Any]:
        """A file read back by llama.cpp: checked for 16/32-bit files (``tolerance``, else a fraction of the
        largest logit), recorded for quantized ones."""
        if importlib.util.find_spec("llama_cpp") is None:
            return {f"{gguf_type} read back by": "nothing: llama-cpp-python is not installed"}
        diff = max_abs_diff(llama_cpp_logits(path, inputs), expected)
        record = {f"{gguf_type} max_abs_logit_diff": diff, f"{gguf_type} read back by": "llama.cpp"}
        if gguf_type not in CHECKED_BY_LLAMA_CPP:
            return record
        scale = max(float(e.abs().max()) for e in expected)
        limit = self.options.tolerance if self.options.tolerance is not None else \
            CHECKED_BY_LLAMA_CPP[gguf_type] * scale
        if diff > limit:
            path.unlink()  # ours, just written, and wrong
            raise FtcoreError(f"exporter 'gguf': {path.name} read back by llama.cpp gives logits up to {diff:.3g} "
                              f"from the merged model's, above tolerance {limit:.3g}; it was removed")
        return {**record, f"{gguf_type} tolerance": limit}

    def verify(self, path: Path, gguf_type: str, inputs, expected) -> dict[str, Any]:
        """Without llama-cpp-python: the max abs logit difference of the file's model, read by transformers'
        GGUF reader, from the merged model: checked for 16/32-bit files, recorded for the quantized types
        transformers can read."""
        import torch
        from transformers import AutoModelForCausalLM

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

    def _write(self, path: Path, gguf_type: str, config, state, tokenizer, tokenizer_dir: Path, name: str,
               eot: int | None = None) -> None:
        import gguf

        arch = ARCHITECTURES[config.model_type]
        # Tensors go to a temporary file as they are made (in memory up to 256 MiB, then on disk),
        # not held until the header is written: no further copy of the model in memory.
        writer = gguf.GGUFWriter(path, arch, use_temp_file=True)
        writer.add_type(gguf.GGUFType.MODEL)
        writer.add_name(name)
        add_hyperparameters(writer, config, arch, file_type(gguf_type))
        add_tokenizer(writer, tokenizer, tokenizer_dir, config.vocab_size, self.options.pre_tokenizer, eot)
        add_tensors(writer, config, arch, state, gguf.GGMLQuantizationType[gguf_type.upper()])
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()


def end_of_turn_token(template, tokenizer) -> str | None:
    """The token that closes an assistant turn under the plan's template, where generation stops: its
    declared end of turn, else the one its renderings show (``native`` and ``jinja`` files), else EOS;
    None when that is not one token of the tokenizer."""
    from ftcore_plugins.common.spans import SpanLocator

    try:
        candidates = SpanLocator(template, tokenizer).end_tokens()
    except Exception:  # noqa: BLE001 - a template that cannot render the probes: its declared end, or EOS
        end = getattr(template, "end_of_turn", None)
        candidates = [c for c in (end(tokenizer) if callable(end) else None, tokenizer.eos_token) if c]
    vocab = tokenizer.get_vocab()
    return next((str(c) for c in candidates if str(c) in vocab), None)


def ollama_modelfile(ctx, file: str, end_of_turn: str | None) -> str:
    """The export's Ollama Modelfile: FROM the file, the plan's template as a Go TEMPLATE, its stops."""
    tokenizer = ctx.tokenizer
    stops = [t for t in (end_of_turn, tokenizer.eos_token) if t]
    adds_bos = tokenizer.bos_token_id is not None and tokenizer("a")["input_ids"][:1] == [tokenizer.bos_token_id]
    return modelfile(file, lambda messages, prompt: ctx.template.render(messages, tokenizer,
                                                                         add_generation_prompt=prompt),
                     stops, bos_token=tokenizer.bos_token, adds_bos=adds_bos)


def complete_tokenizer_files(folder: Path, tokenizer, plan) -> None:
    """What llama.cpp's converter reads of a SentencePiece tokenizer, where transformers 5 no longer saves
    it: ``tokenizer.model`` (from where the tokenizer was loaded) and ``added_tokens_decoder`` in
    ``tokenizer_config.json`` (the tokens added to it, the template's included)."""
    if (folder / "tokenizer.model").exists():
        return
    source = sentencepiece_model(tokenizer, plan)
    if source is None:
        return  # a byte-level BPE tokenizer (tokenizer.json only); the converter reads that itself
    import shutil

    shutil.copyfile(source, folder / "tokenizer.model")
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
    config.setdefault("tokenizer_class", type(tokenizer).__name__.removesuffix("Fast"))
    config.setdefault("added_tokens_decoder", {
        str(i): {"content": t.content, "lstrip": t.lstrip, "normalized": t.normalized, "rstrip": t.rstrip,
                 "single_word": t.single_word, "special": t.special}
        for i, t in sorted(tokenizer.added_tokens_decoder.items())})
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False), encoding="utf-8")


def sentencepiece_model(tokenizer, plan) -> Path | None:
    """The SentencePiece model file the tokenizer was built from, if it has one and its pieces are the
    tokenizer's tokens: where it was loaded from, the plan's model or tokenizer folder, or the hub cache."""
    backend = json.loads(tokenizer.backend_tokenizer.to_str()) if getattr(tokenizer, "is_fast", False) else {}
    model = backend.get("model", {})
    if model.get("type") == "BPE" and not model.get("byte_fallback"):
        return None  # byte-level BPE: no SentencePiece model behind it
    names = [getattr(tokenizer, "vocab_file", None), (getattr(tokenizer, "init_kwargs", None) or {}).get("vocab_file")]
    origins = [getattr(tokenizer, "name_or_path", None)]
    options = plan.model.options
    origins += [str(v) for v in (getattr(options, "tokenizer", None), getattr(options, "path", None)) if v]
    candidates = [Path(str(n)) for n in names if n]
    for origin in filter(None, origins):
        candidates.append(Path(origin) / "tokenizer.model")
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(origin, "tokenizer.model")
            if isinstance(cached, str):
                candidates.append(Path(cached))
        except Exception:  # noqa: BLE001 - not a hub id
            pass
    for candidate in candidates:
        if candidate.is_file() and same_pieces(candidate, tokenizer):
            return candidate
    return None


def same_pieces(path: Path, tokenizer) -> bool:
    """Whether the SentencePiece model at ``path`` has the tokenizer's tokens at the same ids."""
    try:
        from sentencepiece import SentencePieceProcessor

        sp = SentencePieceProcessor(model_file=str(path))
    except Exception:  # noqa: BLE001 - not installed (the converter will say so), or not a SentencePiece model
        return False
    inverse = {i: t for t, i in tokenizer.get_vocab().items()}
    return all(inverse.get(i) == sp.id_to_piece(i) for i in range(sp.get_piece_size()))


def convert_with_llama_cpp(tree: Path, folder: Path, targets: dict[str, Path], name: str, eot: int | None,
                           pre_tokenizer: str | None = None) -> None:
    """llama.cpp's convert_hf_to_gguf.py on the merged model's folder, once for each type, with the template's
    end of turn as ``tokenizer.ggml.eot_token_id`` (the converter sets one only for a few families, Gemma's from a
    fixed id)."""
    [why] = convert_models(tree, [(folder, targets)], name, eot, pre_tokenizer)
    if why is not None:
        if "No module named 'sentencepiece'" in why:
            why += f" ({PIP_SENTENCEPIECE})"
        raise FtcoreError(f"exporter 'gguf': llama.cpp's converter ({tree}) failed: {why}")


def convert_models(tree: Path, models: list[tuple[Path, dict[str, Path]]], name: str | None = None,
                   eot: int | None = None, pre_tokenizer: str | None = None) -> list[str | None]:
    """Each model folder's files (type -> path) by llama.cpp's converter, all in one run of it: why each model
    failed, or None. A model that ties its output layer to its token embedding has no output tensor, which
    llama.cpp requires of some architectures (OLMo 2, GPT-NeoX, GPT-OSS, Qwen2-MoE, ...) and not of others
    (Llama, Qwen3, Gemma: they reuse the embedding); where llama.cpp refuses the file for it, the model is
    converted again with the output layer written out (a copy of the embedding)."""
    def run(chosen: list[int], untie: bool) -> dict[int, str | None]:
        jobs = [(models[i][0], target, t) for i in chosen for t, target in models[i][1].items()]
        reasons, _ = converter.convert(tree, jobs, name, eot, pre_tokenizer, untie=untie)
        found: dict[int, str | None] = {}
        for (folder, _, _), why in zip(jobs, reasons):
            i = next(i for i in chosen if models[i][0] == folder)
            found[i] = found.get(i) or why
        return found

    outcome = run(list(range(len(models))), untie=False)
    again = [i for i, why in outcome.items() if why is None and lacks_output(next(iter(models[i][1].values())))]
    if again:
        outcome.update(run(again, untie=True))
    return [outcome[i] for i in range(len(models))]


def lacks_output(path: Path) -> bool:
    """Whether llama.cpp refuses this file for want of an output tensor (where llama-cpp-python is installed)."""
    if importlib.util.find_spec("llama_cpp") is None:
        return False
    try:
        load_gguf(path, n_ctx=16, verbose=False).close()
    except ValueError as exc:
        return "'output.weight' not found" in str(exc)
    return False


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


def add_tokenizer(writer, tokenizer, tokenizer_dir: Path, vocab_size: int, pre_tokenizer: str | None,
                  eot: int | None = None) -> None:
    """A byte-level BPE tokenizer as llama.cpp's "gpt2" model: tokens, types, merges, special ids (the
    template's end of turn as ``eot_token_id``, where llama.cpp stops), template."""
    import gguf

    backend = json.loads(tokenizer.backend_tokenizer.to_str()) if getattr(tokenizer, "is_fast", False) else {}
    if backend.get("model", {}).get("type") != "BPE" or backend.get("model", {}).get("byte_fallback"):
        raise FtcoreError("exporter 'gguf' embeds byte-level BPE tokenizers (GPT-2, Llama 3, Qwen2 style); this "
                          "tokenizer is not one: convert the 'merged' export with llama.cpp's convert_hf_to_gguf.py")
    pre = pre_tokenizer or converter.bpe_pre_tokenizer(backend)  # the tokenizer's JSON, parsed once (7 MB for Qwen's)
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
    if eot is not None:
        special.special_token_ids["eot"] = eot
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
