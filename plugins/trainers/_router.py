"""The router's auxiliary (load-balancing) loss of a mixture-of-experts model: one rule for every trainer.

Off unless a stage sets ``router_aux_loss_coef`` (> 0). transformers' MoE configs carry
``output_router_logits`` and ``router_aux_loss_coef``, and trainers read them differently: TRL's DPO, KTO,
GRPO and RLOO added the model config's own coefficient (0.001 for Qwen3-MoE, 0.9 for GPT-OSS) while ftcore's
SFT loss did not, so the same model's loss meant different things on different trainers. Here the stage's
option alone decides: off, the loss is the trainer's own (the fine-tuning loss means the same on every
trainer; LoRA leaves the routers frozen, so the balancing term would not move them); on, the trainer asks the
model for its router logits, adds ``coef x aux_loss`` to its loss and logs ``aux_loss`` beside ``loss`` (the
model's config gets the coefficient for the stage, put back afterwards). A model without a router: refused
by ``ftcore validate`` where its type is known before loading, else the option is logged as ignored.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import json
from pathlib import Path
from typing import Any, Callable

OPTION = "router_aux_loss_coef"
NO_LOSS = "not a mixture of experts, or one whose routers balance without an auxiliary loss"
# Trainers whose loss cannot take the term: a classification head's forward returns no load-balancing loss.
NO_ROUTER_LOSS = {"reward": "trains a sequence-classification head, whose forward returns no load-balancing loss"}


def plan_model_type(plan: Any) -> str | None:
    """The plan's transformers model_type where it is known without loading: the scratch loader's
    architecture, or a local model folder's config.json (a hub id: None)."""
    options = plan.model.options
    if plan.model.name == "scratch":
        return getattr(options, "architecture", None)
    config = Path(str(getattr(options, "path", "") or "")) / "config.json"
    if config.is_file():
        try:
            return json.loads(config.read_text(encoding="utf-8")).get("model_type")
        except (OSError, ValueError):
            return None  # the loader's own check says what is wrong with it
    return None


@functools.cache
def has_router_loss(model_type: str) -> bool | None:
    """Whether transformers' ``model_type`` computes a router loss: its config has ``output_router_logits`` and
    its model an ``aux_loss`` (DeepSeek-V3, GLM-4.5 and Nemotron-H route without one). Read from the sources:
    importing transformers' configuration_auto imports torch, which ``ftcore validate`` never does. None where
    the type or its files are not found."""
    spec = importlib.util.find_spec("transformers")
    if spec is None or spec.origin is None:
        return None
    models = Path(spec.origin).parent / "models"
    special: dict[str, str] = {}
    for source in (models / "auto" / "auto_mappings.py", models / "auto" / "configuration_auto.py"):
        special.update(_mapping(source, "SPECIAL_MODEL_TYPE_TO_MODULE_NAME"))
    module = special.get(model_type, model_type.replace("-", "_"))
    config, modeling = (models / module / f"{kind}_{module}.py" for kind in ("configuration", "modeling"))
    if not config.is_file() or not modeling.is_file():
        return None
    return "output_router_logits" in config.read_text(encoding="utf-8") and _computes_aux_loss(modeling)


def _computes_aux_loss(modeling: Path) -> bool:
    return "aux_loss" in modeling.read_text(encoding="utf-8")


def _mapping(source: Path, name: str) -> dict[str, str]:
    """The literal entries of the dict ``name`` in ``source``: its assignment and any ``name.update({...})``."""
    try:
        tree = ast.parse(source.read_text(encoding="utf-8"))
    except (OSError, SyntaxError):
        return {}
    values = []
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            values.append(node.value.args[0] if isinstance(node.value, ast.Call) and node.value.args else node.value)
        elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Call) \
                and getattr(node.value.func, "attr", None) == "update" \
                and getattr(node.value.func.value, "id", None) == name and node.value.args:
            values.append(node.value.args[0])
    found: dict[str, str] = {}
    for value in values:
        try:
            found.update(dict(ast.literal_eval(value)))
        except (ValueError, TypeError):
            pass
    return found


def router_problems(component: Any, plan: Any) -> list[str]:
    """``check(plan)`` problems of ``router_aux_loss_coef``: a trainer whose loss cannot take it, or a model
    known to have no router."""
    coef = getattr(component.options, OPTION, None)
    if not coef:
        return []
    if component.name in NO_ROUTER_LOSS:
        return [f"{OPTION}: trainer '{component.name}' {NO_ROUTER_LOSS[component.name]}; remove it"]
    kind = plan_model_type(plan)
    if kind is not None and has_router_loss(kind) is False:
        return [f"{OPTION}: this {kind!r} model has no router loss ({NO_LOSS}), so there is nothing to weight; "
                "remove it"]
    return []


def text_config(model: Any) -> Any:
    config = model.config  # a peft model's is its base model's
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def computes_router_loss(model: Any) -> bool:
    """Whether the loaded model returns a router loss when its config asks for router logits."""
    import sys

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    module = sys.modules.get(type(base).__module__)
    source = getattr(module, "__file__", None)
    return hasattr(text_config(model), "output_router_logits") and source is not None \
        and _computes_aux_loss(Path(source))


def stage_coefficient(model: Any, options: Any) -> float:
    """The coefficient the stage trains with: its option where the model computes a router loss, else 0 (off)."""
    coef = float(getattr(options, OPTION, None) or 0.0)
    return coef if coef and computes_router_loss(model) else 0.0


def apply_router_aux(ctx: Any, options: Any, supported: bool = True,
                     in_config: bool = False) -> tuple[float, Callable[[], None]]:
    """Set the model's config for the stage by the rule above: its ``router_aux_loss_coef`` the stage's, and
    ``output_router_logits`` off (whatever the checkpoint's config said), or on where the stage adds the loss
    and the trainer reads it from the config (``in_config``: TRL's ORPO). Trainers that take the coefficient
    ask for router logits in the forward passes that need them: transformers' MoE models fail to generate with
    ``output_router_logits`` on (GRPO, RLOO, PPO generate). Returns the coefficient (0.0: off) and a function
    that puts the config back. An option the model or trainer cannot use is logged as ignored."""
    asked = float(getattr(options, OPTION, None) or 0.0)
    config = text_config(ctx.model)
    if not computes_router_loss(ctx.model):
        if asked:
            kind = getattr(config, "model_type", "this")
            ctx.reporter.warn(f"stage {ctx.stage}: {OPTION} = {asked:g} ignored: the {kind} model has no router "
                              f"loss ({NO_LOSS})")
        if getattr(config, "output_router_logits", False):  # router logits nothing reads: not computed
            config.output_router_logits = False
            return 0.0, lambda: setattr(config, "output_router_logits", True)
        return 0.0, lambda: None
    coef = asked if supported else 0.0
    if asked and not supported:
        ctx.reporter.warn(f"stage {ctx.stage}: {OPTION} = {asked:g} ignored: this trainer's loss cannot take it")
    saved = {key: getattr(config, key) for key in ("output_router_logits", OPTION) if hasattr(config, key)}
    config.output_router_logits = coef > 0 and in_config
    if coef:
        config.router_aux_loss_coef = coef

    def restore() -> None:
        for key, value in saved.items():
            setattr(config, key, value)

    return coef, restore
