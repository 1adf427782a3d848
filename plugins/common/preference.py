"""Preference rows as the trainers and the ``preference`` evaluator both see them.

* which kind of rows a table holds (pairs or unpaired), and the one-line message when a
  component needs another kind;
* rendering: each row's prompt messages rendered by the plan's chat template with the generation
  prompt, and each answer as the text that continues it (the template's end of turn included),
  in the plain-text prompt/chosen/rejected (or prompt/completion/label) form TRL takes;
* the token ids TRL will build from that text;
* the log-probabilities of answers, and the pair metrics made of them.
"""

from __future__ import annotations

from typing import Any

from ftcore.errors import FtcoreError

from ftcore_plugins.common.spans import template_title

PAIRS = "preference pairs (prompt, chosen, rejected)"
UNPAIRED = "unpaired preference rows (prompt, completion, label)"
# A data source's `format` and the kind of rows it gives (prompt_completion can give either kind).
FORMAT_KIND = {"preference": "pairs", "sharegpt_preference": "pairs", "implicit_preference": "pairs",
               "kto": "unpaired", "alpaca": "chat", "sharegpt": "chat", "messages": "chat", "openai": "chat",
               "text": "text"}


def kind_of_columns(columns: Any) -> str | None:
    columns = set(columns)
    if {"prompt", "chosen", "rejected"} <= columns:
        return "pairs"
    if {"prompt", "completion", "label"} <= columns:
        return "unpaired"
    if "messages" in columns:
        return "chat"
    if "text" in columns:
        return "text"
    return None


def wrong_kind(trainer: str, accepts: tuple[str, ...], what: str) -> str:
    wanted = " or ".join(PAIRS if k == "pairs" else UNPAIRED for k in accepts)
    hint = "; chat rows train with trainer = \"sft\"" if "chat" in what or "messages" in what else ""
    return f"trainer '{trainer}' needs {wanted}; {what}{hint}"


# -- rendering --------------------------------------------------------------------------------


def adds_bos(tokenizer: Any) -> bool:
    """Whether tokenizing text (with special tokens) puts a BOS token in front of it."""
    bos = tokenizer.bos_token_id
    return bos is not None and tokenizer("a")["input_ids"][:1] == [bos]


def render(ctx: Any, data: Any, *, strip_bos: bool, template: Any = None, keep: tuple[str, ...] = ("label",)) -> Any:
    """Rows as text: the prompt rendered with the generation prompt, each answer as its continuation
    (up to and including the template's end of turn). ``strip_bos``: drop a BOS the template wrote,
    for trainers that tokenize with the tokenizer's special tokens, which add it again. ``template``
    replaces the plan's (rows with images: one that renders image parts); the ``keep`` columns stay."""
    from ftcore_plugins.common.chat import template_messages

    tok, template = ctx.tokenizer, template or ctx.template
    bos = tok.bos_token if strip_bos and adds_bos(tok) else None
    answers = [c for c in ("chosen", "rejected", "completion") if c in data.column_names]

    def one(row: dict) -> dict:
        prompt = template_messages(row["prompt"])
        text = template.render(prompt, tok, add_generation_prompt=True)
        out = {}
        for column in answers:
            full = template.render(prompt + template_messages(row[column]), tok, add_generation_prompt=False)
            if not full.startswith(text):
                raise FtcoreError(f"stage {ctx.stage}: {template_title(template)} renders the prompt differently "
                                  "when an answer follows it, so the answer cannot be cut from the prompt")
            out[column] = full[len(text):].rstrip("\n ")  # ends with the end-of-turn token, like the SFT labels
        if bos and text.startswith(bos):
            text = text[len(bos):]
        return {"prompt": text, **out}

    return data.map(one, remove_columns=[c for c in data.column_names if c not in keep],
                    desc=f"render {ctx.stage}")


def unpair(data: Any, seed: int) -> Any:
    """Pairs as unpaired rows for KTO: each chosen answer desirable, each rejected one undesirable,
    shuffled (KTO reads its data in order, and estimates its KL term from neighbouring rows)."""
    import datasets

    rows = {"prompt": [], "completion": [], "label": []}
    for prompt, chosen, rejected in zip(data["prompt"], data["chosen"], data["rejected"]):
        rows["prompt"] += [prompt, prompt]
        rows["completion"] += [chosen, rejected]
        rows["label"] += [True, False]
    return datasets.Dataset.from_dict(rows).shuffle(seed=seed)


# -- token ids ----------------------------------------------------------------------------------


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def token_ids(tok: Any, prompt: str, answers: list[str], *, style: str) -> tuple[list[int], list[list[int]]]:
    """The prompt's ids and each answer's ids as the trainer builds them from the text. The answer
    starts where the ids of the prompt and of prompt+answer diverge.

    ``trl`` (DPO, KTO): tokenized with the tokenizer's special tokens, EOS text appended to answers
    that lack it. ``orpo``: no special tokens, then BOS prepended and EOS appended where missing.
    ``plain`` (reward): the rendered text only, as SFT trains on it."""
    special = style == "trl"
    if special:
        eos = tok.eos_token or ""
        answers = [a if a.endswith(eos) else a + eos for a in answers]
    prompt_ids = tok(prompt, add_special_tokens=special)["input_ids"]
    ids = [tok(prompt + a, add_special_tokens=special)["input_ids"] for a in answers]
    n = min(_common_prefix(prompt_ids, full) for full in ids)
    prompt_ids, outs = prompt_ids[:n], [full[n:] for full in ids]
    if style == "orpo":
        if tok.bos_token_id is not None and prompt_ids[:1] != [tok.bos_token_id]:
            prompt_ids = [tok.bos_token_id, *prompt_ids]
        if tok.eos_token_id is not None:
            outs = [o if o[-1:] == [tok.eos_token_id] else [*o, tok.eos_token_id] for o in outs]
    return prompt_ids, outs


def tokenize(tok: Any, rows: Any, *, style: str) -> list[tuple[list[int], list[list[int]]]]:
    answers = [c for c in ("chosen", "rejected", "completion") if c in rows.column_names]
    return [token_ids(tok, row["prompt"], [row[c] for c in answers], style=style) for row in rows]


# -- log-probabilities ------------------------------------------------------------------------


def answer_logps(model: Any, ids: list[tuple[list[int], list[list[int]]]], max_length: int, pad_id: int,
                 batch_size: int) -> Any:
    """Summed log-probability and token count of every answer given its prompt, as TRL scores it
    (prompt+answer cut to ``max_length``, rows whose prompt fills it left out). Returns a tensor
    (rows, answers, 2)."""
    import torch

    rows = [(p, answers) for p, answers in ids if len(p) < max_length]
    seqs = [((p + a)[:max_length], len(p)) for p, answers in rows for a in answers]
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    sums, counts = [], []
    try:
        with torch.no_grad():
            for start in range(0, len(seqs), batch_size):
                chunk = seqs[start:start + batch_size]
                width = max(len(s) for s, _ in chunk)
                input_ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
                attention = torch.zeros_like(input_ids)
                answer = torch.zeros_like(input_ids, dtype=torch.bool)
                for i, (s, n_prompt) in enumerate(chunk):
                    input_ids[i, :len(s)] = torch.tensor(s)
                    attention[i, :len(s)] = 1
                    answer[i, n_prompt:len(s)] = True
                input_ids, attention, answer = input_ids.to(device), attention.to(device), answer.to(device)
                logits = model(input_ids=input_ids, attention_mask=attention, use_cache=False).logits
                logits = logits[:, -width:]  # prompt-learning adapters prepend virtual tokens
                logps = torch.log_softmax(logits[:, :-1].float(), dim=-1)
                token = logps.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
                mask = answer[:, 1:]
                sums.append((token * mask).sum(-1).cpu())
                counts.append(mask.sum(-1).cpu())
    finally:
        model.train(was_training)
    n_answers = len(rows[0][1]) if rows else 1
    return torch.stack([torch.cat(sums), torch.cat(counts).float()], -1).view(len(rows), n_answers, 2)


def pair_metrics(prefix: str, chosen: Any, rejected: Any) -> dict[str, float]:
    """Share of pairs whose chosen answer scores higher, and the mean score difference."""
    return {f"{prefix}accuracy": (chosen > rejected).float().mean().item(),
            f"{prefix}margin": (chosen - rejected).mean().item()}
