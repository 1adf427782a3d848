"""Encoder-decoder models (T5, Flan-T5, mT5, BART): what the loaders, trainers, evaluators and exporters
share about them.

An encoder-decoder reads the prompt in its encoder and writes the answer with its decoder, so a row
becomes two sequences, not one: ``input_ids`` (the encoder's input: the prompt, as the template renders
it with its generation prompt) and ``labels`` (the answer's tokens and EOS, every one trained; the
model shifts them right itself to make the decoder's input), each with the tokenizer's own special
tokens (T5's ``</s>`` after both; BART's ``<s>`` before and ``</s>`` after; none from a tokenizer the
``scratch`` loader trains, so its labels are the answer's tokens and EOS). Only the last assistant turn
of a conversation is the answer; the turns before it are the prompt.

Which plans hold one is told from the plan and ``config.json`` alone (:func:`plan_encoder_decoder`: no
torch, nothing loaded), so ``ftcore validate`` refuses what does not train or export one, in one line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ftcore.errors import FtcoreError

# The encoder-decoder families ftcore trains (sft, LoRA or full) and tests; Flan-T5 is "t5".
FAMILIES = ("t5", "mt5", "bart")
DOCS = "docs/trainers.md, \"Encoder-decoder models\""


# -- the plan (no torch) -------------------------------------------------------------------------------

def plan_encoder_decoder(plan: Any) -> str | None:
    """The model type of the plan's model when it is an encoder-decoder, found without loading: the
    ``scratch`` loader's ``architecture``, or the ``config.json`` of a local folder or of a hub id in the
    local hub cache (``is_encoder_decoder``, which every transformers encoder-decoder config sets). None for
    a causal LM, or when it cannot be known yet (a hub id not downloaded, no plan: a component checked alone)."""
    if plan is None:
        return None
    options = plan.model.options
    architecture = getattr(options, "architecture", None)
    if isinstance(architecture, str):
        return architecture if architecture in FAMILIES else None
    path = getattr(options, "path", None)
    return config_encoder_decoder(model_config(str(path), getattr(options, "revision", None))) if path else None


def config_encoder_decoder(config: dict[str, Any] | None) -> str | None:
    """The model type of a ``config.json`` (a dict) that describes an encoder-decoder, else None."""
    if config is None:
        return None
    kind = config.get("model_type")
    return str(kind or "unknown") if config.get("is_encoder_decoder") or kind in FAMILIES else None


def model_config(path: str, revision: str | None = None) -> dict[str, Any] | None:
    """``config.json`` of a local model folder, or of a hub id from the local hub cache alone (never the
    network); None where there is none to read."""
    if Path(path).is_dir():
        return read_config_file(Path(path) / "config.json")
    return _cached_config(path, revision)


def read_config_file(file: Path) -> dict[str, Any] | None:
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # the loader's checks say why
    return config if isinstance(config, dict) else None


def _cached_config(repo: str, revision: str | None) -> dict[str, Any] | None:
    """A hub model's ``config.json`` from the local hub cache alone (never the network)."""
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(repo, "config.json", revision=revision)
    except Exception:  # noqa: BLE001 - an id the cache cannot hold: nothing known yet
        return None
    return read_config_file(Path(found)) if isinstance(found, str) else None


def refusal(what: str, family: str, why: str, fix: str = "") -> str:
    """The one line a component that works on causal LMs only says about an encoder-decoder."""
    return f"{what} does not work on an encoder-decoder model ({family}): {why}{'; ' + fix if fix else ''} ({DOCS})"


# -- the loaded model ----------------------------------------------------------------------------------

def is_encoder_decoder(model: Any) -> bool:
    """Whether a loaded model (a peft wrapper or a meta model too) is an encoder-decoder."""
    return bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False))


def auto_class(config: Any) -> Any:
    """The transformers auto class that builds a text model of ``config``: a seq2seq LM for an
    encoder-decoder of :data:`FAMILIES`, else a causal LM (as the ``scratch`` loader builds a ``pegasus``:
    its decoder alone)."""
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    seq2seq = getattr(config, "is_encoder_decoder", False) and getattr(config, "model_type", None) in FAMILIES
    return AutoModelForSeq2SeqLM if seq2seq else AutoModelForCausalLM


def peft_task_type(model: Any) -> str:
    """peft's task type for the model: its seq2seq wrapper passes the decoder's inputs through."""
    return "SEQ_2_SEQ_LM" if is_encoder_decoder(model) else "CAUSAL_LM"


def decoder_start(model: Any) -> int:
    config = model.config
    start = getattr(config, "decoder_start_token_id", None)
    if start is None:
        start = getattr(getattr(model, "generation_config", None), "decoder_start_token_id", None)
    if start is None:
        raise FtcoreError(f"the {config.model_type} model's config sets no decoder_start_token_id, so its decoder "
                          "has no first token; set it in config.json (T5: the pad token's id, BART: EOS's)")
    return int(start)


def decoder_inputs(model: Any, ids: Any) -> dict[str, Any]:
    """Inputs that run the decoder too, for comparing logits (an export's check): the encoder reads ``ids``
    and the decoder reads them again, after its start token."""
    import torch

    start = torch.full((ids.shape[0], 1), decoder_start(model), dtype=ids.dtype, device=ids.device)
    return {"input_ids": ids, "decoder_input_ids": torch.cat([start, ids[:, :-1]], dim=1)}


def encoder_batch(tokenizer: Any, texts: list[str]) -> Any:
    """Rendered prompts as the encoder reads them in training (:func:`encode`), right-padded: BART's learned
    positions count from the first token, so left padding would move every prompt."""
    side, tokenizer.padding_side = tokenizer.padding_side, "right"
    try:
        return tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=True)
    finally:
        tokenizer.padding_side = side


# -- rows into encoder inputs and labels -------------------------------------------------------------

def source_target(row: dict, tokenizer: Any, template: Any) -> tuple[str, str | None]:
    """A row's prompt (the encoder's text) and answer (the decoder's; None when the row has none): the
    last assistant turn of a conversation and the turns before it, rendered as the ``generation``
    evaluator renders prompts; a prompt/completion row's two strings as they are."""
    from ftcore_plugins.common.chat import prompt_text

    messages = row.get("messages")
    if messages:
        last = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=None)
        if last is None:
            return prompt_text(row, tokenizer, template), None
        return prompt_text({"messages": messages[:last + 1]}, tokenizer, template), messages[last].get("content") or ""
    if isinstance(row.get("prompt"), str) and row.get("completion") is not None:
        return row["prompt"], row["completion"]
    raise FtcoreError("an encoder-decoder model trains on a prompt and its answer: rows with 'messages' or "
                      f"'prompt'+'completion' (this row has: {', '.join(k for k, v in row.items() if v is not None)})")


def encode(rows: Any, tokenizer: Any, template: Any, *, max_length: int | None, truncation: str = "truncate_response",
           progress: Any = None, batch: int = 1000, on_error: str = "error", where: str = "data", first_row: int = 0,
           sink: Any = None, **_: Any) -> tuple[dict[str, list], Any]:
    """``common.chat.encode`` for an encoder-decoder: ``input_ids`` the prompt, ``labels`` the answer and
    EOS (each with the tokenizer's special tokens). ``max_length`` holds each of the two: an answer keeps its first ``max_length`` tokens; a prompt
    its first (``truncate_response``, which cuts the end) or its last (``truncate_prompt``, which cuts the
    oldest turns); ``drop`` drops the row. Options of the causal encoding (``train_on_inputs``, ...) are
    refused by the trainer's check, and ignored here."""
    from ftcore_plugins.common.chat import EncodeStats, _NoProgress

    stats = EncodeStats()
    eos = tokenizer.eos_token_id
    if eos is None:
        raise FtcoreError(f"{where}: the tokenizer has no EOS token to end the answers with; set eos_token")
    out: dict[str, list] = {"input_ids": [], "labels": []}
    bar = progress or _NoProgress()
    for start in range(0, len(rows), batch):
        chunk = rows[start:start + batch]
        chunk = [dict(zip(chunk, values)) for values in zip(*chunk.values())] if isinstance(chunk, dict) \
            else list(chunk)
        stats.rows += len(chunk)
        pairs = []
        for k, row in enumerate(chunk):
            try:
                pairs.append(source_target(row, tokenizer, template))
            except FtcoreError as exc:
                if on_error == "skip":
                    stats.skipped_unrenderable += 1
                    continue
                raise FtcoreError(f"{where}, row {first_row + start + k + 1}: {exc}; fix the row, or set "
                                  "on_error = \"skip\" in the data source to skip such rows") from None
        stats.samples += len(pairs)
        answered = [(s, t) for s, t in pairs if t is not None]
        stats.dropped_no_labels += len(pairs) - len(answered)
        if answered:
            # Each side with the tokenizer's own special tokens, as its checkpoints were trained (BART's
            # answers start with <s>), and the answer ends with EOS.
            sources = tokenizer([s for s, _ in answered], add_special_tokens=True)["input_ids"]
            targets = tokenizer([t for _, t in answered], add_special_tokens=True)["input_ids"]
            for ids, labels in zip(sources, targets):
                labels = labels if labels and labels[-1] == eos else [*labels, eos]
                if max_length is not None and max(len(ids), len(labels)) > max_length:
                    if truncation == "drop":
                        stats.dropped_too_long += 1
                        continue
                    ids = ids[-max_length:] if truncation == "truncate_prompt" else ids[:max_length]
                    labels = labels[:max_length]
                    stats.truncated += 1
                out["input_ids"].append(ids)
                out["labels"].append(labels)
                stats.kept += 1
                stats.tokens += len(ids) + len(labels)
                stats.label_tokens += len(labels)
                stats.lengths.append(len(ids) + len(labels))
        if sink is not None and out["input_ids"]:
            sink(out)
            out = {"input_ids": [], "labels": []}
        bar.advance(len(chunk))
    return out, stats
