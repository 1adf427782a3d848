"""What a model loader can check of its files and config before anything loads: each problem one line.

Two levels, as the loaders use them:

- in ``check(plan)`` (``ftcore validate`` and every command that reads a plan): plain file reads, no torch
  or transformers: a model path that is a file or an empty folder, a ``config.json`` that is not JSON or
  whose heads do not divide, a truncated safetensors file, a tokenizer path that holds no tokenizer;
- in ``preflight(plan)`` (``ftcore run``, before the run folder is made): what needs transformers or only
  matters to a run: an unknown ``model_type``, a folder without weights or tokenizer, a corrupt
  ``tokenizer.json``, a hub id the hub cannot serve.

Messages are worded as ``check()`` words them: ``"path: ..."`` names the option, and the core puts the
loader's key in front (``model.path: ...``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

SAFETENSORS_MAX_HEADER = 100_000_000  # the safetensors library's own limit
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model", "sentencepiece.bpe.model", "tokenizer.tiktoken", "tekken.json")
WEIGHT_GLOBS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.safetensors.index.json", "*.bin.index.json")


def one_line(exc: BaseException, limit: int = 300) -> str:
    """An exception as one short line: its first line, or, where that only introduces the cause
    (transformers' ``Class validation error for validator 'x':``), the cause's; at most ``limit``
    characters (transformers' "Unrecognized model" lists every model type it knows)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    text = lines[0]
    if text.endswith(":") and len(lines) > 1:
        text = re.sub(r"^\w+(Error|Exception|Warning): ", "", lines[1])
    if len(text) > limit:
        text = text[:limit].rsplit(" ", 1)[0].rstrip(",;:") + " ..."
    return text


# -- the model folder (no imports) -----------------------------------------------------------------

def read_config(folder: Path) -> tuple[dict[str, Any] | None, str | None]:
    """``(config.json as a dict, None)``, or ``(None, why not)``; ``(None, None)`` when there is none."""
    path = folder / "config.json"
    if not path.is_file():
        return None, None
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        return None, f"{path} is not UTF-8 text"
    except ValueError as exc:
        return None, f"{path} is not valid JSON: {exc}"
    except OSError as exc:
        return None, f"cannot read {path}: {exc.strerror}"
    if not isinstance(config, dict):
        return None, f"{path} is not a JSON object"
    return config, None


def model_folder_problems(folder: Path) -> list[str]:
    """What is wrong with a local model folder (``folder`` exists), readable without transformers: no
    ``config.json`` (an empty folder, or something else), a config that is not JSON or whose attention
    heads do not divide, a truncated or damaged safetensors file. A folder with only a ``config.json`` is
    fine here (``ftcore estimate`` reads no more); a run asks for weights in :func:`weights_problem`."""
    if not folder.is_dir():
        return [f"{folder} is a file, not a model folder (a folder with config.json and the weights)"]
    if (folder / "adapter_config.json").is_file() and not (folder / "config.json").exists():
        return []  # a peft adapter folder: transformers loads its base model, then the adapter
    if not any(folder.iterdir()):
        return [f"{folder} is an empty folder, not a model (no config.json, no weights)"]
    config, problem = read_config(folder)
    if problem:
        return [problem]
    if config is None:
        return [f"{folder} holds no config.json, so it is not a transformers model folder"]
    problems = [f"{folder / 'config.json'}: {p}" for p in config_shape_problems(config)]
    return problems + safetensors_problems(folder)


def weights_problem(folder: Path) -> str | None:
    """A run needs weights: None when the folder holds some (or is an adapter folder)."""
    if not folder.is_dir() or (folder / "adapter_config.json").is_file():
        return None
    if any(next(folder.glob(g), None) is not None for g in WEIGHT_GLOBS):
        return None
    return f"{folder} has a config.json but no weights (*.safetensors or pytorch_model.bin)"


def _number(config: dict[str, Any], *names: str) -> tuple[str, int] | None:
    for name in names:
        value = config.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return name, value
    return None


def config_shape_problems(config: dict[str, Any]) -> list[str]:
    """Attention heads that do not divide: the width by the heads (unless ``head_dim`` or T5's ``d_kv`` is
    set), the heads by the key/value heads. A multimodal config's ``text_config`` is what is checked."""
    text = config.get("text_config")
    config = text if isinstance(text, dict) else config
    hidden = _number(config, "hidden_size", "n_embd", "d_model")
    heads = _number(config, "num_attention_heads", "n_head", "num_heads")
    kv = _number(config, "num_key_value_heads", "num_kv_heads", "multi_query_group_num")
    problems = []
    # T5's heads are d_kv wide, whatever d_model is (Flan-T5-small and mT5-small: 512 wide, 6 heads of 64)
    if hidden and heads and config.get("head_dim") is None and config.get("d_kv") is None and hidden[1] % heads[1]:
        problems.append(f"{hidden[0]} {hidden[1]} is not a multiple of {heads[0]} {heads[1]}, and no head_dim is "
                        "set: the heads cannot share the width")
    if heads and kv and heads[1] % kv[1]:
        problems.append(f"{kv[0]} {kv[1]} does not divide {heads[0]} {heads[1]}: each key/value head must serve "
                        "the same number of query heads")
    return problems


def safetensors_problems(folder: Path) -> list[str]:
    """Safetensors files that are truncated or damaged, and shards an index names that are missing."""
    problems = []
    for index in sorted(folder.glob("*.safetensors.index.json")):
        try:
            shards = set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            problems.append(f"{index} is not a readable weights index ({type(exc).__name__}: {exc})")
            continue
        for shard in sorted(s for s in shards if isinstance(s, str)):
            if not (folder / shard).is_file():
                problems.append(f"{index.name} names {shard}, which is not in {folder}")
    for file in sorted(folder.glob("*.safetensors")):
        problem = safetensors_problem(file)
        if problem:
            problems.append(problem)
    return problems


def safetensors_problem(file: Path) -> str | None:
    """Whether ``file`` is a whole safetensors file, from its header alone (no tensor is read)."""
    try:
        size = file.stat().st_size
        with file.open("rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                return f"{file} is truncated: {size} bytes, less than a safetensors header (copy it again)"
            length = int.from_bytes(head, "little")
            if length > SAFETENSORS_MAX_HEADER:
                return f"{file} is not a safetensors file (its first 8 bytes give a header of {length:,} bytes)"
            if 8 + length > size:
                return f"{file} is truncated: {size:,} bytes, less than its own header says it starts with " \
                       f"({8 + length:,}); copy or download it again"
            header = json.loads(fh.read(length))
        ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
    except OSError as exc:
        return f"cannot read {file}: {exc.strerror}"
    except (ValueError, KeyError, TypeError, IndexError, AttributeError):
        return f"{file} is not a safetensors file, or its header is damaged"
    need = 8 + length + max([e for e in ends if isinstance(e, int)], default=0)
    if size < need:
        return f"{file} is truncated: {size:,} of its {need:,} bytes; copy or download it again"
    return None


def safetensors_shapes(folder: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """Each tensor's shape in the folder's safetensors files, read from their headers: ``{name: (shape,
    file name)}``. Files that cannot be read are left out (:func:`safetensors_problems` names them)."""
    shapes: dict[str, tuple[tuple[int, ...], str]] = {}
    for file in sorted(folder.glob("*.safetensors")):
        try:
            with file.open("rb") as fh:
                length = int.from_bytes(fh.read(8), "little")
                if length > SAFETENSORS_MAX_HEADER:
                    continue
                header = json.loads(fh.read(length))
            for name, entry in header.items():
                if name != "__metadata__" and isinstance(entry, dict) and isinstance(entry.get("shape"), list):
                    shapes[name] = (tuple(entry["shape"]), file.name)
        except (OSError, ValueError, TypeError, AttributeError):
            continue
    return shapes


# -- tokenizers (no imports) -----------------------------------------------------------------------

def tokenizer_folder_problem(folder: Path, explicit: bool) -> str | None:
    """A local tokenizer path that cannot be a tokenizer: a file, or a folder without any tokenizer
    file. ``explicit``: the plan names it as the tokenizer (else it is the model's folder, which may
    hold only a config where a run does not need one)."""
    if folder.is_file():
        what = " (point to the folder that holds it)" if folder.name in TOKENIZER_FILES else ""
        return f"{folder} is a file, not a tokenizer folder{what}"
    if not folder.is_dir() or any((folder / name).is_file() for name in TOKENIZER_FILES):
        return None
    empty = not any(folder.iterdir())
    where = f"{folder} is an empty folder" if empty else f"{folder} holds no tokenizer"
    fix = "" if explicit else "; set model.tokenizer to the tokenizer's folder or hub id"
    return f"{where} (no {', '.join(TOKENIZER_FILES[:4])}, ...){fix}"


def tokenizer_files_problem(folder: Path, parse: bool = True) -> str | None:
    """A tokenizer folder's files that cannot be read: ``tokenizer_config.json`` as JSON, and (``parse``)
    ``tokenizer.json`` as the tokenizers library reads it (a truncated or damaged one)."""
    config = folder / "tokenizer_config.json"
    if config.is_file():
        try:
            json.loads(config.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as exc:
            return f"{config} is not valid JSON: {exc}"
    file = folder / "tokenizer.json"
    if parse and file.is_file():
        from tokenizers import Tokenizer

        try:
            Tokenizer.from_file(str(file))
        except Exception as exc:  # noqa: BLE001 - the Rust library raises plain Exception
            return f"{file} cannot be read: {one_line(exc)}"
    return None


# -- what needs transformers (a run's preflight) -------------------------------------------------------

def image_text_types() -> set[str]:
    """The model types transformers builds an image-text-to-text model (a VLM) of."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return set(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)


def is_vlm_config(config: Any) -> bool:
    """Whether a config (a transformers config or config.json's dict) describes a vision-language model:
    an image-text-to-text model type with a vision tower."""
    get = config.get if isinstance(config, dict) else lambda k: getattr(config, k, None)
    return get("model_type") in image_text_types() and get("vision_config") is not None


def model_type_problem(model_type: Any, trust_remote_code: bool, remote: bool) -> str | None:
    """A ``model_type`` transformers cannot build a causal LM of, and not one of the encoder-decoders
    ftcore trains (``common/seq2seq.py``). ``remote``: the config names its own code (``auto_map``), which
    ``trust_remote_code`` lets in."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from ftcore.errors import did_you_mean
    from ftcore_plugins.common.seq2seq import FAMILIES

    version = f"transformers {transformers.__version__}"
    causal = sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    if remote and trust_remote_code:
        return None
    if not isinstance(model_type, str) or not model_type:
        return f"no model_type, so {version} cannot tell which model this is"
    if model_type not in CONFIG_MAPPING_NAMES:
        hint = did_you_mean(model_type, causal) or did_you_mean(model_type, CONFIG_MAPPING_NAMES)
        more = "; the config names its own code: set trust_remote_code = true if you trust it" if remote else \
            "; a newer one may"
        return f"unknown model type {model_type!r} ({version} does not know it{more}){hint}"
    if model_type in FAMILIES:  # an encoder-decoder (T5, BART), loaded as a seq2seq LM
        return None
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and model_type not in image_text_types():
        hint = did_you_mean(model_type, causal)
        return f"model type {model_type!r} has no causal language model in {version}, and ftcore trains causal " \
               f"LMs (llama, mistral, qwen2, qwen3, gemma2, phi3, ...) and the encoder-decoders " \
               f"{', '.join(FAMILIES)}{hint}"
    return None
