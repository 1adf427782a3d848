"""Packing on models that cannot keep packed samples apart here, refused before the model loads: hybrid models
(linear attention, Mamba, short convolutions) whose kernels are missing, and families whose masks ignore the
position ids (:data:`MASKS_WITHOUT_POSITIONS`).

transformers' recurrent and convolution layers keep the samples of a packed row apart only through
their CUDA kernels (``causal_conv1d``, ``mamba_ssm``, ``fla``); without them the reference PyTorch path
raises "can't keep packed sequences apart" mid-``train()``, after the model has loaded. Which layers a
model has comes from its ``config.json`` (``layer_types``, ``layers_block_type``, ``hybrid_override_pattern``),
which kernels its modeling module falls back from from that module's source
(``use_kernel_func_from_hub_with_fallback`` registrations): both read as files, nothing imported (``ftcore
validate`` imports no torch), and no list of model types.
"""

from __future__ import annotations

import importlib.util
import re
from typing import Any

from ftcore_plugins.common.model import transformers_source
from ftcore_plugins.common.seq2seq import model_config as read_config

# The import name of a kernel package, and the distribution to install where the two differ (as transformers
# says it: integrations/hub_kernels.py _PACKAGE_TO_DISTRIBUTION).
_DISTRIBUTION = {"fla": "flash-linear-attention"}
_FALLBACK = re.compile(r"use_kernel_func_from_hub_with_fallback\(\s*\"\w+\"\s*,\s*\"([\w.]+)\"")


def _plain(layer_type: str) -> bool:
    """A layer that packing needs nothing for: softmax attention of any kind, an MLP or experts."""
    return ("attention" in layer_type and "linear" not in layer_type) or layer_type in ("mlp", "moe", "dense")


def model_config(plan: Any) -> dict[str, Any] | None:
    """The plan's model config as a dict, read without torch or transformers (``ftcore validate`` imports
    neither): the ``scratch`` loader's architecture and ``config`` table, or the ``config.json`` of a local
    folder or of a hub id in the local hub cache; a vision-language model's text part. None where it cannot be
    had cheaply (a hub id not downloaded, remote code, a broken folder: the model's own checks say so)."""
    options = plan.model.options
    architecture = getattr(options, "architecture", None)
    if isinstance(architecture, str):
        config: dict[str, Any] | None = {**(getattr(options, "config", None) or {}), "model_type": architecture}
    else:
        path = getattr(options, "path", None)
        if not path or getattr(options, "trust_remote_code", False):
            return None
        config = read_config(str(path), getattr(options, "revision", None))
    text = config.get("text_config") if config else None
    config = text if isinstance(text, dict) and text.get("model_type") else config
    return config if config and isinstance(config.get("model_type"), str) else None


def layer_kinds(config: dict[str, Any]) -> set[str]:
    """The kinds of layer a config lists (``layer_types``, ``layers_block_type``, or Nemotron-H's
    ``hybrid_override_pattern``: M Mamba, * attention, - MLP, E experts); empty where it lists none (the
    family's default layout, whatever it is)."""
    kinds: set[str] = set()
    for name in ("layer_types", "layers_block_type"):
        value = config.get(name)
        if isinstance(value, (list, tuple)):
            kinds |= {str(v) for v in value}
    pattern = config.get("hybrid_override_pattern")
    if isinstance(pattern, str):
        kinds |= {_PATTERN.get(c, c) for c in pattern}
    return kinds


_PATTERN = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}


def kernel_packages(model_type: str) -> list[str]:
    """The kernel packages ``model_type``'s modeling module falls back from, in order."""
    return list(dict.fromkeys(m.split(".")[0] for m in _FALLBACK.findall(transformers_source(model_type))))


def missing_kernels(config: dict[str, Any]) -> list[str]:
    """The kernel packages this model's non-attention layers need to keep packed samples apart, not
    importable here (their distribution names); [] for a dense model or where they are installed."""
    kinds = layer_kinds(config)
    if kinds and all(_plain(k) for k in kinds):
        return []  # e.g. an lfm2 with attention in every layer
    packages = kernel_packages(config["model_type"])
    return [_DISTRIBUTION.get(p, p) for p in packages if importlib.util.find_spec(p) is None]


# Families whose transformers model builds its attention masks without the position ids, so the samples of a
# packed row would attend to each other on every path (tests/test_model_coverage.py finds them): model type ->
# the model class. GptOssModel's mask_kwargs leave position_ids out (transformers 5.24).
MASKS_WITHOUT_POSITIONS = {"gpt_oss": "GptOssModel"}


def packing_model_problem(plan: Any) -> str | None:
    """``packing: ...`` for a hybrid model whose kernels are not installed, or a family whose masks do not
    keep packed samples apart; else None."""
    config = model_config(plan)
    if config is None:
        return None
    family = config["model_type"]
    if family in MASKS_WITHOUT_POSITIONS:
        return (f"packing: transformers' {MASKS_WITHOUT_POSITIONS[family]} builds its attention masks without the "
                f"position ids, so the samples packed in a row would attend to each other; set packing = false")
    missing = " and ".join(missing_kernels(config))
    if not missing:
        return None
    return (f"packing: the {family} model's linear-attention/Mamba/convolution layers cannot keep packed samples "
            f"apart without {missing} (CUDA-only kernels, not installed); set packing = false, or install "
            f"{missing} on a CUDA machine")
