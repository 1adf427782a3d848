"""Tool calling on the glaive fixture (ShareGPT with function_call/observation turns and a tools field) with
three families: Qwen3 (its own template, ``native``), Llama 3.1 (the built-in ``llama3.1``) and Hermes 3
(its official tool-use template as a ``jinja`` file). The schemas must reach the prompt, and the labels
must cover the assistant's calls and answers, never a tool result or a user turn."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ftcore.testing import write_jsonl

FIXTURES = Path(__file__).resolve().parents[2] / "shared" / "fixtures"
GLAIVE = FIXTURES / "data" / "glaive_toolcall_en_demo.json"
pytestmark = pytest.mark.skipif(not GLAIVE.is_file(), reason="../shared/fixtures is absent")

FAMILIES = {  # name -> (tokenizer folder, [template] table)
    "qwen3": ("qwen3", {"use": "native"}),
    "llama3.1": ("llama3", {"use": "llama3.1"}),
    "hermes3": ("llama3", {"use": "jinja", "path": str(FIXTURES / "templates" /
                                                       "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja"),
                           "stop_tokens": ["<|im_end|>"], "special_tokens": ["<|im_start|>", "<|im_end|>"]}),
}


def glaive_rows(n: int = 40) -> list[dict]:
    """Internal chat rows (through the data layer's converter) of the first ``n`` glaive rows with tools."""
    from ftcore_plugins.common.formats import convert

    raw = [r for r in json.loads(GLAIVE.read_text(encoding="utf-8")) if r.get("tools") not in (None, "", "[]")]
    return [convert(r)[2] for r in raw[:n]]


def make_template(spec: dict):
    from ftcore.plugins import get_plugin_manager

    cls = get_plugin_manager().registry().resolve("chat template", spec["use"]).cls
    options = {k: v for k, v in spec.items() if k != "use"}
    return cls(cls.Options(**options))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_schemas_reach_the_prompt_and_only_calls_and_answers_are_trained(family):
    transformers = pytest.importorskip("transformers")
    import datasets

    from ftcore_plugins.common.chat import encode, render_with_spans, row_tools, template_messages

    folder, spec = FAMILIES[family]
    tokenizer = transformers.AutoTokenizer.from_pretrained(FIXTURES / "tokenizers" / folder)
    template = make_template(spec)
    rows = glaive_rows()
    cols, stats = encode(datasets.Dataset.from_list(rows), tokenizer, template, max_length=None)
    assert stats.kept == len(rows) and stats.skipped_unrenderable == 0 and stats.label_tokens > 0
    calls = answers = 0
    for row in rows:
        text, spans = render_with_spans(template, row["messages"], tokenizer, row_tools(row))
        for tool in json.loads(row["tools"]):
            assert tool["description"] in text  # the schema is in the prompt

        def trained(a: int, b: int) -> bool:
            inside = [any(i <= k < j for i, j in spans) for k in range(a, b)]
            assert all(inside) or not any(inside), "a message is partly trained"
            return all(inside)

        cursor = 0  # messages render in order: each one is found after the one before
        for m in template_messages(row["messages"]):
            content = (m.get("content") or "").strip()
            if content:
                at = text.find(content, cursor)
                if at < 0:  # Llama 3.1 writes a tool result with tojson
                    content = json.dumps(content, ensure_ascii=False)
                    at = text.find(content, cursor)
                assert at >= 0, (family, m["role"], content[:40])
                assert trained(at, at + len(content)) == (m["role"] == "assistant"), (family, m["role"])
                answers += m["role"] == "assistant"
                cursor = at + len(content)
            for call in m.get("tool_calls") or []:
                at = text.find(call["function"]["name"], cursor)
                assert at >= 0 and trained(at, at + len(call["function"]["name"])), (family, "tool call")
                calls += 1
                cursor = at
    assert calls >= 20 and answers >= 40


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_glaive_trains(family, ftcore_plan, ftcore_run):
    from test_reasoning import real_tokenizer_plan

    folder, template = FAMILIES[family]
    # Rows with tool schemas: Hermes 3's tool-use template cannot render a conversation without them.
    raw = [r for r in json.loads(GLAIVE.read_text(encoding="utf-8")) if r.get("tools") not in (None, "", "[]")]
    write_jsonl(ftcore_plan.dir / "glaive.jsonl", raw[:32])
    plan = real_tokenizer_plan(ftcore_plan, FIXTURES / "tokenizers" / folder, template, "glaive.jsonl",
                               max_steps=4, batch_size=2, max_length=512)
    run = ftcore_run("run", plan, cwd=ftcore_plan.dir).check()
    losses = run.losses("sft")
    assert len(losses) == 4 and losses[4] < losses[1] - 0.3, losses
