"""Which layers an adapter adapts: ``target_modules`` presets resolved against the loaded model.

Presets work on any causal LM transformers builds, and on the T5 and BART encoder-decoders, whatever they
name their layers:

- ``all-linear``: every linear layer (``nn.Linear``, and GPT-2's ``Conv1D``) except the output head;
- ``attention``: the linear layers inside an attention block (a path part containing ``attn`` or ``attention``);
- ``mlp``: the linear layers inside an MLP block (``mlp``, ``feed_forward``, ``ffn``, ``moe``, ``experts``; T5's
  ``DenseReluDense``, ``DenseGatedActDense``).

Embedding layers and the output head (``lm_head``) are never in a preset; name them in an explicit list to
adapt them. An explicit list uses peft's rule: an entry matches a module whose path is the entry or ends
with ``.<entry>``, so ``"q_proj"`` or ``"attn.c_proj"``.

Mixture-of-experts models: transformers 5 stores most families' routed experts as 3-D parameters (experts x
in x out, ``mlp.experts.gate_up_proj``), not linear layers. For an adapter that can adapt parameters (LoRA,
through peft's ``target_parameters``), ``all-linear`` and ``mlp`` include them (:func:`expert_parameters`);
experts kept as lists of linear layers are linear layers like any other. Routers and gates are left out of
every preset (:func:`gate_reason`): a layer 1 wide, a router (as wide as the number of experts, or named as
one, inside an MoE block), or a value or two per head (it writes scalars, not features).

The result is handed to peft as the shortest path suffixes that pick exactly the chosen modules: leaf
names (``q_proj``) where those are unambiguous, ``attn.c_proj`` / ``mlp.c_proj`` for GPT-2, whose
attention and MLP output layers share a name; parameters as at least their module's name and their own
(``experts.gate_up_proj``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from ftcore.errors import FtcoreError

from ftcore_plugins.common.experts import expert_parameters, is_torch_layer  # noqa: F401 - expert_parameters re-exported
from ftcore_plugins.common.vision import vision_parts  # a VLM's tower and projector (re-exported)

PRESETS = ("all-linear", "attention", "mlp")
ATTENTION_WORDS = ("attn", "attention")
MLP_WORDS = ("mlp", "feed_forward", "ffn", "moe", "experts", "densereludense", "densegatedactdense")  # T5's last two


@dataclass
class Targets:
    names: list[str]  # peft's target_modules
    modules: list[str]  # the full paths of the modules they match
    conv1d: bool = False  # GPT-2 style Conv1D layers (weights stored transposed): peft needs fan_in_fan_out=True
    feedforward: list[str] = field(default_factory=list)  # IA3: MLP output projections among the targets
    parameter_names: list[str] = field(default_factory=list)  # peft's target_parameters
    parameters: list[str] = field(default_factory=list)  # the full paths of the parameters they match
    frozen: dict[str, str] = field(default_factory=dict)  # routers and gates a preset left out: path -> why

    def describe(self) -> str:
        """What was asked for (before peft wraps the model); :func:`describe_adapted` says what peft adapted."""
        text = f"{', '.join(self.names)} ({len(self.modules)} layers)"
        if self.parameters:
            text += f"; parameters {', '.join(self.parameter_names)} ({len(self.parameters)} tensors)"
        return text


def _conv1d_class():
    from transformers.pytorch_utils import Conv1D

    return Conv1D


def _linear_classes() -> tuple:
    """``nn.Linear``, GPT-2's ``Conv1D``, and hqq's ``HQQLinear`` once hqq is in use: it replaces a linear
    layer without subclassing ``nn.Linear``, and peft adapts it (``peft/tuners/lora/hqq.py``)."""
    import sys

    import torch

    hqq = sys.modules.get("hqq.core.quantize")
    return (torch.nn.Linear, _conv1d_class()) + ((hqq.HQQLinear,) if hqq is not None else ())


def _is_linear(module: Any) -> bool:
    return isinstance(module, _linear_classes())


def _head_paths(model: Any) -> set[str]:
    """The output head's module path(s): whatever ``get_output_embeddings()`` returns, and ``lm_head``."""
    heads = set()
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    for path, module in model.named_modules():
        if (head is not None and module is head) or path.split(".")[-1] in ("lm_head", "embed_out"):
            heads.add(path)
    return heads


def kind_of(path: str) -> str:
    """``attention``, ``mlp`` or ``other``, from the parts of a module path above its own name."""
    parts = [p.lower() for p in path.split(".")[:-1]]
    if any(w in p for p in parts for w in ATTENTION_WORDS):
        return "attention"
    if any(w in p for p in parts for w in MLP_WORDS):
        return "mlp"
    return "other"


def linear_modules(model: Any, *, with_head: bool = False) -> dict[str, Any]:
    """Every linear layer by path, in model order; the output head only when ``with_head``."""
    heads = set() if with_head else _head_paths(model)
    return {path: m for path, m in model.named_modules() if path and _is_linear(m) and path not in heads}


def _under(path: str, roots: list[str]) -> bool:
    return any(path == r or path.startswith(r + ".") for r in roots)


def _matches(entry: str, path: str) -> bool:
    return path == entry or path.endswith("." + entry)


def shortest_names(chosen: list[str], every: list[str], *, min_parts: int = 1) -> list[str]:
    """Path suffixes (leaf name first, then longer; at least ``min_parts`` parts) that match every path in
    ``chosen`` and no path outside it, among ``every`` module (or parameter) path of the model. In the order
    first met."""
    chosen_set = set(chosen)
    owners: dict[str, set[str]] = {}
    for path in every:
        parts = path.split(".")
        for k in range(1, len(parts) + 1):
            owners.setdefault(".".join(parts[-k:]), set()).add(path)
    names: list[str] = []
    for path in chosen:
        parts = path.split(".")
        for k in range(min(min_parts, len(parts)), len(parts) + 1):
            suffix = ".".join(parts[-k:])
            if owners[suffix] <= chosen_set:
                break
        if suffix not in names:
            names.append(suffix)
    return names


def linear_names(model: Any) -> list[str]:
    """The model's linear layers as short names (the output head included), for messages."""
    every = [p for p, _ in model.named_modules() if p]
    return shortest_names(list(linear_modules(model, with_head=True)), every)


def _expert_counts(model: Any, experts: dict[str, Any]) -> tuple[set[int], list[str]]:
    """How many experts the model's MoE blocks have (the first dimension of the expert parameters, the
    length of lists of experts: ``experts.0.gate_proj``, ...), and the paths of those blocks: the modules
    holding the experts (``model.layers.1.mlp``)."""
    import torch

    counts = {param.shape[0] for param in experts.values()}
    blocks = {path.rsplit(".", 1)[0].rpartition(".")[0] for path in experts}
    for path, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and "expert" in path.rsplit(".", 1)[-1].lower():
            counts.add(len(module))
            blocks.add(path.rpartition(".")[0])
    return counts, sorted(blocks)


def _config(model: Any) -> Any:
    config = getattr(model, "config", None)
    return getattr(config, "text_config", None) or config


def _head_dim(model: Any) -> int | None:
    """The width of one attention head of the (language) model, from its config."""
    config = _config(model)
    try:  # some configs' head_dim is a property that refuses (a per-layer value)
        dim = getattr(config, "head_dim", None)
    except Exception:  # noqa: BLE001
        dim = None
    if not isinstance(dim, int) or dim <= 0:
        hidden = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None)
        heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", None)
        dim = hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads > 0 else None
    return dim


def _width(model: Any) -> int | None:
    """The (language) model's hidden size, from its config."""
    config = _config(model)
    width = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None) or getattr(config, "d_model", None)
    return width if isinstance(width, int) else None


def _most_heads(model: Any) -> int:
    """The largest head count in the (language) model's config: attention, key-value, linear attention's
    (``num_attention_heads``, ``linear_num_value_heads``, GPT-2's ``n_head``, ...); 0 when it names none."""
    config = _config(model)
    fields = vars(config) if config is not None else {}
    return max([v for k, v in fields.items() if k.endswith(("heads", "n_head")) and isinstance(v, int) and not
                isinstance(v, bool)] or [0])


def gate_reason(module: Any, *, routing: str | None, experts: set[int], head_dim: int | None, heads: int,
                width: int | None) -> str | None:
    """Why a linear layer is a router or a gate, which no preset adapts (it writes a routing weight or a
    scalar, not features: LoRA's rank there buys nothing, and a plan can still name it), or None:

    - 1 wide (``shared_expert_gate``);
    - a router: inside an MoE block but outside its experts (``routing``: its path below the block, with
      no ``expert`` part, so not a shared expert), and as wide as the number of experts or named as one
      (a ``gate`` part, a part containing ``router``: ``mlp.router``, ``mlp.gate.wg``);
    - a value or two per head: narrower than one attention head and than the model, and at most twice the
      config's largest head count (the gated DeltaNet's ``in_proj_ba``, ``in_proj_a``, ``in_proj_b``)."""
    out = _shape(module)[1]
    if out == 1:
        return "1 wide"
    if routing is not None:
        parts = routing.lower().split(".")
        if out in experts or any(p == "gate" or "router" in p for p in parts):
            return "router"
    if head_dim and out < head_dim and out <= 2 * heads and out < (width or out + 1):
        return f"{out} wide, per head"
    return None


# A layer's weight read for what it is, not as an operand: these reads see no adapter's change either way
# (nor does a type check, T5's ``isinstance(self.wo.weight, torch.Tensor)`` before it casts to the weight's dtype).
_WEIGHT_READ = re.compile(r"(?<!isinstance\()self\.(\w+)\.weight\b(?!\s*\.\s*(?:dtype|device|shape|size|ndim|numel|"
                          r"dim|is_\w+|requires_grad|data_ptr|element_size)\b)")


def _weights_read_directly(owner_class: type) -> frozenset[str]:
    """The names of the layers whose ``.weight`` a module class's own code uses as an operand
    (``self.out_proj.weight`` handed to a fused Mamba kernel, ``self.dt_proj.weight @ x`` in Jamba's), read
    from its source (and its bases' up to torch's ``Module``); empty when the source cannot be read."""
    cached = _WEIGHT_READS.get(owner_class)
    if cached is None:
        import inspect

        import torch

        names: set[str] = set()
        for cls in owner_class.__mro__:
            if cls is torch.nn.Module or cls is object or cls.__module__.startswith("torch."):
                continue
            try:
                names |= set(_WEIGHT_READ.findall(inspect.getsource(cls)))
            except (OSError, TypeError):
                pass
        cached = _WEIGHT_READS[owner_class] = frozenset(names)
    return cached


_WEIGHT_READS: dict[type, frozenset[str]] = {}


def unadaptable_reason(model: Any, path: str, *, lora: bool = True) -> str | None:
    """Why no preset adapts this linear layer although it is one, or None:

    - peft refuses it on this model (its check for target modules, as peft's ``inject_adapter`` runs it:
      on the Mamba families it knows, ``out_proj`` and ``conv1d``), asked of peft with a probe config of the
      adapter's kind (LoRA when ``lora``, else IA3);
    - the module holding it reads its weight directly (a fused Mamba kernel handed ``out_proj.weight``,
      Jamba's ``dt_proj.weight @ x``): on that path an adapter wrapping the layer is never called, so it
      would neither train nor change the output, whatever the family.

    Decided from the loaded module and from peft, not from a list of families: a plan can still name such a
    layer explicitly (peft then refuses it, or it is adapted as asked)."""
    parent_path, _, leaf = path.rpartition(".")
    refusal = _peft_refusal(model, leaf, lora=lora)
    if refusal:
        return refusal
    parent = model.get_submodule(parent_path) if parent_path else model
    if leaf in _weights_read_directly(type(parent)):
        return f"weight read directly by {type(parent).__name__}"
    return None


def _peft_refusal(model: Any, leaf: str, *, lora: bool) -> str | None:
    """peft's one-line reason for refusing a target named ``leaf`` on ``model``, shortened; None when it
    takes it (or this peft has no such check)."""
    try:
        from peft import IA3Config, LoraConfig
        from peft.tuners.tuners_utils import BaseTuner
    except ImportError:
        return None
    check = getattr(BaseTuner, "_check_target_module_compatiblity", None)
    if check is None:
        return None
    model_type = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
    probe = LoraConfig(target_modules=[leaf]) if lora else IA3Config(target_modules=[leaf], feedforward_modules=[])
    try:
        check(None, probe, model, leaf)  # uses no tuner state: peft's rule for (model, target name)
    except ValueError:
        return f"peft refuses it on {model_type}"
    return None


def _routers(model: Any, experts: set[int], blocks: list[str]) -> list[str]:
    """Routers that are not linear layers (transformers 5's ``TopKRouter``): modules torch does not define,
    inside an MoE block but outside its experts, whose own 2-D ``weight`` has one row per expert. Never a
    target of a preset; listed as left frozen."""
    out = []
    for path, module in model.named_modules():
        block = next((b for b in blocks if path.startswith(b + ".")), None)
        if block is None or "expert" in path[len(block) + 1:].lower() or is_torch_layer(module):
            continue
        weight = module._parameters.get("weight")
        if weight is not None and weight.dim() == 2 and weight.shape[0] in experts:
            out.append(path)
    return out


def parameter_candidates(model: Any) -> dict[str, Any]:
    """What an explicit ``target_parameters`` may name, by path: the experts' parameters
    (:func:`expert_parameters`) and the 2-D weights of modules torch does not define (routers). A linear
    layer's weight is named in ``target_modules`` instead."""
    found = dict(expert_parameters(model))
    for path, module in model.named_modules():
        weight = module._parameters.get("weight") if not is_torch_layer(module) else None
        if weight is not None and weight.dim() == 2 and weight.is_floating_point():
            found.setdefault(f"{path}.weight" if path else "weight", weight)
    order = {p: i for i, (p, _) in enumerate(model.named_parameters())}
    return dict(sorted(found.items(), key=lambda kv: order.get(kv[0], len(order))))


def parameter_names(chosen: list[str], model: Any) -> list[str]:
    """peft's ``target_parameters`` for the parameter paths in ``chosen``: the shortest suffixes of at least
    the module's name and the parameter's (``experts.gate_up_proj``) that match no other parameter."""
    every = [p for p, _ in model.named_parameters(remove_duplicate=False)]
    return shortest_names(chosen, every, min_parts=2)


def _is_down_projection(module: Any, width: int | None) -> bool:
    """An MLP layer that writes back to the model width (down_proj, fc_out, c_proj, dense_4h_to_h)."""
    if width is None:
        return False
    if isinstance(module, _conv1d_class()):
        out_features, in_features = module.nf, module.weight.shape[0]
    else:
        out_features, in_features = module.out_features, module.in_features
    return out_features == width and in_features != width


def resolve(model: Any, spec: str | list[str], *, label: str = "target_modules",
            embeddings: bool = True, feedforward: str | list[str] | None = None, vision: bool = False,
            target_parameters: list[str] | None = None, parameters: bool = True) -> Targets:
    """Resolve a preset or an explicit list against ``model`` (a transformers model, before peft wraps it).

    ``embeddings``: whether an explicit list may name embedding layers (LoRA can adapt them, IA3
    cannot). ``feedforward`` (IA3): ``"auto"`` picks the MLP output projections among the targets, a
    list names them. ``parameters``: whether the adapter can adapt parameters (LoRA, through peft's
    ``target_parameters``; IA3 cannot); then ``all-linear`` and ``mlp`` also choose the experts' parameters
    (:func:`expert_parameters`) unless ``target_parameters`` is given: a list of parameters to adapt
    instead (peft's rule, as for modules; ``[]`` for none). A preset never chooses a router or gate
    (:func:`gate_reason`; ``Targets.frozen`` lists them). Raises :class:`FtcoreError` (one line) when an
    entry matches nothing or something peft cannot adapt, listing the model's linear layers (and the
    parameters it may name). In a vision-language model only the language model's layers are chosen, and
    with ``vision`` the vision tower's too (never the projector, which is trained whole when it is:
    ``modules_to_save``)."""
    import torch

    tower, projector = vision_parts(model)
    left_out = projector + ([] if vision else tower)
    every = [p for p, _ in model.named_modules() if p]
    modules = dict(model.named_modules())
    model_type = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
    experts = {p: t for p, t in expert_parameters(model).items() if not _under(p, left_out)}

    def nothing(entry: str, why: str) -> FtcoreError:
        more = ""
        if experts:  # what the entry may have meant: the experts are parameters, not modules
            names = ", ".join(parameter_names(list(experts), model))
            more = (f"; its experts are parameters ({names}): name them in target_parameters" if parameters
                    else f"; its experts are parameters ({names}), which this adapter cannot adapt")
        return FtcoreError(f"adapter {label}: {entry!r} {why} in this {model_type} model; its linear layers are: "
                           f"{', '.join(linear_names(model))}{more}")

    frozen: dict[str, str] = {}
    chosen_parameters: list[str] = []
    if isinstance(spec, str):
        if spec not in PRESETS:
            raise FtcoreError(f"adapter {label}: unknown preset {spec!r}; use one of {', '.join(PRESETS)} "
                              "or a list of module names")
        linear = linear_modules(model)
        (counts, blocks), head_dim, heads, width = (_expert_counts(model, experts), _head_dim(model),
                                                    _most_heads(model), _width(model))

        def routing(path: str) -> str | None:  # the path below its MoE block, outside the experts
            block = next((b for b in blocks if path.startswith(b + ".")), None)
            below = path[len(block) + 1:] if block is not None else None
            return below if below is not None and "expert" not in below.lower() else None

        chosen = []
        for path in linear:
            if spec == "all-linear" or kind_of(path) == spec:
                why = gate_reason(linear[path], routing=routing(path), experts=counts, head_dim=head_dim,
                                  heads=heads, width=width) or unadaptable_reason(model, path, lora=parameters)
                if why:
                    frozen[path] = why
                else:
                    chosen.append(path)
        routers = _routers(model, counts, blocks)
        frozen.update({p: "router" for p in routers if spec == "all-linear" or kind_of(p) == spec})
        if parameters and target_parameters is None:
            chosen_parameters = [p for p in experts if spec == "all-linear" or kind_of(p) == spec]
        if not chosen and not chosen_parameters and not target_parameters:
            raise nothing(spec, "selects no layer")
    else:
        if not spec:
            raise FtcoreError(f"adapter {label}: the list is empty; name at least one module, or use a preset "
                              f"({', '.join(PRESETS)})")
        allowed: tuple = _linear_classes() + ((torch.nn.Embedding,) if embeddings else ())
        chosen = []
        for entry in spec:
            found = [p for p in every if _matches(entry, p)]
            if not found:
                raise nothing(entry, "matches no module")
            wrong = sorted({type(modules[p]).__name__ for p in found if not isinstance(modules[p], allowed)})
            if wrong:
                kinds = "linear" + (" or embedding" if embeddings else "")
                raise nothing(entry, f"names {'/'.join(wrong)} modules, not {kinds} layers,")
            chosen += [p for p in found if p not in chosen]
    if target_parameters:
        chosen_parameters = _explicit_parameters(model, target_parameters, left_out, model_type)
    if left_out:
        chosen = [p for p in chosen if not _under(p, left_out)]
        frozen = {p: why for p, why in frozen.items() if not _under(p, left_out)}
        if not chosen and not chosen_parameters:
            raise nothing(spec if isinstance(spec, str) else ", ".join(spec),
                          "selects only vision tower or projector layers (set vision_tower = true to adapt the tower)")
    conv1d = any(isinstance(modules[p], _conv1d_class()) for p in chosen)
    names = shortest_names(chosen, every) if chosen else []
    found_parameters = parameter_names(chosen_parameters, model) if chosen_parameters else []

    if feedforward is None:
        return Targets(names, chosen, conv1d, parameter_names=found_parameters, parameters=chosen_parameters,
                       frozen=frozen)

    # IA3: the feedforward layers get their input scaled, the others their output; peft wants the
    # feedforward names to be a subset of the target names, so name the two groups separately.
    width = getattr(getattr(model, "config", None), "hidden_size", None)
    if feedforward == "auto":
        ff = [p for p in chosen if kind_of(p) == "mlp" and _is_down_projection(modules[p], width)]
    else:
        ff = []
        for entry in feedforward:
            found = [p for p in chosen if _matches(entry, p)]
            if not found:
                raise FtcoreError(f"adapter feedforward_modules: {entry!r} matches none of the targeted layers "
                                  f"({', '.join(shortest_names(chosen, every))}); feedforward layers must be targets")
            ff += [p for p in found if p not in ff]
    ff_names = shortest_names(ff, every) if ff else []
    others = [p for p in chosen if p not in ff]
    names = (shortest_names(others, every) if others else []) + ff_names
    return Targets(names, chosen, conv1d, ff_names, frozen=frozen)


def _explicit_parameters(model: Any, entries: list[str], left_out: list[str], model_type: str) -> list[str]:
    """The parameter paths an explicit ``target_parameters`` names; one line listing what it may name when
    an entry matches none of them."""
    candidates = [p for p in parameter_candidates(model) if not _under(p, left_out)]
    chosen: list[str] = []
    for entry in entries:
        found = [p for p in candidates if _matches(entry, p)]
        if not found:
            elsewhere = any(_matches(entry, p) for p, _ in model.named_parameters())
            why = ("names a parameter of a linear layer, norm or embedding (name linear layers in target_modules)"
                   if elsewhere else "matches no parameter")
            names = ", ".join(parameter_names(candidates, model)) if candidates else \
                "none (no experts or routers stored as parameters)"
            raise FtcoreError(f"adapter target_parameters: {entry!r} {why} in this {model_type} model; the "
                              f"parameters it may name are: {names}")
        chosen += [p for p in found if p not in chosen]
    return chosen


def _shape(module: Any) -> tuple[int, int] | None:
    """``(in, out)`` features of a linear (or GPT-2 Conv1D) layer, ``(rows, width)`` of an embedding."""
    import torch

    if isinstance(module, _conv1d_class()):
        return module.weight.shape[0], module.nf
    if _is_linear(module):
        return module.in_features, module.out_features
    if isinstance(module, torch.nn.Embedding):
        return module.num_embeddings, module.embedding_dim
    return None


# Output layers of a task (transformers' sequence-classification heads, TRL's value head): as narrow as
# their labels, so they bound no rank.
TASK_HEADS = {"score", "classifier", "v_head"}


def check_rank(model: Any, targets: Targets, r: int, *, label: str = "r") -> None:
    """A rank no larger than the smaller dimension of every targeted layer: a LoRA update of a layer
    ``in x out`` has rank at most ``min(in, out)``, and at that rank it already holds more parameters than
    the layer. A targeted parameter counts per matrix: an expert parameter (experts x in x out) by one
    expert's matrix, which gets its own rank-``r`` update. Only the targets bound it: the routers and gates
    a preset leaves out do not. Raises :class:`FtcoreError` (one line) naming the narrowest target."""
    modules = dict(model.named_modules())
    params = dict(model.named_parameters(remove_duplicate=False))
    narrowest = None  # (path, (a, b), is a parameter)
    for path in targets.modules:
        if path.rpartition(".")[2] in TASK_HEADS:  # a reward or classification head: one value a label
            continue
        shape = _shape(modules[path])
        if shape is not None and (narrowest is None or min(shape) < min(narrowest[1])):
            narrowest = (path, shape, False)
    for path in targets.parameters:
        shape = tuple(params[path].shape[-2:])
        if narrowest is None or min(shape) < min(narrowest[1]):
            narrowest = (path, shape, params[path].dim() == 3)
    if narrowest is not None and r > min(narrowest[1]):
        path, (a, b), expert = narrowest
        name = next((n for n in (*targets.names, *targets.parameter_names) if _matches(n, path)), path)
        raise FtcoreError(f"adapter {label}: {r} is more than the smaller dimension of the targeted layers "
                          f"({name}: {a} x {b}{' per expert' if expert else ''}), beyond which a rank adds "
                          f"parameters but no capacity; use at most {min(a, b)}, or full fine-tuning "
                          "(adapter = \"full\")")


def check_modules_to_save(model: Any, entries: list[str] | None, *, label: str = "modules_to_save") -> None:
    """Each ``modules_to_save`` entry names a module of the model (peft's rule: the module's path, or its
    end after a dot); peft would skip one that names none, and the stage would train without it."""
    if not entries:
        return
    every = [p for p, _ in model.named_modules() if p]
    model_type = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
    for entry in entries:
        if not any(_matches(entry, p) for p in every):
            from ftcore.errors import did_you_mean

            leaves = sorted({p.split(".")[-1] for p in every if not p.split(".")[-1].isdigit()})
            raise FtcoreError(f"adapter {label}: {entry!r} matches no module in this {model_type} model"
                              f"{did_you_mean(entry.split('.')[-1], leaves)}; its modules are named: "
                              f"{', '.join(leaves)}")


def peft_renames(model: Any, names: list[str]) -> list[str]:
    """The ``target_modules`` entries peft would not apply as module names to this model. On transformers 5,
    for the families whose experts it fused (Mixtral, and those on Qwen2-MoE's pattern: Qwen3-MoE, OLMoE,
    DeepSeek-V3, Qwen3-Next), peft rewrites the old expert names (``gate_proj``, ``up_proj``, ``down_proj``;
    ``w1``, ``w2``, ``w3``) into ``target_parameters`` on the fused experts, whichever layers the names were
    meant for (a dense MLP, the shared experts), and refuses one half of a fused pair. Asked of peft's own
    conversion, one name at a time."""
    try:
        from peft.import_utils import is_transformers_ge_v5
    except ImportError:  # a peft from before transformers 5 converts nothing
        return []
    if not is_transformers_ge_v5:
        return []
    from peft import LoraConfig
    from peft.utils.transformers_weight_conversion import convert_peft_config_for_transformers

    renamed = []
    for name in names:
        probe = LoraConfig(target_modules=[name])
        try:
            convert_peft_config_for_transformers(probe, model, None)
        except ValueError:  # half of a fused pair
            renamed.append(name)
            continue
        if name not in set(probe.target_modules or ()):
            renamed.append(name)
    return renamed


def _base_path(path: str) -> str:
    """A path in a peft model as in the base model: without peft's prefix and its ``base_layer`` levels."""
    return ".".join(p for p in path.removeprefix("base_model.model.").split(".") if p != "base_layer")


def adapted(model: Any, adapter: str = "default") -> tuple[list[str], dict[str, int]]:
    """What peft adapted with LoRA, read from a wrapped model's layers: the paths of the modules it wrapped,
    and of the parameters it wrapped (``target_parameters``) with how many experts each holds (1 for a
    matrix), as in the base model, in model order."""
    from peft.tuners.lora import LoraLayer, ParamWrapper

    order = {_base_path(n): i for i, (n, _) in enumerate(model.named_parameters(remove_duplicate=False))}
    layers, params = [], {}
    for path, module in model.named_modules():
        if not isinstance(module, LoraLayer) or \
                (adapter not in module.lora_A and adapter not in getattr(module, "lora_embedding_A", {})):
            continue
        if isinstance(module, ParamWrapper):
            params[f"{_base_path(path)}.{module.parameter_name}"] = module.num_experts
        elif _base_path(path) not in layers:
            layers.append(_base_path(path))
    params = dict(sorted(params.items(), key=lambda kv: order.get(kv[0], len(order))))
    return layers, params


def settle_names(model: Any, adapter: str = "default") -> tuple[list[str], list[str]]:
    """The wrapped model's ``target_modules`` and ``target_parameters`` as its config holds them, in model
    order (of the first module or parameter each matches), and put back into the config as such lists:
    peft's transformers-5 conversion leaves them as sets, which ``adapter_config.json`` would list in a
    different order in each process."""
    layers, params = adapted(model, adapter)
    config = model.peft_config[adapter]

    def ordered(names: Any, paths: list[str]) -> list[str]:
        names = [names] if isinstance(names, str) else list(names or [])
        first = {n: next((i for i, p in enumerate(paths) if _matches(n, p)), len(paths)) for n in names}
        return sorted(names, key=lambda n: (first[n], n))

    module_names = ordered(config.target_modules, layers)
    parameter_names_ = ordered(getattr(config, "target_parameters", None), list(params))
    if not isinstance(config.target_modules, str):  # a regular expression stays one
        config.target_modules = module_names
    if getattr(config, "target_parameters", None):
        config.target_parameters = parameter_names_
    return module_names, parameter_names_


def language_model_names(model: Any, layers: list[str]) -> list[str] | None:
    """On a vision-language model whose vision tower and projector got no adapter: the shortest names that pick
    ``layers`` among the language model's modules alone (``q_proj``, as on a text model), for the targets
    line; peft's names must also leave out the tower's layers of the same names, so they are longer. None
    on any other model."""
    tower, projector = vision_parts(model)
    vision = [_base_path(p) for p in tower + projector]
    if not vision or any(_under(p, vision) for p in layers):
        return None
    every = {_base_path(p) for p, _ in model.named_modules() if p}
    return shortest_names(layers, [p for p in every if not _under(p, vision)])


def describe_adapted(model: Any, frozen: dict[str, tuple[str, str]] | None = None, adapter: str = "default") -> str:
    """The targets line of a wrapped model, from what peft adapted (:func:`adapted`) and the names in its
    config (:func:`settle_names`): ``q_proj, k_proj (8 layers); parameters experts.gate_up_proj,
    experts.down_proj (4 tensors of 4 experts each)``, then those of the routers and gates ``frozen`` (path
    -> (name, why)) that got no adapter."""
    layers, params = adapted(model, adapter)
    module_names, parameter_names_ = settle_names(model, adapter)
    text = f"{', '.join(language_model_names(model, layers) or module_names)} ({len(layers)} layers)" if layers \
        else "no layer"
    if params:
        held = [n for n in params.values() if n > 1]  # expert tensors; the others are single matrices
        counts = "/".join(map(str, sorted(set(held))))
        of = "" if not held else f" of {counts} experts each" if len(held) == len(params) else \
            f", {len(held)} of {counts} experts each"
        text += f"; parameters {', '.join(parameter_names_)} ({len(params)} tensors{of})"
    wrapped = set(layers) | {p.rpartition(".")[0] for p in params}
    groups: dict[tuple[str, str], int] = {}
    for path, (name, why) in (frozen or {}).items():
        if path not in wrapped:
            groups[name, why] = groups.get((name, why), 0) + 1
    if groups:
        text += "; left frozen: " + ", ".join(f"{name} x{n} ({why})" for (name, why), n in groups.items())
    return text
