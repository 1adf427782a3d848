"""Which layers an adapter adapts: ``target_modules`` presets resolved against the loaded model.

Presets work on any causal LM transformers builds, whatever it names its layers:

- ``all-linear``: every linear layer (``nn.Linear``, and GPT-2's ``Conv1D``) except the output head;
- ``attention``: the linear layers inside an attention block (a path part containing ``attn`` or ``attention``);
- ``mlp``: the linear layers inside an MLP block (``mlp``, ``feed_forward``, ``ffn``, ``moe``, ``experts``).

Embedding layers and the output head (``lm_head``) are never in a preset; name them in an explicit list to
adapt them. An explicit list uses peft's rule: an entry matches a module whose path is the entry or ends
with ``.<entry>``, so ``"q_proj"`` or ``"attn.c_proj"``.

The result is handed to peft as the shortest path suffixes that pick exactly the chosen modules: leaf
names (``q_proj``) where those are unambiguous, ``attn.c_proj`` / ``mlp.c_proj`` for GPT-2, whose
attention and MLP output layers share a name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ftcore.errors import FtcoreError

from ftcore_plugins.common.vision import vision_parts  # a VLM's tower and projector (re-exported)

PRESETS = ("all-linear", "attention", "mlp")
ATTENTION_WORDS = ("attn", "attention")
MLP_WORDS = ("mlp", "feed_forward", "ffn", "moe", "experts")


@dataclass
class Targets:
    names: list[str]  # peft's target_modules
    modules: list[str]  # the full paths of the modules they match
    conv1d: bool = False  # GPT-2 style Conv1D layers (weights stored transposed): peft needs fan_in_fan_out=True
    feedforward: list[str] = field(default_factory=list)  # IA3: MLP output projections among the targets

    def describe(self) -> str:
        return f"{', '.join(self.names)} ({len(self.modules)} layers)"


def _conv1d_class():
    from transformers.pytorch_utils import Conv1D

    return Conv1D


def _is_linear(module: Any) -> bool:
    import torch

    return isinstance(module, (torch.nn.Linear, _conv1d_class()))


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


def shortest_names(chosen: list[str], every: list[str]) -> list[str]:
    """Path suffixes (leaf name first, then longer) that match every path in ``chosen`` and no path
    outside it, among ``every`` module path of the model. In the order first met."""
    chosen_set = set(chosen)
    owners: dict[str, set[str]] = {}
    for path in every:
        parts = path.split(".")
        for k in range(1, len(parts) + 1):
            owners.setdefault(".".join(parts[-k:]), set()).add(path)
    names: list[str] = []
    for path in chosen:
        parts = path.split(".")
        for k in range(1, len(parts) + 1):
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
            embeddings: bool = True, feedforward: str | list[str] | None = None, vision: bool = False) -> Targets:
    """Resolve a preset or an explicit list against ``model`` (a transformers model, before peft wraps it).

    ``embeddings``: whether an explicit list may name embedding layers (LoRA can adapt them, IA3
    cannot). ``feedforward`` (IA3): ``"auto"`` picks the MLP output projections among the targets, a
    list names them. Raises :class:`FtcoreError` (one line) when an entry matches nothing or
    something peft cannot adapt, listing the model's linear layers. In a vision-language model only
    the language model's layers are chosen, and with ``vision`` the vision tower's too (never the
    projector, which is trained whole when it is: ``modules_to_save``)."""
    import torch

    tower, projector = vision_parts(model)
    left_out = projector + ([] if vision else tower)
    every = [p for p, _ in model.named_modules() if p]
    modules = dict(model.named_modules())
    model_type = getattr(getattr(model, "config", None), "model_type", type(model).__name__)

    def nothing(entry: str, why: str) -> FtcoreError:
        return FtcoreError(f"adapter {label}: {entry!r} {why} in this {model_type} model; its linear layers are: "
                           f"{', '.join(linear_names(model))}")

    if isinstance(spec, str):
        if spec not in PRESETS:
            raise FtcoreError(f"adapter {label}: unknown preset {spec!r}; use one of {', '.join(PRESETS)} "
                              "or a list of module names")
        linear = linear_modules(model)
        chosen = [p for p in linear if spec == "all-linear" or kind_of(p) == spec]
        if not chosen:
            raise nothing(spec, "selects no layer")
    else:
        if not spec:
            raise FtcoreError(f"adapter {label}: the list is empty; name at least one module, or use a preset "
                              f"({', '.join(PRESETS)})")
        allowed: tuple = (torch.nn.Linear, _conv1d_class()) + ((torch.nn.Embedding,) if embeddings else ())
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
    if left_out:
        chosen = [p for p in chosen if not _under(p, left_out)]
        if not chosen:
            raise nothing(spec if isinstance(spec, str) else ", ".join(spec),
                          "selects only vision tower or projector layers (set vision_tower = true to adapt the tower)")
    conv1d = any(isinstance(modules[p], _conv1d_class()) for p in chosen)

    if feedforward is None:
        return Targets(shortest_names(chosen, every), chosen, conv1d)

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
    return Targets(names, chosen, conv1d, ff_names)


def _shape(module: Any) -> tuple[int, int] | None:
    """``(in, out)`` features of a linear (or GPT-2 Conv1D) layer, ``(rows, width)`` of an embedding."""
    import torch

    if isinstance(module, _conv1d_class()):
        return module.weight.shape[0], module.nf
    if isinstance(module, torch.nn.Linear):
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
    the layer. Raises :class:`FtcoreError` (one line) naming the narrowest layer."""
    modules = dict(model.named_modules())
    narrowest = None
    for path in targets.modules:
        if path.rpartition(".")[2] in TASK_HEADS:  # a reward or classification head: one value a label
            continue
        shape = _shape(modules[path])
        if shape is not None and (narrowest is None or min(shape) < min(narrowest[1])):
            narrowest = (path, shape)
    if narrowest is not None and r > min(narrowest[1]):
        path, (a, b) = narrowest
        name = shortest_names([path], [p for p in modules if p])[0]
        raise FtcoreError(f"adapter {label}: {r} is more than the smaller dimension of the targeted layers "
                          f"({name}: {a} x {b}), beyond which a rank adds parameters but no capacity; use at most "
                          f"{min(a, b)}, or full fine-tuning (adapter = \"full\")")


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
