"""The pre-flight checks of ``ftcore run`` on the model (the ``ftcore_preflight`` hook): before the run
folder is made or a weight is read, first the loader's own ``preflight(plan)``, if it has one: what its
files and config say (a folder that holds no model, a truncated weights file, an unknown architecture),
as problems under the loader's key. Then each ``max_length`` the plan sets against the model's context,
and each stage's adapter applied to the model on the meta device (its target modules, its options). A
loader without ``meta_model()``, or one that cannot build it here (a hub id not yet downloaded), skips
these; loading reports it then."""

from __future__ import annotations

import logging
import re
from typing import Any

import ftcore
from ftcore.context import AdapterContext, RunInfo
from ftcore.errors import FtcoreError
from ftcore.plan import subkey
from ftcore.reporter import Reporter
from ftcore.runner import calling

from ftcore_plugins.models._rope import context_length, extension_hint

log = logging.getLogger("ftcore")


@ftcore.hookimpl
def ftcore_preflight(plan: Any) -> list[str]:
    loader = plan.model.create()
    own = getattr(loader, "preflight", None)
    if own is not None:
        with calling(plan.model, "preflight"):
            messages = own(plan)
        if messages:  # the model cannot be built as it is: the checks below would only fail
            return [": ".join(subkey(plan.model.key, m)) for m in messages]
    if not hasattr(loader, "meta_model"):
        return []
    try:
        model, config = loader.meta_model()
    except Exception as exc:  # noqa: BLE001 - the real load says it better
        log.debug("preflight skipped: %s", exc)
        return []
    problems = []
    whole, config = config, getattr(config, "text_config", None) or config  # a multimodal model's language part
    context = context_length(config)
    for sel in [*(s.trainer for s in plan.stages), *(e.evaluator for e in plan.evaluations)]:
        length = getattr(sel.options, "max_length", None)
        # A default is a cap the rows rarely reach; a value the plan sets is a promise to use it.
        if isinstance(context, int) and isinstance(length, int) and length > context \
                and "max_length" in sel.options.model_fields_set:
            options = plan.model.options  # a loader with rope_scaling (hf) is told how to extend the context
            hint = extension_hint(whole, length, context, options.rope_scaling is not None) \
                if "rope_scaling" in type(options).model_fields else ""
            source = "max_position_embeddings" if context == config.max_position_embeddings else \
                "max_position_embeddings x the dynamic RoPE factor"
            problems.append(f"{sel.key}.max_length: {length} is longer than the model's context of {context} "
                            f"tokens ({source}); use at most {context}{hint}")
    problems += tensor_parallel_problems(plan, model)
    quantizer = plan.quantizer.create()
    silent = AdapterContext(RunInfo(plan, plan.run_dir), Reporter(None, None, None, None), quantizer)
    prepare_meta = getattr(quantizer, "prepare_meta", None)
    tried: list[Any] = []
    for stage in plan.stages:
        if not stage.trains_policy or any(stage.adapter.reg is r and stage.adapter.options == o for r, o in tried):
            continue
        tried.append((stage.adapter.reg, stage.adapter.options))
        adapter = stage.adapter.create()
        apply = getattr(adapter, "apply_meta", None) or adapter.apply
        try:
            fresh, _ = loader.meta_model()
            if prepare_meta is not None:
                fresh = prepare_meta(fresh)
            apply(fresh, silent)
        except FtcoreError as exc:
            message = str(exc)
            field = re.match(r"adapter (\w+): ", message)  # "adapter target_modules: 'x' matches no module"
            if field and field.group(1) not in type(stage.adapter.options).model_fields:
                field = None  # "adapter freeze: ...": the adapter's name, not one of its options
            # Where the plan writes it: "stage[1].adapter", or "adapter" for the top-level [adapter].
            key = stage.adapter.key + (f".{field.group(1)}" if field else "")
            problems.append(f"{key}: {message[field.end():] if field else message}")
        except Exception as exc:  # noqa: BLE001 - not decidable on meta tensors; the real apply decides
            log.debug("preflight: adapter %s on the meta model: %s", stage.adapter.name, exc)
    return problems


def tensor_parallel_problems(plan: Any, model: Any) -> list[str]:
    """``tp_size`` on a model transformers has no tensor-parallel plan for (GPT-2, OPT, Falcon, Mamba, ...): its
    loader raises only once the data is tokenized and the weights are being read."""
    d = getattr(plan, "distributed", None)
    if d is None or d.tp_size == 1 or d.processes == 1 or getattr(model, "tp_plan", None) is None or model.tp_plan:
        return []
    return [f"distributed.tp_size: transformers has no tensor-parallel plan for {type(model).__name__} (model type "
            f"'{model.config.model_type}'; its config has no base_model_tp_plan), so it cannot split its layers; use "
            "sp_size for long rows, or zero_stage = 3 or engine = \"fsdp\" for weights that do not fit one device"]
