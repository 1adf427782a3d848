"""An Ollama ``Modelfile`` for a GGUF export: ``FROM``, the chat template as a Go ``TEMPLATE``, and a
``PARAMETER stop`` for each end-of-turn token.

Ollama's templates are Go templates, not the Jinja template in the file. Most chat templates wrap
each message in a fixed header and footer by role (ChatML, Llama 3, Gemma, Phi-3, ...): those are
read off the template's own renderings of probe conversations, and the Go template built from them
is checked by rebuilding, with the same pieces, what the Jinja template renders for other
conversations. A template that does more (a default system prompt, reasoning stripped from history,
a date header) fails that check and gets no ``TEMPLATE`` line, only a comment saying so.
"""

from __future__ import annotations

from typing import Any

ROLES = ("system", "user", "assistant")
# Probe contents: text no template changes, distinct per message.
PROBES = [f"ftcoreprobe{i}x" for i in range(8)]


class NotPerMessage(Exception):
    """The chat template is not a fixed header and footer per message."""


def _between(text: str, before: str | None, after: str | None) -> str:
    start = 0 if before is None else text.index(before) + len(before)
    end = len(text) if after is None else text.index(after, start)
    return text[start:end]


def wrappers(render) -> dict[str, Any]:
    """The pieces of a per-message template: ``begin`` (once, before the first message), ``pre``/``post``
    by role, and ``prompt`` (the generation prompt). ``render(messages, add_generation_prompt)`` renders."""
    u1, a1, u2, s1, u3 = PROBES[:5]
    try:
        one = render([{"role": "user", "content": u1}], False)
        two = render([{"role": "user", "content": u1}, {"role": "assistant", "content": a1}], False)
        three = render([{"role": "user", "content": u1}, {"role": "assistant", "content": a1},
                        {"role": "user", "content": u2}], False)
        prompt_on = render([{"role": "user", "content": u1}], True)
        post_user = _between(one, u1, None)
        post_assistant = _between(two, a1, None)
        between_ua = _between(three, u1, a1)
        between_au = _between(three, a1, u2)
        if not between_ua.startswith(post_user) or not between_au.startswith(post_assistant):
            raise NotPerMessage
        pre_assistant = between_ua[len(post_user):]
        pre_user = between_au[len(post_assistant):]
        head = _between(three, None, u1)
        if not head.endswith(pre_user) or not prompt_on.startswith(one):
            raise NotPerMessage
        pieces = {"begin": head[: len(head) - len(pre_user)], "prompt": prompt_on[len(one):],
                  "pre": {"user": pre_user, "assistant": pre_assistant},
                  "post": {"user": post_user, "assistant": post_assistant}}
    except (ValueError, IndexError) as exc:  # a probe not rendered where expected
        raise NotPerMessage from exc
    try:
        system = render([{"role": "system", "content": s1}, {"role": "user", "content": u3}], False)
    except Exception:  # noqa: BLE001 - a template without a system role refuses one
        return pieces
    try:
        head, between = _between(system, None, s1), _between(system, s1, u3)
    except ValueError as exc:
        raise NotPerMessage from exc
    if not head.startswith(pieces["begin"]) or not between.endswith(pre_user):
        raise NotPerMessage
    pieces["pre"]["system"] = head[len(pieces["begin"]):]
    pieces["post"]["system"] = between[: len(between) - len(pre_user)]
    return pieces


def rebuild(pieces: dict[str, Any], messages: list[dict], add_generation_prompt: bool) -> str:
    """What the Go template built from ``pieces`` renders (its semantics, in Python)."""
    out = pieces["begin"]
    for m in messages:
        out += pieces["pre"][m["role"]] + m["content"] + pieces["post"][m["role"]]
    return out + (pieces["prompt"] if add_generation_prompt else "")


def checked_pieces(render) -> dict[str, Any]:
    """``wrappers``, checked on conversations they were not read from."""
    pieces = wrappers(render)
    p = PROBES
    conversations = [
        [{"role": "user", "content": p[5]}],
        [{"role": "user", "content": p[5]}, {"role": "assistant", "content": p[6]}, {"role": "user", "content": p[7]}],
        [{"role": "user", "content": p[5]}, {"role": "assistant", "content": p[6]},
         {"role": "user", "content": p[7]}, {"role": "assistant", "content": p[4]}, {"role": "user", "content": p[3]}],
    ]
    if "system" in pieces["pre"]:
        conversations += [[{"role": "system", "content": p[2]}, *c] for c in conversations]
    for conversation in conversations:
        for prompt in (False, True):
            if render(conversation, prompt) != rebuild(pieces, conversation, prompt):
                raise NotPerMessage
    return pieces


def go_literal(text: str) -> str:
    return text.replace("{{", '{{ "{{" }}')


def go_template(pieces: dict[str, Any]) -> str:
    branches = []
    for role in ROLES:
        if role in pieces["pre"]:
            branches.append(f'{{{{ {"if" if not branches else "else if"} eq .Role "{role}" }}}}'
                            f'{go_literal(pieces["pre"][role])}{{{{ .Content }}}}{go_literal(pieces["post"][role])}')
    return (go_literal(pieces["begin"]) + "{{ range .Messages }}" + "".join(branches) + "{{ end }}{{ end }}"
            + go_literal(pieces["prompt"]))


def modelfile(file: str, render, stops: list[str], bos_token: str | None = None, adds_bos: bool = False) -> str:
    """The Modelfile's text for GGUF file ``file`` (a path relative to the Modelfile). ``render`` renders a
    conversation with the plan's template; ``stops`` are the end-of-turn tokens; a leading ``bos_token``
    the template writes is left to the runtime where the file says the tokenizer adds one (Ollama and
    llama.cpp add it themselves: written twice, the model would see two)."""
    lines = [f"FROM {file}"]
    try:
        pieces = checked_pieces(render)
    except NotPerMessage:
        lines.append("# The chat template does more than wrap each message in a fixed header and footer, so it")
        lines.append("# has no TEMPLATE here: write Ollama's Go template by hand (docs/export.md, GGUF).")
    else:
        if adds_bos and bos_token and pieces["begin"].startswith(bos_token):
            pieces["begin"] = pieces["begin"][len(bos_token):]
        template = go_template(pieces)
        if '"""' in template:
            lines.append("# The chat template's text holds \"\"\", which a Modelfile cannot quote: no TEMPLATE here.")
        else:
            lines.append(f'TEMPLATE """{template}"""')
    for stop in dict.fromkeys(stops):
        lines.append(f'PARAMETER stop "{stop}"')
    return "\n".join(lines) + "\n"
