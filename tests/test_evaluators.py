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
    from ftcore_plugins.models.scratch import ScratchModelLoader
    from ftcore_plugins.quantizers.none import NoQuantizer
    from ftcore_plugins.templates.chatml import ChatMLTemplate

    data = {"text": datasets.Dataset.from_list(text_rows(32)), "chat": datasets.Dataset.from_list(chat_rows(32))}
    loader = ScratchModelLoader(ScratchModelLoader.Options(hidden_size=32, num_layers=1, num_heads=2,
                                                           tokenizer_data=["text", "chat"], vocab_size=300))
    ctx = LoadContext(run=type("R", (), {"is_main": True})(), reporter=quiet_reporter(), quantizer=NoQuantizer(),
                      seed=0, work_dir=tmp_path_factory.mktemp("model"), data=data.__getitem__)
    model, tokenizer = loader.load(ctx)
    template = ChatMLTemplate()
    model, tokenizer = template.prepare(model, tokenizer)
    return model, tokenizer, template


def evaluate(model, tokenizer, template, rows, batch_size, **options):
    import datasets

    from ftcore.context import EvalContext
    from ftcore_plugins.evaluators.perplexity import Perplexity

    ev = Perplexity(Perplexity.Options(batch_size=batch_size, **options))
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
    assert got["perplexity"] == pytest.approx(math.exp(total / count), rel=1e-6)
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
    assert one_batch["perplexity"] == pytest.approx(math.exp(total / count), rel=1e-6)
    assert one_by_one["perplexity"] == pytest.approx(one_batch["perplexity"], rel=1e-6)


def test_perplexity_by_part_and_length_bucket_match_a_hand_loop(tiny_model):
    """Prompt tokens (everything not trained on) and response tokens, and rows grouped by token
    length, each summed independently one row at a time."""
    model, tokenizer, template = tiny_model
    rows = chat_rows(10, seed=5)
    rows[2]["messages"][0]["content"] += " and some more words to make this prompt longer than the rest"
    rows[3]["messages"][-1]["content"] = "the fox the cat the dog"
    sums = {}  # group -> [nll, tokens]
    lengths = []
    with torch.no_grad():
        for row in rows:
            full = tokenizer(template.render(row["messages"], tokenizer, add_generation_prompt=False),
                             add_special_tokens=False)["input_ids"]
            p_ids = tokenizer(template.render(row["messages"][:-1], tokenizer, add_generation_prompt=True),
                              add_special_tokens=False)["input_ids"]
            a_ids = tokenizer(row["messages"][-1]["content"] + "<|im_end|>", add_special_tokens=False)["input_ids"]
            assert full[:len(p_ids) + len(a_ids)] == p_ids + a_ids  # the spans below are the right tokens
            logp = torch.log_softmax(model(torch.tensor([full])).logits[0].float(), -1)
            bucket = "length_1-40/" if len(full) <= 40 else "length_41+/"
            lengths.append(len(full))
            for t in range(1, len(full)):
                part = "response/" if len(p_ids) <= t < len(p_ids) + len(a_ids) else "prompt/"
                for group in ((part, bucket + part) if part == "response/" else (part,)):
                    entry = sums.setdefault(group, [0.0, 0])
                    entry[0] -= logp[t - 1, full[t]].item()
                    entry[1] += 1
    assert min(lengths) <= 40 < max(lengths)  # both buckets hold rows
    got = evaluate(model, tokenizer, template, rows, batch_size=4, by_part=True, length_buckets=[40])
    for group in ("response/", "prompt/"):
        nll, tokens = sums[group]
        assert got[f"{group}tokens"] == tokens
        assert got[f"{group}perplexity"] == pytest.approx(math.exp(nll / tokens), rel=1e-6)
    assert got["perplexity"] == got["response/perplexity"]
    for bucket in ("length_1-40/", "length_41+/"):
        nll, tokens = sums[bucket + "response/"]
        assert got[f"{bucket}tokens"] == tokens
        assert got[f"{bucket}perplexity"] == pytest.approx(math.exp(nll / tokens), rel=1e-6)
    assert got["length_1-40/rows"] + got["length_41+/rows"] == len(rows)


PHASED = """
[data.text_eval]
use = "jsonl"
path = "text.jsonl"
limit = 16

[[stage]]
name = "pretrain"
trainer = "pretrain"
data = "text"
adapter = "full"
max_steps = 8
batch_size = 8
max_length = 64
learning_rate = 3e-3

[[stage]]
name = "sft"
trainer = "sft"
data = "chat"
adapter = "full"
max_steps = 12
batch_size = 8
max_length = 64
learning_rate = 1e-2

[[evaluate]]
name = "ppl"
use = "perplexity"
data = "chat_eval"
when = ["before", "pretrain", "after"]

[[evaluate]]
name = "replay"
use = "forgetting"
data = "text_eval"
baseline = "pretrain"
when = ["pretrain", "after"]

[[evaluate]]
name = "replay_lenient"
use = "forgetting"
data = "text_eval"
baseline = "pretrain"
threshold = 1000.0
when = "after"

[[evaluate]]
name = "vs_pretrain"
use = "compare"
evaluation = "ppl"
baseline = "pretrain"
when = "after"
"""


@pytest.mark.slow
def test_phases_compare_and_forgetting_in_a_real_run(tiny_project):
    """Evaluations right after a stage; ``compare`` rebuilds the pre-trained model from the run's files
    and gets the very number measured right after that stage; ``forgetting`` flags the rise of text
    perplexity that full fine-tuning on chat causes, and not with a lenient threshold."""
    import json

    from conftest import run_cli

    plan = tiny_project(PHASED)
    result = run_cli("run", str(plan))
    assert result.returncode == 0, result.stdout + result.stderr
    run = plan.parent / "runs" / "tiny"
    phase = {p: json.loads((run / "evaluations" / f"{p}.json").read_text()) for p in ("before", "pretrain", "after")}
    assert set(phase["before"]) == {"ppl"}
    assert set(phase["pretrain"]) == {"ppl", "replay"}
    assert set(phase["after"]) == {"ppl", "replay", "replay_lenient", "vs_pretrain"}

    compared = phase["after"]["vs_pretrain"]
    assert compared["perplexity"] == pytest.approx(phase["after"]["ppl"]["perplexity"], rel=1e-6)
    assert compared["perplexity/baseline"] == pytest.approx(phase["pretrain"]["ppl"]["perplexity"], rel=1e-6)
    assert compared["perplexity/delta"] == pytest.approx(compared["perplexity"] - compared["perplexity/baseline"])
    assert compared["perplexity"] < compared["perplexity/baseline"]  # SFT helps on its own task

    replay = phase["after"]["replay"]
    assert replay["baseline_perplexity"] == phase["pretrain"]["replay"]["perplexity"]
    assert replay["increase"] == pytest.approx(replay["perplexity"] / replay["baseline_perplexity"] - 1)
    assert replay["increase"] > 0.05 and replay["forgetting"] is True
    assert "forgetting: perplexity on this data rose" in result.stderr  # a warning: on stderr
    lenient = phase["after"]["replay_lenient"]  # no stored baseline phase: it rebuilt the model and measured
    assert lenient["baseline_perplexity"] == pytest.approx(replay["baseline_perplexity"], rel=1e-6)
    assert lenient["forgetting"] is False

    summary = json.loads((run / "summary.json").read_text())
    assert list(summary["evaluations"]) == ["before", "pretrain", "after"]
    again = run_cli("run", str(plan), "--resume")
    assert again.returncode == 0 and "nothing left to do" in again.stdout


def test_compare_and_forgetting_refuse_a_baseline_that_is_not_ready(tiny_project):
    from conftest import run_cli

    body = PHASED.replace('threshold = 1000.0\nwhen = "after"', 'threshold = 1000.0\nwhen = "before"') \
                 .replace('evaluation = "ppl"', 'evaluation = "nope"')
    result = run_cli("validate", str(tiny_project(body)))
    assert result.returncode == 2
    assert "evaluate[3].evaluation: no [[evaluate]] named 'nope'" in result.stderr
    assert "evaluate[2].baseline: stage 'pretrain' has not finished in phase 'before'" in result.stderr


def preference_rows(n: int) -> list[dict]:
    rows = []
    for row in chat_rows(n, seed=11):
        user, answer = row["messages"]
        rows.append({"prompt": [user], "chosen": [answer],
                     "rejected": [{"role": "assistant", "content": answer["content"].replace("the ", "a red ")}]})
    return rows


def answer_logp(model, tokenizer, template, prompt, answer) -> float:
    """log p(answer | prompt), one pair at a time, from the rendered conversation."""
    text = template.render(prompt, tokenizer, add_generation_prompt=True)
    full = template.render(prompt + answer, tokenizer, add_generation_prompt=False).rstrip("\n ")
    p_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    ids = tokenizer(full, add_special_tokens=False)["input_ids"]
    assert ids[:len(p_ids)] == p_ids
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    return sum(logp[t - 1, ids[t]].item() for t in range(len(p_ids), len(ids)))


def run_preference(tiny_model, rows, *, load_model=None, outputs=None, **options):
    import datasets

    from ftcore.context import EvalContext
    from ftcore_plugins.evaluators.preference import Preference

    model, tokenizer, template = tiny_model
    ev = Preference(Preference.Options(batch_size=3, **options))
    ctx = EvalContext(None, quiet_reporter(), "after", model, tokenizer, template,
                      datasets.Dataset.from_list(rows), None, load_model=load_model, outputs=outputs or {})
    return ev.evaluate(ctx)


def test_preference_accuracy_and_margin_by_log_prob_and_implicit_reward(tiny_model):
    import copy

    model, tokenizer, template = tiny_model
    rows = preference_rows(9)
    chosen = [answer_logp(model, tokenizer, template, r["prompt"], r["chosen"]) for r in rows]
    rejected = [answer_logp(model, tokenizer, template, r["prompt"], r["rejected"]) for r in rows]
    got = run_preference(tiny_model, rows)
    assert got["pairs"] == 9
    assert got["accuracy"] == pytest.approx(sum(c > r for c, r in zip(chosen, rejected)) / 9)
    assert got["margin"] == pytest.approx(sum(c - r for c, r in zip(chosen, rejected)) / 9, rel=1e-5)

    reference = copy.deepcopy(model)
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.05 * torch.randn_like(p))
    ref_c = [answer_logp(reference, tokenizer, template, r["prompt"], r["chosen"]) for r in rows]
    ref_r = [answer_logp(reference, tokenizer, template, r["prompt"], r["rejected"]) for r in rows]
    rewards = [(0.5 * (c - rc), 0.5 * (r - rr)) for c, rc, r, rr in zip(chosen, ref_c, rejected, ref_r)]
    got = run_preference(tiny_model, rows, reference="base", beta=0.5,
                         load_model=lambda which: (reference, tokenizer))
    assert got["accuracy"] == pytest.approx(sum(c > r for c, r in rewards) / 9)
    assert got["margin"] == pytest.approx(sum(c - r for c, r in rewards) / 9, rel=1e-4, abs=1e-6)


def test_preference_by_reward_model(tiny_model, tmp_path):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    model, tokenizer, template = tiny_model
    torch.manual_seed(0)
    rm = LlamaForSequenceClassification(LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1,
                                                    num_attention_heads=2, intermediate_size=64, num_labels=1,
                                                    pad_token_id=tokenizer.pad_token_id))
    rm.save_pretrained(tmp_path / "rm")
    tokenizer.save_pretrained(tmp_path / "rm")
    rows = preference_rows(7)

    def score(prompt, answer):
        text = template.render(prompt, tokenizer, add_generation_prompt=True)
        full = template.render(prompt + answer, tokenizer, add_generation_prompt=False).rstrip("\n ")
        with torch.no_grad():
            return rm(**tokenizer(full, return_tensors="pt", add_special_tokens=False)).logits[0, 0].item() \
                if full.startswith(text) else None

    pairs = [(score(r["prompt"], r["chosen"]), score(r["prompt"], r["rejected"])) for r in rows]
    got = run_preference(tiny_model, rows, method="reward_model", reward_model="rm", outputs={"rm": tmp_path / "rm"})
    assert got["pairs"] == 7
    assert got["accuracy"] == pytest.approx(sum(c > r for c, r in pairs) / 7)
    assert got["margin"] == pytest.approx(sum(c - r for c, r in pairs) / 7, rel=1e-4, abs=1e-6)
