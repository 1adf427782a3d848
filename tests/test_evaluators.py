"""Perplexity is token-weighted and equals an independent, hand-written computation."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from conftest import chat_rows, text_rows  # noqa: E402


def quiet_reporter():
    from ftcore.reporter import Reporter

    return Reporter(None, None, None, None)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    import datasets

    from ftcore.context import LoadContext
    from ftcore_plugins.model_scratch import ScratchModelLoader
    from ftcore_plugins.quantizer_none import NoQuantizer
    from ftcore_plugins.template_chatml import ChatMLTemplate

    data = {"text": datasets.Dataset.from_list(text_rows(32)), "chat": datasets.Dataset.from_list(chat_rows(32))}
    loader = ScratchModelLoader(ScratchModelLoader.Options(hidden_size=32, num_layers=1, num_heads=2,
                                                           tokenizer_data=["text", "chat"], vocab_size=300))
    ctx = LoadContext(run=type("R", (), {"is_main": True})(), reporter=quiet_reporter(), quantizer=NoQuantizer(),
                      seed=0, work_dir=tmp_path_factory.mktemp("model"), data=data.__getitem__)
    model, tokenizer = loader.load(ctx)
    template = ChatMLTemplate()
    model, tokenizer = template.prepare(model, tokenizer)
    return model, tokenizer, template


def evaluate(model, tokenizer, template, rows, batch_size):
    import datasets

    from ftcore.context import EvalContext
    from ftcore_plugins.eval_perplexity import Perplexity

    ev = Perplexity(Perplexity.Options(batch_size=batch_size))
    ctx = EvalContext(None, quiet_reporter(), "after", model, tokenizer, template,
                      datasets.Dataset.from_list(rows), None)
    return ev.evaluate(ctx)


def reference_chat_nll(model, tokenizer, template, rows):
    """One sample at a time, no padding: NLL of the final assistant turn's tokens."""
    total, count, per_sample = 0.0, 0, []
    with torch.no_grad():
        for row in rows:
            prompt = template.render(row["messages"][:-1], tokenizer, add_generation_prompt=True)
            answer = row["messages"][-1]["content"] + "<|im_end|>"
            p_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
            a_ids = tokenizer(answer, add_special_tokens=False)["input_ids"]
            ids = torch.tensor([p_ids + a_ids])
            logp = torch.log_softmax(model(ids).logits[0].float(), -1)
            nll = -sum(logp[len(p_ids) + j - 1, t].item() for j, t in enumerate(a_ids))
            total += nll
            count += len(a_ids)
            per_sample.append((nll, len(a_ids)))
    return total, count, per_sample


def test_chat_perplexity_matches_hand_written_loop(tiny_model):
    model, tokenizer, template = tiny_model
    rows = chat_rows(12, seed=3)
    # Answers of different lengths, so token weighting differs from a mean over samples.
    rows[0]["messages"][-1]["content"] = "the cat the dog the bird the fox"
    rows[1]["messages"][-1]["content"] = "fox"
    got = evaluate(model, tokenizer, template, rows, batch_size=5)
    total, count, per_sample = reference_chat_nll(model, tokenizer, template, rows)
    assert got["tokens"] == count
    assert got["perplexity"] == pytest.approx(math.exp(total / count), rel=1e-5)
    mean_of_ppl = sum(math.exp(n / c) for n, c in per_sample) / len(per_sample)
    assert abs(mean_of_ppl - got["perplexity"]) > 1e-3  # the naive average is a different number


def test_text_perplexity_scores_every_token_and_ignores_padding(tiny_model):
    model, tokenizer, template = tiny_model
    rows = [{"text": "the red cat sees the blue dog."}, {"text": "the fox."},
            {"text": "the stone runs. the tree sees the bird. the cat."}]
    one_batch = evaluate(model, tokenizer, template, rows, batch_size=3)
    one_by_one = evaluate(model, tokenizer, template, rows, batch_size=1)
    total, count = 0.0, 0
    with torch.no_grad():
        for row in rows:
            ids = tokenizer(row["text"] + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
            total -= sum(logp[i - 1, ids[i]].item() for i in range(1, len(ids)))
            count += len(ids) - 1
    assert one_batch["tokens"] == one_by_one["tokens"] == count
    assert one_batch["perplexity"] == pytest.approx(math.exp(total / count), rel=1e-5)
    assert one_by_one["perplexity"] == pytest.approx(one_batch["perplexity"], rel=1e-5)
