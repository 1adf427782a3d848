"""``rope_scaling`` of the ``hf`` loader: a longer context than the model was trained for, by scaling its rotary
position embeddings (RoPE) as transformers' ``rope_parameters`` take it (``transformers/modeling_rope_utils.py``).

The checks read ``config.json`` as a dict and the installed transformers' modeling source as a file (``ftcore
validate`` imports neither torch nor transformers); :func:`scale` changes a loaded config before the model is
built from it, so the weights load into the longer-context model and its ``save_pretrained`` (the merged export)
writes the scaling into ``config.json``, where transformers reads it back.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import Field

from ftcore.component import Options

from ftcore_plugins.common.model import transformers_source
from ftcore_plugins.models._checks import one_line

# The keys a type takes beyond ``type`` and ``factor`` (transformers warns on the others, and ignores them).
TYPE_KEYS = {"linear": (), "dynamic": (), "yarn": ("original_max_position_embeddings", "attention_factor",
                                                   "beta_fast", "beta_slow"),
             "longrope": ("original_max_position_embeddings", "attention_factor", "short_factor", "long_factor")}


class RopeScaling(Options):
    """``[model] rope_scaling``: the RoPE scaling transformers applies, the model's ``rope_theta`` kept."""

    type: Literal["linear", "dynamic", "yarn", "longrope"]
    factor: float = Field(gt=1)  # the context grows this many times
    # The length the model was trained at (yarn, longrope); default: its max_position_embeddings.
    original_max_position_embeddings: int | None = Field(None, ge=1)
    attention_factor: float | None = Field(None, gt=0)  # yarn, longrope; default: from factor
    beta_fast: float | None = Field(None, gt=0)  # yarn; default 32
    beta_slow: float | None = Field(None, gt=0)  # yarn; default 1
    # longrope: one factor per rotary frequency (head_dim / 2), for rows up to / beyond the original length
    short_factor: list[Annotated[float, Field(gt=0)]] | None = None
    long_factor: list[Annotated[float, Field(gt=0)]] | None = None

    def problems(self, config: dict[str, Any] | None) -> list[str]:
        """``"key: message"`` (a key of this table) for keys that do not go with the type, or (with the model's
        ``config``) do not fit the model."""
        def types(key: str) -> str:
            return " or ".join(f'"{t}"' for t, keys in TYPE_KEYS.items() if key in keys)

        out = [f"{key}: only with type {types(key)} (type is \"{self.type}\")"
               for key in sorted(self.model_fields_set - {"type", "factor"}) if key not in TYPE_KEYS[self.type]]
        if self.type == "yarn" and (self.beta_fast or 32) <= (self.beta_slow or 1):
            out.append(f"beta_fast: must be above beta_slow ({self.beta_fast or 32:g} <= {self.beta_slow or 1:g})")
        if self.type == "longrope":
            size = rotary_size(config) if config is not None else None
            lists = f"each a list of {size} numbers (head_dim / 2)" if size else "each a list of head_dim / 2 numbers"
            missing = [k for k in ("short_factor", "long_factor") if getattr(self, k) is None]
            if missing:
                out.append(f"type: \"longrope\" needs short_factor and long_factor, {lists}; missing: "
                           f"{', '.join(missing)}")
            out += [f"{k}: {len(getattr(self, k))} numbers, and this model's rotary embedding has {size} "
                    f"frequencies (head_dim / 2): give {size}"
                    for k in ("short_factor", "long_factor")
                    if size and getattr(self, k) is not None and len(getattr(self, k)) != size]
        return out


def rotary_size(config: dict[str, Any]) -> int | None:
    """The number of rotary frequencies (head_dim x partial_rotary_factor / 2), as transformers counts them; None
    where the config does not say (a family whose config class has a partial rotary default of its own, as
    GPT-NeoX's 0.25, unless config.json gives it: a loaded config's ``to_dict()`` always does)."""
    rope = config.get("rope_parameters") if isinstance(config.get("rope_parameters"), dict) else {}
    head_dim = config.get("head_dim")
    if not isinstance(head_dim, int):
        hidden, heads = config.get("hidden_size"), config.get("num_attention_heads")
        head_dim = hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads else None
    partial = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", config.get("rotary_pct")))
    if partial is None and "partial_rotary_factor" in transformers_source(str(config.get("model_type") or ""), "configuration"):
        return None
    return int(head_dim * (partial or 1.0)) // 2 if head_dim else None


def model_problem(config: dict[str, Any], where: str) -> str | None:
    """Why the model ``config`` describes (``config.json`` as a dict, or a loaded config's ``to_dict()``) cannot
    take ``rope_scaling``, named by ``where`` (its config.json); None when it can: a text model with plain RoPE."""
    kind = config.get("model_type")
    if config.get("is_encoder_decoder") or isinstance(config.get("vision_config"), dict):
        what = "an encoder-decoder" if config.get("is_encoder_decoder") else "a vision-language model"
        return f"{where}: model type {kind!r} is {what}; rope_scaling extends a text-only causal LM's RoPE"
    if not uses_rope(config):
        return (f"{where}: model type {kind!r} has no rotary position embeddings (RoPE) that transformers scales "
                "through rope_parameters (its positions are absolute, ALiBi, or its own rotary code); remove "
                "rope_scaling")
    rope = config.get("rope_parameters")
    if isinstance(rope, dict) and rope and all(isinstance(v, dict) or v is None for v in rope.values()) \
            or "rope_local_base_freq" in config:
        layers = ", ".join(rope) if isinstance(rope, dict) and rope else "local and global attention"
        return (f"{where}: model type {kind!r} has a RoPE per layer type ({layers}); rope_scaling sets one for "
                "the whole model, which would scale the local layers too; remove rope_scaling")
    existing = existing_scaling(config)
    if existing:
        context = config.get("max_position_embeddings")
        longer = f": its context of {context} tokens is already extended" if isinstance(context, int) else ""
        return (f"{where} already sets a RoPE scaling ({existing}){longer}; rope_scaling would replace what the "
                "model was trained with, so it is refused: remove rope_scaling (or edit config.json, to replace "
                "the scaling on purpose)")
    return None


def existing_scaling(config: dict[str, Any]) -> str | None:
    """A scaling ``config`` already has (``rope_parameters``, or the older ``rope_scaling``), said in a few words."""
    for key in ("rope_scaling", "rope_parameters"):
        rope = config.get(key)
        if not isinstance(rope, dict):
            continue
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in ("default", None):
            shown = [f"{k} {v}" for k, v in rope.items() if k in ("factor", "original_max_position_embeddings")]
            return ", ".join([str(kind), *shown])
    return None


def uses_rope(config: dict[str, Any]) -> bool:
    """Whether the model reads ``rope_parameters`` (the installed transformers' modeling source for its type
    says so) and is not one with ALiBi instead (Falcon's option); a type without source here (remote code): what
    its config sets."""
    if config.get("alibi") is True:
        return False
    source = transformers_source(str(config.get("model_type") or ""), "modeling")
    if source:
        return "rope_parameters" in source
    return any(key in config for key in ("rope_parameters", "rope_theta", "rope_scaling"))


def scale(config: Any, scaling: RopeScaling) -> Any:
    """``config`` (a transformers config, changed in place) with ``scaling`` as its ``rope_parameters``: the
    model's ``rope_theta`` and ``partial_rotary_factor`` kept, ``original_max_position_embeddings`` its
    ``max_position_embeddings`` unless given, and ``max_position_embeddings`` raised to factor x that, so the
    model and ftcore's length checks take the longer rows. Not for ``dynamic``: transformers takes
    ``max_position_embeddings`` as the length it starts scaling from (see :func:`context_length`)."""
    own = config.rope_parameters or {}
    original = scaling.original_max_position_embeddings or config.max_position_embeddings
    params = {k: v for k, v in own.items() if k in ("rope_theta", "partial_rotary_factor")}
    params.update(rope_type=scaling.type, factor=scaling.factor)
    if scaling.type in ("yarn", "longrope"):
        params["original_max_position_embeddings"] = original
    params.update({k: getattr(scaling, k) for k in TYPE_KEYS[scaling.type] if getattr(scaling, k) is not None})
    config.rope_parameters = params
    if scaling.type != "dynamic":
        config.max_position_embeddings = int(original * scaling.factor)
    if hasattr(config, "original_max_position_embeddings"):  # Phi-3's: transformers prefers it to the dict's
        config.original_max_position_embeddings = original
    config.validate_rope()  # transformers' own check: raises on a missing key
    return config


def transformers_refusal(config: Any, scaling: RopeScaling) -> str | None:
    """What the family's own config check in transformers says against ``scaling``, tried on a copy of
    ``config`` (Phi-3 takes longrope alone, and would read a yarn back as longrope); None when it takes it."""
    import copy

    try:
        scale(copy.deepcopy(config), scaling)
    except (ValueError, KeyError) as exc:
        return f"model type {config.model_type!r} does not take type \"{scaling.type}\": {one_line(exc)}"
    return None


def context_length(config: Any) -> int | None:
    """The longest row the model takes: ``max_position_embeddings``, times the factor under ``dynamic`` scaling,
    which grows RoPE's base with the row beyond ``max_position_embeddings``."""
    context = getattr(config, "max_position_embeddings", None)
    rope = getattr(config, "rope_parameters", None)
    if isinstance(context, int) and isinstance(rope, dict) and rope.get("rope_type") == "dynamic" \
            and isinstance(rope.get("factor"), (int, float)):
        return int(context * rope["factor"])
    return context


def extension_hint(config: Any, length: int, context: int, scaled: bool) -> str:
    """What to add to "max_length is longer than the model's context": the ``rope_scaling`` that would take it,
    where the model has plain RoPE (``scaled``: the plan sets one already)."""
    if scaled:
        return ", or raise rope_scaling's factor in [model]"
    if model_problem(config.to_dict(), "") is not None:
        return ""
    factor = float(math.ceil(length / context))
    return f", or extend the context in [model]: rope_scaling = {{ type = \"yarn\", factor = {factor} }}"
