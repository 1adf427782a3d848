"""What runs inside llama.cpp's converter process (:mod:`ftcore_plugins.exporters.llama_cpp_converter` starts
it): ftcore's patches to ``convert_hf_to_gguf.py``, and the check ``ftcore validate`` runs on a model's config
and tokenizer, without weights, through the converter's own code.

The check (``check_folder``) is the converter's ``write()`` on the tensors the model saves, known without their
values: transformers builds the model from its config on the meta device, and its state dict, as
``save_pretrained`` writes it, gives each tensor's name, shape and dtype. The converter maps and reshapes them
(``prepare_tensors``, its ``modify_tensors``), sets every metadata key and the tokenizer, and the file is written
with its header, metadata and tensor infos, the data section a hole (a sparse file: a 30B model's costs a few
MB of disk). llama.cpp then loads it without data (``no_alloc``): the vocabulary, every key, and each tensor's
name and shape against those its architecture creates (the shapes a family's converter gets wrong for a config:
an OLMoE with grouped key/value heads, a Gemma 3 whose embedding has more rows than its tokenizer has tokens).

That process puts the converter's tree (its ``conversion`` package and ``gguf-py``) first on ``sys.path`` and
then imports this module: it imports nothing but the standard library at the top, so the converter's own
``gguf`` is the one every later import gets.

The patches, each for a model transformers saved (the exporter converts nothing else):

- the end-of-turn token id as ``tokenizer.ggml.eot_token_id`` (the converter sets one only for a few families);
- config keys the converter still reads by their old names, which transformers 5 folds into others or drops
  (``LEGACY_KEYS``): the converter reads a config through transformers (``AutoConfig(...).to_dict()``), so
  GPT-2 failed with ``KeyError: 'n_ctx'`` and GPT-NeoX with ``KeyError: 'rotary_pct'``;
- no multi-token-prediction (MTP) block: transformers drops those weights when it loads Qwen3-Next, Qwen3.5,
  GLM-4.5 and DeepSeek checkpoints, and the converter asserted on their absence (as its ``--no-mtp`` does);
- Falcon's single key/value head where ``multi_query`` says so (transformers' own rule; the converter took
  ``num_kv_heads``, which transformers sets to the number of heads, and failed reshaping the fused weight);
- Granite 4's layer types by transformers 5's names (``full_attention``, ``linear_attention``): the converter
  took every layer for a Mamba one, and llama.cpp refused the file;
- a byte-level BPE pre-tokenizer the converter does not know by its hash (a tokenizer trained here, or any
  whose token ids differ from the published model's) named from its regex, as ftcore's own writer names it,
  or from the exporter's ``pre_tokenizer``;
- on request (``untie``), a tied output layer written out under its own name, for the llama.cpp architectures
  that load a file only with one (the exporter asks where llama.cpp refused the first file for it).
"""

from __future__ import annotations

import copy
import json
import sys
import traceback
from pathlib import Path
from typing import Any

# Where a failure was, by the converter's functions on the stack: reading the tokenizer, else the config.
TOKENIZER_FRAMES = ("set_vocab", "_set_vocab_", "get_vocab_base", "_create_vocab_", "SpecialVocab", "_try_load")
# ... mapping and reshaping the model's tensors.
TENSOR_FRAMES = ("prepare_tensors", "modify_tensors", "generate_extra_tensors")
# Texts for a stand-in of the scratch loader's tokenizer (trained on the plan's data at run time): the same
# trainer on these gives a tokenizer of the same kind (byte-level BPE, GPT-2's regex, its special tokens).
SAMPLE = ["The quick brown fox jumps over the lazy dog.", "Which word is an animal? red cat tree 42",
          "Hello, world! It's 3.14 and 1,000 items.", "def main():\n    return 0\n"]


def main(argv: list[str]) -> int:
    """``convert OPTIONS RESULTS SCRIPT -- ARGS... [-- ARGS...]``: the converter's command line, patched by the
    JSON ``OPTIONS`` (``eot``, ``pre_tokenizer``, ``untie``), once for each ``--`` group, the outcome of each (a
    reason or null) written to the JSON file RESULTS; or ``check PRE JOBS RESULTS``: each job of the JSON file
    JOBS checked, the answers (a reason or null each) to RESULTS."""
    mode, rest = argv[0], argv[1:]
    if mode == "convert":
        options, results, script = json.loads(rest[0]), rest[1], rest[2]
        patch(options.get("eot"), options.get("pre_tokenizer"), untie=options.get("untie", False))
        answers = []
        for args in split_groups(rest[3:]):
            answers.append(run_converter(script, args))
            Path(results).write_text(json.dumps(answers), encoding="utf-8")  # what is done, if a later one crashes
        return 0
    pre, jobs, results = rest[0] or None, Path(rest[1]), Path(rest[2])
    patch(None, pre)
    answers = [check(job) for job in json.loads(jobs.read_text(encoding="utf-8"))]
    Path(results).write_text(json.dumps(answers), encoding="utf-8")
    return 0


def split_groups(argv: list[str]) -> list[list[str]]:
    groups: list[list[str]] = []
    for arg in argv:
        if arg == "--":
            groups.append([])
        else:
            groups[-1].append(arg)
    return groups


def run_converter(script: str, args: list[str]) -> str | None:
    """``convert_hf_to_gguf.py ARGS`` in this process (its imports are done once for every file): None, or why
    it failed (its traceback goes to stderr, as its own run would print it)."""
    import logging
    import runpy

    errors: list[str] = []

    class Errors(logging.Handler):  # the converter logs why before it exits (an unsupported model, ...)
        def emit(self, record: logging.LogRecord) -> None:
            errors.append(record.getMessage())

    handler = Errors(logging.ERROR)
    logging.getLogger().addHandler(handler)
    sys.argv = [script, *args]
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (None, 0):
            return " ".join((errors[-1] if errors else f"it exited with status {exc.code}").split())
    except Exception as exc:  # noqa: BLE001 - the converter's own error is the answer
        traceback.print_exc()
        return " ".join(f"{type(exc).__name__}: {exc}".split())
    finally:
        logging.getLogger().removeHandler(handler)
    return None


def patch(eot: int | None, pre: str | None, untie: bool = False) -> None:
    """The converter as ftcore runs it (the module's docstring); ``untie``: a model that ties its output layer
    to its token embedding gets the output layer written out, for the llama.cpp architectures that read a file
    only with one (the exporter converts again with it when llama.cpp says so)."""
    import gguf

    from ftcore_plugins.exporters.llama_cpp_converter import LEGACY_KEYS, LEGACY_ROPE_KEYS, bpe_pre_tokenizer

    if eot is not None:  # set just before the header is written (a key set twice keeps the last value)
        write_header = gguf.GGUFWriter.write_header_to_file

        def with_eot(self, *args, **kwargs):
            self.add_eot_token_id(eot)
            return write_header(self, *args, **kwargs)

        gguf.GGUFWriter.write_header_to_file = with_eot
    try:
        import conversion
        from conversion.base import ModelBase, TextModel  # the converter's own modules (llama.cpp since 2026)
    except ImportError:
        return  # an older tree: the script defines its classes itself, and runs unpatched
    load_hparams = ModelBase.load_hparams

    def with_legacy_keys(*args, **kwargs):
        config = load_hparams(*args, **kwargs)
        for part in (config, config.get("text_config") or {}):
            rope = part.get("rope_parameters") or {}
            for old, new in LEGACY_ROPE_KEYS.items():
                if old not in part and isinstance(rope, dict) and new in rope:
                    part[old] = rope[new]
            for old, new in LEGACY_KEYS.items():
                if old not in part and new in part:
                    part[old] = part[new]
        if config.get("model_type") == "falcon" and config.get("multi_query") \
                and not config.get("new_decoder_architecture"):
            config["num_kv_heads"] = 1  # transformers' FalconAttention: one key/value head, whatever num_kv_heads says
        return config

    ModelBase.load_hparams = staticmethod(with_legacy_keys)
    get_model_class = conversion.get_model_class

    def without_mtp(name: str, mmproj: bool = False):
        cls = get_model_class(name, mmproj)
        if getattr(cls, "supports_mtp_export", False) and not getattr(cls, "mtp_only", False):
            cls.no_mtp = True
        return cls

    conversion.get_model_class = without_mtp  # the script imports it from the package after this
    try:
        from conversion.granite import GraniteHybridModel
    except ImportError:
        GraniteHybridModel = None
    if GraniteHybridModel is not None:
        attn_layers = GraniteHybridModel.get_attn_layers

        def with_new_layer_names(self):
            # transformers 5 names Granite-4's "mamba" and "attention" layers "linear_attention" and
            # "full_attention", and the converter took every layer for a Mamba one (llama.cpp: ssm_in not found).
            names = self.hparams.get("layer_types") or []
            if "full_attention" in names and "attention" not in names:
                return [i for i, name in enumerate(names) if name == "full_attention"]
            return attn_layers(self)

        GraniteHybridModel.get_attn_layers = with_new_layer_names
    if untie:
        prepare_tensors = ModelBase.prepare_tensors

        def with_output(self):
            add_output(self)
            return prepare_tensors(self)

        ModelBase.prepare_tensors = with_output
    by_hash = TextModel.get_vocab_base_pre

    def named_pre_tokenizer(self, tokenizer):
        if pre:
            return pre
        try:
            return by_hash(self, tokenizer)
        except NotImplementedError:
            backend = json.loads(tokenizer.backend_tokenizer.to_str()) if getattr(tokenizer, "is_fast", False) else {}
            name = bpe_pre_tokenizer(backend)
            if name is None:
                raise NotImplementedError(
                    "llama.cpp's converter does not know this byte-level BPE tokenizer's pre-tokenizer by its hash, "
                    "nor ftcore by its regex; set pre_tokenizer = \"<name>\" on the [[export]] (a name from "
                    "llama.cpp's llama-vocab.cpp that splits text the same way)") from None
            return name

    TextModel.get_vocab_base_pre = named_pre_tokenizer


def add_output(model: Any) -> bool:
    """A tied output layer written out: the token embedding's tensor under the output layer's name, where the
    model has no output tensor of its own (the ``untie`` patch). Whether it added one."""
    import gguf

    tensors = model.model_tensors
    names = {name: model.tensor_map.get_name(name, try_suffixes=(".weight", ".bias")) for name in tensors}
    embedding = next((n for n, mapped in names.items()
                      if mapped == model.format_tensor_name(gguf.MODEL_TENSOR.TOKEN_EMBD)), None)
    if embedding is None or model.format_tensor_name(gguf.MODEL_TENSOR.OUTPUT) in names.values():
        return False
    tensors["lm_head.weight"] = tensors[embedding]  # the tied weight, under the output layer's name
    return True


def check(job: dict[str, Any]) -> str | None:
    """Why llama.cpp's converter (and llama.cpp) cannot write this model, or None: what the converter does
    with it short of reading a weight's values, and llama.cpp loading the result without them. ``job``:
    ``folder`` (a config.json and tokenizer files, no weights; for the scratch loader an empty folder and
    ``scratch``, its options, built here as the loader builds them), ``architectures`` (the class names
    transformers saves), ``tokenizer`` (whether its files are there)."""
    folder = Path(job["folder"])
    try:
        if job.get("scratch") is not None:
            build_scratch(folder, job["scratch"], job.get("architectures"))
        try:
            why = check_folder(folder, job.get("architectures"), job.get("tokenizer", True))
        except NeedsWeights:  # a converter step read a weight's values past prepare_tensors: the check without them
            why = check_folder(folder, job.get("architectures"), job.get("tokenizer", True), tensors=False)
        return clean(why, folder)
    except Exception as exc:  # noqa: BLE001 - anything the converter raises is the answer
        frames = [frame.name for frame in traceback.extract_tb(exc.__traceback__)]
        part = "tokenizer" if any(name.startswith(TOKENIZER_FRAMES) for name in frames) else \
            "tensors" if any(name.startswith(TENSOR_FRAMES) for name in frames) else "config"
        return clean(f"its {part}: {type(exc).__name__}: {exc}", folder)


def check_folder(folder: Path, architectures: list[str] | None, tokenizer: bool, tensors: bool = True) -> str | None:
    """``check`` on a folder: the converter's ``write()`` on the tensors the model saves, their shapes without
    data (``tensors``), then llama.cpp loading the file it writes, without the data."""
    import gguf
    from conversion import ModelBase, ModelType, get_model_architecture
    import conversion

    hparams = ModelBase.load_hparams(folder, False)
    if not hparams.get("architectures") and architectures:
        hparams["architectures"] = list(architectures)  # transformers writes them when it saves the model
    arch = get_model_architecture(hparams, ModelType.TEXT)
    try:
        cls = conversion.get_model_class(arch)
    except NotImplementedError:
        return f"it does not convert {arch}"
    out = folder / "check.gguf"
    model = cls(folder, gguf.LlamaFileType.MOSTLY_F16, out, hparams=copy.deepcopy(hparams))
    # The converter's write(), on the tensors the model saves (shapes, no data): each tensor mapped and reshaped
    # as its modify_tensors does, into the writer's tensor infos; then every metadata key (set_gguf_parameters)
    # and the tokenizer (set_vocab). Where a step reads a weight's values (a few converters compare or read
    # one: NeedsWeights), check() runs this again without the tensors: the converter's --vocab-only.
    state = saved_tensors(folder, arch) if tensors else None
    shapes = bool(state)
    if shapes:
        with_tensors(model, state)
        model.prepare_tensors()
    if not tokenizer:
        model.set_gguf_parameters()
        return None
    rows = model.hparams.get("vocab_size")  # the embedding's (a converter may pad its own copy)
    model.prepare_metadata(vocab_only=not shapes)
    keys = {k: v.value for k, v in model.gguf_writer.kv_data[0].items()}
    tokens = len(keys.get(gguf.Keys.Tokenizer.LIST) or []) or None
    if tokens is not None and isinstance(rows, int) and tokens != rows:
        return (f"it writes a vocabulary of {tokens} tokens for an embedding of {rows} rows (vocab_size), and "
                f"llama.cpp loads a file only where they match")
    # M-RoPE sections wider than a head: llama.cpp's rope kernel asserts on the first token (it aborts the
    # process) where the converter writes its default sections (Qwen3.5's [11, 11, 10]) for narrower heads.
    name = keys.get(gguf.Keys.General.ARCHITECTURE)
    sections, head = keys.get(f"{name}.rope.dimension_sections"), keys.get(f"{name}.attention.key_length")
    if sections and head and sum(sections) > head:
        return (f"it writes rope sections {list(sections)} ({sum(sections)} dimensions) for heads of {head}, on which "
                f"llama.cpp's rope kernel aborts; heads of at least {sum(sections)} (head_dim), or mrope_section in "
                f"rope_parameters, fit")
    # The file as the export writes it, without its data, loaded by llama.cpp: the vocabulary, every key and,
    # with the tensors, each one's name and shape against those llama.cpp's architecture creates.
    write_without_data(model.gguf_writer, out)
    why = llama_cpp_loads(out, vocab_only=not shapes)
    if shapes and why is not None and "'output.weight' not found" in why:
        # As the export does where llama.cpp wants an output layer: the tied one written out (convert_models).
        again = cls(folder, gguf.LlamaFileType.MOSTLY_F16, out, hparams=copy.deepcopy(hparams))
        with_tensors(again, state)
        if add_output(again):
            again.prepare_tensors()
            again.gguf_writer.kv_data = model.gguf_writer.kv_data  # the same keys and vocabulary
            write_without_data(again.gguf_writer, out)
            why = llama_cpp_loads(out)
    return why


class NeedsWeights(Exception):
    """A step of the converter that reads a weight's values, not only its shape: not known without the weights."""


def saved_tensors(folder: Path, architecture: str) -> dict[str, Any] | None:
    """The model's tensors as ``save_pretrained`` writes them, on the meta device (names, shapes, dtypes, no
    data), from its config: transformers' own model class built on the meta device, its state dict with what
    saving leaves out (tied weights, ignored keys) left out and transformers 5's load-time conversions reverted
    (MoE experts fused into 3-D parameters are saved one tensor per expert). None where transformers cannot build
    it (a family it has no class for)."""
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        # What save_pretrained does to the state dict (transformers 5); another transformers: no shapes.
        from transformers.core_model_loading import revert_weight_conversion
        from transformers.modeling_utils import remove_tied_weights_from_state_dict

        config = AutoConfig.from_pretrained(folder)
        model_class = getattr(transformers, architecture, None) or AutoModelForCausalLM
        with torch.device("meta"):
            model = model_class._from_config(config) if hasattr(model_class, "_from_config") \
                else model_class.from_config(config)
        state = model.state_dict()
        for key in getattr(model, "_keys_to_ignore_on_save", None) or []:
            state.pop(key, None)
        return revert_weight_conversion(model, remove_tied_weights_from_state_dict(state, model))
    except Exception:  # noqa: BLE001 - no model to take the shapes from: the check without them
        return None


def with_tensors(model: Any, state: dict[str, Any]) -> None:
    """The converter's model given the saved tensors (``saved_tensors``) as its lazy tensors, as it indexes them
    from safetensors files, each one raising ``NeedsWeights`` where its values are asked for."""
    from conversion.base import LazyTorchTensor

    def values(name: str):
        def unknown():
            raise NeedsWeights(name)
        return unknown

    tensors = {}
    for name, tensor in state.items():
        meta = tensor.detach()  # a plain meta tensor (the state dict's are parameters)
        item = model.filter_tensors((name, lambda meta=meta, name=name: LazyTorchTensor(
            meta=meta, args=(), func=values(name))))
        if item:
            tensors[item[0]] = item[1]
    model.model_tensors = tensors


def write_without_data(writer: Any, path: Path) -> None:
    """The GGUF file as the converter writes it, header, metadata and tensor infos, with its data section a hole:
    a sparse file of the full size, so a 60 GB model costs no disk and llama.cpp finds every tensor in bounds."""
    import os

    writer.write_header_to_file(path=path)
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    [infos] = writer.tensors
    size = sum(writer.ggml_pad(info.nbytes, writer.data_alignment) for info in infos.values())
    for info in infos.values():
        info.tensor = None  # never evaluated
    [fout] = writer.fout
    writer.write_padding(fout, fout.tell())
    fout.flush()
    os.truncate(fout.fileno(), fout.tell() + size)
    writer.close()


def llama_cpp_loads(path: Path, vocab_only: bool = False) -> str | None:
    """llama.cpp's reason for refusing the file the converter wrote (where llama-cpp-python is installed): a
    model load without its data (``no_alloc``: no buffer, no read), which checks every key, the vocabulary and
    each tensor's name and shape as llama.cpp creates the architecture's tensors, and their number."""
    import importlib.util

    if importlib.util.find_spec("llama_cpp") is None:
        return None
    import ctypes

    import llama_cpp._logger
    from llama_cpp import llama_cpp as lib

    from ftcore_plugins.common.run_model import GGML_LOG_CONT, GGML_LOG_ERROR

    errors: list[str] = []
    level = [0]
    reached_data = [False]

    @lib.llama_log_callback
    def keep_errors(at: int, text: bytes, user_data: Any) -> None:
        if at == GGML_LOG_ERROR or (at == GGML_LOG_CONT and level[0] == GGML_LOG_ERROR):
            errors.append(text.decode("utf-8", "replace"))
        level[0] = at if at != GGML_LOG_CONT else level[0]

    @lib.llama_progress_callback
    def stop(progress: float, user_data: Any) -> bool:
        reached_data[0] = True  # past every shape check; there is no data to read
        return False

    lib.llama_log_set(keep_errors, ctypes.c_void_p(0))
    try:
        lib.llama_backend_init()
        params = lib.llama_model_default_params()
        params.vocab_only = vocab_only
        params.no_alloc = True
        params.n_gpu_layers = 0
        params.load_mode = lib.LLAMA_LOAD_MODE_NONE
        params.use_extra_bufts = False
        params.progress_callback = stop
        loaded = lib.llama_model_load_from_file(str(path).encode(), params)
    finally:
        lib.llama_log_set(llama_cpp._logger.llama_log_callback, ctypes.c_void_p(0))
    if loaded:
        lib.llama_model_free(loaded)
        return None
    if reached_data[0]:
        return None
    reason = " ".join("".join(errors).split())
    reason = reason.split("error loading model: ", 1)[-1].split(" llama_model_load_from_file_impl:")[0]
    what = "the vocabulary it writes" if vocab_only else "the file it writes"
    return f"llama.cpp cannot load {what}: {reason or 'no reason given'}"


def build_scratch(folder: Path, options: dict[str, Any], architectures: list[str] | None) -> None:
    """The scratch loader's config and tokenizer, as it builds them at run time (its own code): the plan's
    tokenizer folder, or one trained by its trainer on ``SAMPLE`` in place of the plan's data."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from ftcore.plugins import get_plugin_manager

    # The loader through the registry, as the run resolves it (an exporter does not import another kind).
    loader_cls = get_plugin_manager(entry_points=False).registry().resolve("model loader", "scratch").cls
    o = loader_cls.Options.model_construct(**options)
    loader = loader_cls(o)
    if o.tokenizer is not None:
        tokenizer = AutoTokenizer.from_pretrained(o.tokenizer)
    else:
        ctx = SimpleNamespace(data=lambda name: [{"text": t} for t in SAMPLE], reporter=SimpleNamespace(
            info=lambda *args, **kwargs: None))
        tokenizer = loader._train_tokenizer(ctx)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    config = loader.model_config(len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                                 eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    config.architectures = list(architectures or [])
    config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def clean(reason: str | None, folder: Path) -> str | None:
    """One line, without the check's temporary folder."""
    if reason is None:
        return None
    return " ".join(reason.replace(f"{folder}/", "").replace(str(folder), "the model's folder").split())
