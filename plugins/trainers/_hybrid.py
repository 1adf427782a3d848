"""Packing on models that cannot keep packed samples apart here, refused before the model loads: hybrid models
(linear attention, Mamba, short convolutions) whose kernels are missing, and families whose masks ignore the
position ids (:data:`MASKS_WITHOUT_POSITIONS`).

transformers' recurrent and convolution layers keep the samples of a packed row apart only through
their CUDA kernels (``causal_conv1d``, ``mamba_ssm``, ``fla``); without them the reference PyTorch path
raises "can't keep packed sequences apart" mid-``train()``, after the model has loaded. Which layers a
model has comes from its config (``layer_types`` / ``layers_block_type``, without weights), which
kernels its modeling module falls back from from that module's source
(``use_kernel_func_from_hub_with_fallback`` registrations, read, not imported): no list of model types.
"""

from __future__ import annotations

import importlib.util
import logging
import re
from pathlib import Path
from typing import Any

log = logging.getLogger("ftcore")

# The import name of a kernel package, and the distribution to install where the two differ (as transformers
# says it: integrations/hub_kernels.py _PACKAGE_TO_DISTRIBUTION).
_DISTRIBUTION = {"fla": "flash-linear-attention"}
_FALLBACK = re.compile(r"use_kernel_func_from_hub_with_fallback\(\s*\"\w+\"\s*,\s*\"([\w.]+)\"")


def _plain(layer_type: str) -> bool:
    """A layer that packing needs nothing for: softmax attention of any kind, an MLP or experts."""
    return ("attention" in layer_type and "linear" not in layer_type) or layer_type in ("mlp", "moe", "dense")


def model_config(plan: Any) -> Any | None:
    """The plan's model config, without weights: the ``scratch`` loader's, or a local folder's
    ``config.json``; None where it cannot be had cheaply (a hub id, remote code, a broken folder:
    the model's own checks say so)."""
    try:
        loader = plan.model.create()
        build = getattr(loader, "model_config", None)
        o = loader.options
        if build is not None and hasattr(o, "vocab_size"):
            config = build(o.vocab_size)
        else:
            path = getattr(o, "path", None)
            if not path or not (Path(path) / "config.json").is_file() or getattr(o, "trust_remote_code", False):
                return None
            from transformers import AutoConfig
            from transformers.utils import logging as hf_logging

            verbosity = hf_logging.get_verbosity()
            hf_logging.set_verbosity_error()  # validate's output is its own lines, not the config class's remarks
            try:
                config = AutoConfig.from_pretrained(path, local_files_only=True)
            finally:
                hf_logging.set_verbosity(verbosity)
    except Exception as exc:  # noqa: BLE001 - the loader's check and pre-flight report it
        log.debug("hybrid packing check skipped: %s", exc)
        return None
    return getattr(config, "text_config", None) or config


def kernel_packages(config: Any) -> list[str]:
    """The kernel packages the modeling module beside ``config``'s class falls back from, in order."""
    module = type(config).__module__.rsplit(".", 1)
    if len(module) != 2 or not module[1].startswith("configuration_"):
        return []
    try:
        spec = importlib.util.find_spec(f"{module[0]}.modeling_{module[1][len('configuration_'):]}")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.origin:
        return []
    try:
        source = Path(spec.origin).read_text(encoding="utf-8")
    except OSError:
        return []
    return list(dict.fromkeys(m.split(".")[0] for m in _FALLBACK.findall(source)))


def missing_kernels(config: Any) -> list[str]:
    """The kernel packages this model's non-attention layers need to keep packed samples apart, not
    importable here (their distribution names); [] for a dense model or where they are installed."""
    model_type = getattr(config, "model_type", None)
    if not isinstance(model_type, str):
        return []
    kinds = set()
    for name in ("layer_types", "layers_block_type"):
        value = getattr(config, name, None)
        if isinstance(value, (list, tuple)):
            kinds |= {str(v) for v in value}
    if kinds and all(_plain(k) for k in kinds):
        return []  # e.g. an lfm2 with attention in every layer
    packages = kernel_packages(config)
    return [_DISTRIBUTION.get(p, p) for p in packages if importlib.util.find_spec(p) is None]


# Families whose transformers model builds its attention masks without the position ids, so the samples of a
# packed row would attend to each other on every path (tests/test_model_coverage.py finds them): model type ->
# the model class. GptOssModel's mask_kwargs leave position_ids out (transformers 5.24).
MASKS_WITHOUT_POSITIONS = {"gpt_oss": "GptOssModel"}


def packing_model_problem(plan: Any) -> str | None:
    """``packing: ...`` for a hybrid model whose kernels are not installed, or a family whose masks do not
    keep packed samples apart; else None."""
    config = model_config(plan)
    if config is not None and config.model_type in MASKS_WITHOUT_POSITIONS:
        return (f"packing: transformers' {MASKS_WITHOUT_POSITIONS[config.model_type]} builds its attention masks "
                f"without the position ids, so the samples packed in a row would attend to each other; "
                f"set packing = false")
    missing = missing_kernels(config) if config is not None else []
    if not missing:
        return None
    return (f"packing: the {config.model_type} model's linear-attention/Mamba/convolution layers cannot keep "
            f"packed samples apart without {' and '.join(missing)} (CUDA-only kernels, not installed); "
            f"set packing = false, or install {' and '.join(missing)} on a CUDA machine")
