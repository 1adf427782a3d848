"""What a third-party plugin author builds on: the public file-source base, the special-token
helper for chat templates, the name-clash rule, EvalContext.name, and the example package
``examples/ftcore-example-data`` (a TSV source and a template with its own end-of-turn token)
installed for real."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from conftest import installed
from test_plugin_manager import add_dist, component_module, ftcore_cli, plugins_json, write_plan

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "ftcore-example-data"
EXAMPLE_DIST = "ftcore-example-data"
QUICKSTART = REPO / "examples" / "quickstart"


@pytest.fixture
def example_modules(monkeypatch):
    """The example package's modules, imported from the source tree (the slow test installs it)."""
    monkeypatch.syspath_prepend(str(EXAMPLE))
    for name in [m for m in sys.modules if m.startswith("ftcore_example_data")]:
        monkeypatch.delitem(sys.modules, name)
    import ftcore_example_data

    return ftcore_example_data


def _quiet_ctx(name: str = "train"):
    from ftcore.context import DataContext
    from ftcore.reporter import Reporter

    return DataContext(None, Reporter(None, None, None, None), name)


def _tsv(tmp_path: Path, body: list[str]) -> Path:
    path = tmp_path / "train.tsv"
    path.write_text("\n".join(["instruction\toutput", *body]) + "\n", encoding="utf-8")
    return path


UNIQUE = [f"Which word is an animal? {w} red tree {i}\tthe {w}" for i, w in
          enumerate(["cat", "dog", "fox", "bird", "horse"] * 8)]  # 40 distinct rows


# -- the public data-source base ------------------------------------------------------------------

def test_tsv_source_gets_dedup_split_limit_and_stats_from_the_base(tmp_path, example_modules):
    src = example_modules.TsvSource
    path = _tsv(tmp_path, UNIQUE + UNIQUE[:6])  # 6 exact duplicates
    options = src.Options.model_validate({"path": str(path), "dedup": "exact", "validation": 10},
                                         context={"base_dir": str(tmp_path)})
    source = src(options)
    parts = source.load(_quiet_ctx())
    assert len(parts["train"]) == 30 and len(parts["validation"]) == 10  # 46 read, 6 dropped, 40 split
    assert source.stats["rows_read"] == 46
    assert source.stats["dropped_duplicate"] == 6
    assert source.stats["rows_kept"] == 40
    assert source.stats["formats"] == {"alpaca": 46}
    train = {r["messages"][0]["content"] for r in parts["train"]}
    validation = {r["messages"][0]["content"] for r in parts["validation"]}
    assert not train & validation
    assert parts["train"][0]["messages"][1]["role"] == "assistant"

    limited = src(src.Options.model_validate({"path": str(path), "limit": 7}, context={"base_dir": str(tmp_path)}))
    assert len(limited.load(_quiet_ctx())) == 7
    assert limited.inputs() == [path.resolve()]


def test_tsv_source_reports_and_skips_bad_lines_at_their_line(tmp_path, example_modules):
    from ftcore.errors import FtcoreError

    src = example_modules.TsvSource
    # line 1 is the header; line 4 has three fields; line 6 has an empty instruction
    path = _tsv(tmp_path, [UNIQUE[0], UNIQUE[1], "a\tb\tc", UNIQUE[2], "\tthe cat"])
    strict = src(src.Options.model_validate({"path": str(path)}, context={"base_dir": str(tmp_path)}))
    with pytest.raises(FtcoreError) as err:
        strict.load(_quiet_ctx())
    assert str(err.value) == (f"data.train: {path}:4: expected 2 tab-separated fields (as in the header: "
                              "instruction, output), got 3")

    lenient = src(src.Options.model_validate({"path": str(path), "on_error": "skip"},
                                             context={"base_dir": str(tmp_path)}))
    rows = lenient.load(_quiet_ctx())
    assert len(rows) == 3
    assert lenient.stats["rows_read"] == 5
    assert lenient.stats["skipped"] == {"bad_tsv_row": 1, "missing_field": 1}, lenient.stats["skipped"]


# -- special tokens for templates ----------------------------------------------------------------

def _tiny_model(tmp_path):
    import datasets

    from ftcore.context import LoadContext
    from ftcore.reporter import Reporter
    from ftcore_plugins.models.scratch import ScratchModelLoader
    from ftcore_plugins.quantizers.none import NoQuantizer

    rows = [{"messages": [{"role": "user", "content": f"Which word is an animal? {w} red tree"},
                          {"role": "assistant", "content": f"the {w}"}]} for w in ("cat", "dog", "fox", "bird")]
    data = {"chat": datasets.Dataset.from_list(rows)}
    loader = ScratchModelLoader(ScratchModelLoader.Options(hidden_size=32, num_layers=1, num_heads=2,
                                                           tokenizer_data=["chat"], vocab_size=300,
                                                           special_tokens=[]))
    run = type("Run", (), {"is_main": True})()
    quiet = Reporter(None, None, None, None)
    model, tok = loader.load(LoadContext(run, quiet, NoQuantizer(), seed=0, work_dir=tmp_path / "model",
                                         data=data.__getitem__))
    return model, tok, rows, quiet


def test_added_end_of_turn_token_is_initialised_apart_and_learned_under_lora(tmp_path, example_modules):
    import torch

    from ftcore.context import AdapterContext
    from ftcore_plugins.adapters.lora import LoraAdapter

    model, tok, rows, quiet = _tiny_model(tmp_path)
    before = len(tok)
    template = example_modules.TurnsTemplate()
    model, tok = template.prepare(model, tok)
    turn, end = tok.convert_tokens_to_ids(["<|turn|>", "<|end|>"])
    assert (turn, end) == (before, before + 1)
    weight = model.get_input_embeddings().weight.detach().clone()
    assert weight.shape[0] == before + 2
    assert not torch.equal(weight[end], weight[tok.pad_token_id])
    assert not torch.allclose(weight[end], weight[turn])
    # drawn like the old rows: as far from their mean as they are, within a factor of 2
    mean = weight[:before].mean(0)
    typical = (weight[:before] - mean).norm(dim=1).mean()
    assert 0.5 * typical < (weight[end] - mean).norm() < 2 * typical
    assert model.config.eos_token_id == [end, tok.eos_token_id]
    assert model.generation_config.eos_token_id[0] == end
    assert tok.chat_template == example_modules.turns.JINJA
    assert tok.apply_chat_template(rows[0]["messages"], tokenize=False) == template.render(rows[0]["messages"])

    # prepare again (a resumed run): nothing added twice
    model, tok = template.prepare(model, tok)
    assert len(tok) == before + 2 and model.get_input_embeddings().weight.shape[0] == before + 2

    run = type("Run", (), {"is_main": True, "plan": type("Plan", (), {"seed": 0})()})()
    lora = LoraAdapter(LoraAdapter.Options(r=4))
    peft_model = lora.apply(model, AdapterContext(run, quiet, None))
    deltas = [n for n, p in peft_model.named_parameters() if p.requires_grad and "trainable_tokens" in n]
    assert deltas, "the added tokens' rows are not trainable under LoRA"

    text = template.render(rows[0]["messages"])
    ids = tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
    assert ids[0, -2].item() == end  # "...<|end|>\n"
    at = ids.shape[1] - 2  # where <|end|> is the next token

    def p_end(m):
        with torch.no_grad():
            return m(input_ids=ids[:, :at]).logits[0, -1].softmax(-1)[end].item()

    start = p_end(peft_model)
    optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(40):
        loss = peft_model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    learned = p_end(peft_model)
    assert start < 0.05 and learned > 0.5, (start, learned)  # it learned to end the turn
    merged = lora.merge(peft_model)
    trained = merged.get_input_embeddings().weight.detach()
    assert not torch.allclose(trained[end], weight[end])  # the new row itself was trained
    assert torch.equal(trained[:before], weight[:before])  # the old rows stayed frozen
    assert p_end(merged) == pytest.approx(learned, abs=1e-4)  # merging keeps the trained row


def test_adapter_that_cannot_train_added_tokens_says_what_to_use(tmp_path, example_modules):
    from ftcore.context import AdapterContext
    from ftcore.errors import FtcoreError
    from ftcore_plugins.adapters.ia3 import Ia3Adapter

    model, tok, _, quiet = _tiny_model(tmp_path)
    model, tok = example_modules.TurnsTemplate().prepare(model, tok)
    run = type("Run", (), {"is_main": True, "plan": type("Plan", (), {"seed": 0})()})()
    with pytest.raises(FtcoreError) as err:
        Ia3Adapter(Ia3Adapter.Options()).apply(model, AdapterContext(run, quiet, None))
    assert str(err.value) == ("adapter 'ia3' cannot train the embeddings of the 2 special token(s) the chat template "
                              "added, so the model would never learn them (nor to stop at the end of a turn); use "
                              "adapter \"lora\" (or a LoRA variant) or \"full\", or a tokenizer that already has the "
                              "template's tokens")


# -- names and descriptions ------------------------------------------------------------------------

def test_description_is_the_docstring_first_paragraph():
    from ftcore.registry import Registration

    class Wrapped:
        """A summary that is wrapped
        over two lines.

        Details that are not shown."""

    reg = Registration("evaluator", "w", Wrapped, "p", "d", "1")
    assert reg.description == "A summary that is wrapped over two lines."
    listing = plugins_json(REPO)
    csv = next(c for c in listing["components"]["data source"] if c["name"] == "csv")
    assert csv["description"] == "CSV files with a header row, any row format."


@pytest.mark.slow
def test_third_party_component_with_a_builtin_name_does_not_break_plans(tmp_path):
    site = tmp_path / "site"
    add_dist(site, "other-dist", {"other_mod": component_module("register_trainers", "Other", "sft", "train")},
             {"other": "other_mod"})

    listing = plugins_json(tmp_path, site)
    conflicts = [c for c in listing["conflicts"] if "'sft'" in c]
    expected = ("plugin 'other' (other-dist 1.0) also registers the trainer 'sft'; the bare name 'sft' means the "
                "built-in (ftcore:sft); to use the plugin's, write 'other-dist:sft'")
    assert conflicts == [expected]

    bare = write_plan(tmp_path, trainer="sft", run_name="bare")
    r = ftcore_cli("validate", str(bare), cwd=tmp_path, site=site)
    assert r.returncode == 0, r.stderr
    assert r.stderr.count(f"warning: {expected}") == 1, r.stderr

    qualified = write_plan(tmp_path, trainer="other-dist:sft", run_name="qualified")
    r = ftcore_cli("validate", str(qualified), cwd=tmp_path, site=site)
    assert r.returncode == 0, r.stderr
    assert "also registers" not in r.stderr


@pytest.mark.slow
def test_evaluator_sees_its_evaluation_name_and_its_failure_names_it(tmp_path):
    site = tmp_path / "site"
    body = "raise ValueError(f'ctx.name is {ctx.name}')"
    add_dist(site, "crash-dist", {"crash_mod": component_module("register_evaluators", "Crash", "crash", "evaluate",
                                                                body)}, {"crash": "crash_mod"})
    plan = write_plan(tmp_path, evaluate='[[evaluate]]\nname = "boom"\nuse = "crash"\n', run_name="crash")
    r = ftcore_cli("run", str(plan), cwd=tmp_path, site=site)
    assert r.returncode == 1, r.stdout + r.stderr
    assert ("error: evaluator 'crash' from plugin 'crash' (crash-dist 1.0) failed in evaluate() "
            "[evaluation 'boom', evaluate[0]]: ValueError: ctx.name is boom") in r.stderr


@pytest.mark.slow
def test_evaluator_failure_keeps_the_trained_stage_and_resume_reruns_only_the_evaluation(tmp_path):
    site = tmp_path / "site"
    body = ("import os\n        if os.environ.get('CRASH'): raise RuntimeError('scorer offline')\n"
            "        return {'score': 1.0}")
    add_dist(site, "flaky-dist", {"flaky_mod": component_module("register_evaluators", "Flaky", "flaky", "evaluate",
                                                                body)}, {"flaky": "flaky_mod"})
    plan = write_plan(tmp_path, evaluate='[[evaluate]]\nname = "judge"\nuse = "flaky"\nwhen = "after"\n',
                      run_name="flaky")
    r = ftcore_cli("run", str(plan), cwd=tmp_path, site=site, env={"CRASH": "1"})
    assert r.returncode == 1, r.stdout + r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: evaluator 'flaky' from plugin 'flaky' (flaky-dist 1.0) failed in evaluate() "
                      "[evaluation 'judge', evaluate[0]]: RuntimeError: scorer offline (run with --debug for the "
                      "traceback)"]
    run = tmp_path / "runs" / "flaky"
    marker = run / "stages" / "sft" / "COMPLETE.json"
    assert marker.exists() and (run / "stages" / "sft" / "output").is_dir()
    trained = marker.read_bytes()

    r = ftcore_cli("run", str(plan), "--resume", cwd=tmp_path, site=site)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "stage sft is complete: restored its output" in r.stdout
    assert "train sft" not in r.stdout and marker.read_bytes() == trained  # not trained again
    assert json.loads((run / "evaluations" / "after.json").read_text())["judge"] == {"score": 1.0}
    assert json.loads((run / "manifest.json").read_text())["status"] == "complete"


# -- the example package, installed --------------------------------------------------------------

@pytest.mark.slow
def test_example_package_template_learns_to_end_its_turns_with_its_new_token(tmp_path):
    """The quickstart task through the example package: TSV rows, and the `turns` template whose end-of-turn
    token <|end|> is new to the tokenizer. Under LoRA the new rows must be learned, or generation would run
    past the answer: every answer must be exactly "the <animal>", generation stopping right after it (SFT
    labels end every answer with <|end|>, never with the tokenizer's EOS).
    Whether the task itself is learned (the right animal) is not asserted here: at one seed it is luck, for
    either template. The comparison with chatml over 8 seeds is benchmarks/template_parity.py (RESULTS.md:
    mean exact match within 0.05 of chatml's); its tiny mode is in test_benchmarks.py.
    The plan is the example's with fewer steps than its 3 + 10 epochs (1,940 steps, 5 minutes on a busy 2-core
    machine): 60 of pre-training, 150 of LoRA SFT. Ending the turn is learned well before that: after 50
    pre-training steps, 69 of the 100 answers stopped after 40 LoRA steps, all of them after 60 (seed 42; at
    seed 7 all after 100, at seed 3 all after these 150)."""
    text = (EXAMPLE / "plan.toml").read_text().replace('"../quickstart/', f'"{QUICKSTART.as_posix()}/')
    text = text.replace('"data/train.tsv"', f'"{(EXAMPLE / "data" / "train.tsv").as_posix()}"')
    for epochs, steps in (("epochs = 3", "max_steps = 60"), ("epochs = 10", "max_steps = 150")):
        text, n = re.subn(f"^{epochs}$", steps, text, flags=re.M)
        assert n == 1, epochs
    plan = tmp_path / "turns.toml"
    plan.write_text(text)

    with installed(EXAMPLE, EXAMPLE_DIST, tmp_path):
        listing = plugins_json(tmp_path)
        assert [c["qualified"] for c in listing["components"]["data source"] if c["name"] == "tsv"] == \
            [f"{EXAMPLE_DIST}:tsv"]
        assert [c["qualified"] for c in listing["components"]["chat template"] if c["name"] == "turns"] == \
            [f"{EXAMPLE_DIST}:turns"]
        r = ftcore_cli("run", str(plan), cwd=tmp_path, timeout=3600)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]

    run = tmp_path / "runs" / "example-data"
    answers = [json.loads(line) for line in
               (run / "evaluations" / "after" / "answers" / "predictions.jsonl").read_text().splitlines()]
    stopped = sum(bool(re.fullmatch(r"the [a-z]+", a["prediction"])) for a in answers)
    exact = json.loads((run / "evaluations" / "after.json").read_text())["answers"]["exact_match"]
    print(f"answers that stop right after the answer: {stopped}/{len(answers)}; exact match {exact:.2f}")
    assert stopped == len(answers) == 100
    report = json.loads((tmp_path / "runs" / "example-data" / "data_report.json").read_text())
    assert "source/train" in json.dumps(report)  # the TSV source's stats reach the data report
