"""A third-party plugin implementing every hook, registered the way entry points are,
drives a whole run: each kind of component is swapped for its own, and the lifecycle
hooks fire in order."""

from __future__ import annotations

import json

import pytest

import ftcore
from ftcore.component import Component, Options
from ftcore.types import RewardRef, StageRef

torch = pytest.importorskip("torch")

from conftest import chat_rows  # noqa: E402


class InlineChat(Component):
    """Generated chat rows, no file."""

    name = "inline-chat"

    class Options(Options):
        rows: int = 32
        seed: int = 0

    def load(self, ctx):
        import datasets

        return datasets.Dataset.from_list(chat_rows(self.options.rows, seed=self.options.seed))


class PlainTemplate(Component):
    """'User: ...' / 'Assistant: ...' turns."""

    name = "plain"
    stop_tokens = ()

    def render(self, messages, tokenizer=None, add_generation_prompt=False):
        eos = tokenizer.eos_token if tokenizer is not None else ""
        text = "".join(f"{m['role'].title()}: {m['content']}{eos if m['role'] == 'assistant' else ''}\n"
                       for m in messages)
        return text + ("Assistant: " if add_generation_prompt else "")


class TinyLoader(Component):
    """The scratch loader, with fixed tiny sizes."""

    name = "tiny"

    def load(self, ctx):
        from ftcore_plugins.models.scratch import ScratchModelLoader

        inner = ScratchModelLoader(ScratchModelLoader.Options(hidden_size=32, num_layers=1, num_heads=2,
                                                              tokenizer_data=["train"], vocab_size=300))
        return inner.load(ctx)


class MarkingQuantizer(Component):
    """Marks the model, to show the quantizer was consulted."""

    name = "marking"

    def load_kwargs(self):
        return {}

    def prepare(self, model):
        model.config.marked_by_quantizer = True
        return model


class HeadOnly(Component):
    """Trains only the output head (a freeze-style method)."""

    name = "head-only"
    peft = False

    def apply(self, model, ctx):
        for name, p in model.named_parameters():
            p.requires_grad_("lm_head" in name or "embed_tokens" in name)
        return model

    def save(self, model, path):
        model.save_pretrained(path)

    def restore(self, base, path, ctx):
        return type(base).from_pretrained(path)

    def merge(self, model):
        return model


class LoopTrainer(Component):
    """A hand-written AdamW loop on assistant tokens."""

    name = "loop"

    class Options(Options):
        steps: int = 30

    def train(self, ctx):
        from ftcore_plugins.common.chat import encode

        cols, _ = encode(ctx.train_data, ctx.tokenizer, ctx.template, max_length=64)
        params = [p for p in ctx.model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-2)
        losses = []
        for step in range(self.options.steps):
            i = step % len(cols["input_ids"])
            out = ctx.model(input_ids=torch.tensor([cols["input_ids"][i]]),
                            labels=torch.tensor([cols["labels"][i]]))
            out.loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(out.loss.item())
            ctx.reporter.log(ctx.stage, {"loss": out.loss.item()}, step=step + 1)
        return {"first_loss": sum(losses[:5]) / 5, "last_loss": sum(losses[-5:]) / 5}


class ProbeTrainer(Component):
    """Trains a separate model (trains_policy = False): a linear probe on the policy's frozen
    hidden states that scores completions, saved to the stage's output."""

    name = "probe"
    trains_policy = False

    class Options(Options):
        after: StageRef  # the stage whose output it reads
        reward: RewardRef

    seen: dict = {}

    def train(self, ctx):
        from safetensors.torch import save_file

        ProbeTrainer.seen = {"model": ctx.model, "adapter": ctx.adapter, "outputs": dict(ctx.outputs),
                             "continues": ctx.continues_adapter,
                             "policy_state": {k: v.clone() for k, v in ctx.model.state_dict().items()}}
        scores = ctx.rewards[self.options.reward].score(["q"] * 2, ["ab", "abcd"])
        probe = torch.nn.Linear(ctx.model.config.hidden_size, 1)
        ids = torch.tensor([[1, 2, 3]])
        with torch.no_grad():
            hidden = ctx.model(input_ids=ids, output_hidden_states=True).hidden_states[-1][:, -1]
        save_file({"weight": probe.weight.detach(), "bias": probe.bias.detach()},
                  _mkdir(ctx.output) / "probe.safetensors")
        return {"probe_score": probe(hidden).item(), "reward_short": scores[0], "reward_long": scores[1],
                "saw_output": (self_output := ctx.outputs[self.options.after]).is_dir() and
                any(self_output.iterdir())}


def _mkdir(path):
    path.mkdir(parents=True, exist_ok=True)
    return path


class LengthReward(Component):
    """Minus the completion's length: shorter is better."""

    name = "length"

    def score(self, prompts, completions):
        return [-float(len(c)) for c in completions]


class ListTracker(Component):
    """Keeps what it sees; a plan picks it with track = ["list"]."""

    name = "list"
    seen: list = []

    class Options(Options):
        prefix: str = ""

    @ftcore.hookimpl
    def ftcore_log(self, run, stage, step, metrics):
        ListTracker.seen.append((self.options.prefix + stage, step, dict(metrics)))

    @ftcore.hookimpl
    def ftcore_run_end(self, run, error):
        ListTracker.seen.append(("end", None, {"error": error}))


class RowCount(Component):
    """Counts evaluation rows."""

    name = "row-count"

    def evaluate(self, ctx):
        return {"rows": len(ctx.data)}


class StateDictExporter(Component):
    """The raw state dict as one safetensors file."""

    name = "state-dict"

    def export(self, ctx):
        from safetensors.torch import save_file

        ctx.path.mkdir(parents=True, exist_ok=True)
        target = ctx.path / "weights.safetensors"
        save_file({k: v.contiguous() for k, v in ctx.model.state_dict().items() if "lm_head" not in k}, target)
        return target


class EverythingPlugin:
    def __init__(self):
        self.calls: list[tuple] = []

    @ftcore.hookimpl
    def register_model_loaders(self, register):
        register(TinyLoader)

    @ftcore.hookimpl
    def register_data_sources(self, register):
        register(InlineChat)

    @ftcore.hookimpl
    def register_chat_templates(self, register):
        register(PlainTemplate)

    @ftcore.hookimpl
    def register_adapters(self, register):
        register(HeadOnly)

    @ftcore.hookimpl
    def register_quantizers(self, register):
        register(MarkingQuantizer)

    @ftcore.hookimpl
    def register_trainers(self, register):
        register(LoopTrainer)
        register(ProbeTrainer)

    @ftcore.hookimpl
    def register_evaluators(self, register):
        register(RowCount)

    @ftcore.hookimpl
    def register_reward_functions(self, register):
        register(LengthReward)

    @ftcore.hookimpl
    def register_trackers(self, register):
        register(ListTracker)

    @ftcore.hookimpl
    def register_exporters(self, register):
        register(StateDictExporter)

    @ftcore.hookimpl
    def ftcore_run_start(self, run):
        self.calls.append(("run_start", run.run_dir.name))

    @ftcore.hookimpl
    def ftcore_stage_start(self, run, stage):
        self.calls.append(("stage_start", stage))

    @ftcore.hookimpl
    def ftcore_stage_end(self, run, stage, metrics, seconds):
        assert seconds >= 0
        self.calls.append(("stage_end", stage))

    @ftcore.hookimpl
    def ftcore_log(self, run, stage, step, metrics):
        self.calls.append(("log", stage, step))

    @ftcore.hookimpl
    def ftcore_run_end(self, run, error):
        self.calls.append(("run_end", error))


class BrokenTracker:
    @ftcore.hookimpl
    def ftcore_log(self, run, stage, step, metrics):
        raise ConnectionError("tracker unreachable")


PLAN = """
[run]
name = "hooks"

[model]
use = "tiny"

[quantizer]
use = "marking"

[template]
use = "plain"

[data.train]
use = "inline-chat"

[data.held_out]
use = "inline-chat"
rows = 5
seed = 9

[reward.short]
use = "length"

[track.list]
prefix = "seen:"

[[stage]]
name = "head"
trainer = "loop"
data = "train"
adapter = "head-only"

[[stage]]
name = "probe"
trainer = "probe"
data = "train"
adapter = "head-only"
after = "head"
reward = "short"

[[stage]]
name = "more"
trainer = "loop"
data = "train"
adapter = "head-only"
steps = 5

[[evaluate]]
use = "row-count"
data = "held_out"

[[export]]
use = "state-dict"
"""


def test_a_plugin_can_replace_every_kind_and_observe_the_run(tmp_path, capsys):
    from rich.console import Console
    from safetensors.torch import load_file

    from ftcore.plan import load_plan
    from ftcore.plugins import PluginInfo, get_plugin_manager
    from ftcore.runner import Runner

    pm = get_plugin_manager(entry_points=False)
    plugin = EverythingPlugin()
    pm.add_plugin(plugin, PluginInfo("everything", "everything-dist", "1.0", "entry point"))
    pm.add_plugin(BrokenTracker(), PluginInfo("broken-tracker", "tracker-dist", "0.1", "entry point"))
    pm.check_pending()
    assert not pm.registry().problems

    plan_path = tmp_path / "plan.toml"
    plan_path.write_text(PLAN)
    plan = load_plan(plan_path, pm.registry())
    assert plan.stages[0].trainer.reg.dist == "everything-dist"
    summary = Runner(plan, pm, Console(file=open(tmp_path / "out.txt", "w"))).run()

    stages = [c[1] for c in plugin.calls if c[0] == "stage_start"]
    assert stages == ["load", "evaluate:before", "head", "probe", "more", "evaluate:after", "export:state-dict"]
    assert plugin.calls[0] == ("run_start", "hooks") and plugin.calls[-1] == ("run_end", None)
    assert [c[1] for c in plugin.calls if c[0] == "stage_end"] == stages
    assert sum(1 for c in plugin.calls if c[0] == "log" and c[1] == "head") == 30

    metrics = summary["stages"]["head"]
    assert metrics["last_loss"] < metrics["first_loss"]  # the custom trainer really trained
    assert summary["evaluations"]["after"]["row-count"] == {"rows": 5}
    weights = load_file(summary["exports"]["state-dict"])
    assert any("embed_tokens" in k for k in weights)

    # The broken tracker is reported once, by name, and the run still completed.
    err = capsys.readouterr().err  # warnings are on stderr, the run's own output in out.txt
    assert err.count("plugin 'broken-tracker' (tracker-dist 0.1) failed in ftcore_log") == 1
    assert "failed in ftcore_log" not in (tmp_path / "out.txt").read_text()
    assert json.loads((tmp_path / "runs" / "hooks" / "manifest.json").read_text())["status"] == "complete"

    # The tracker the plan picked saw the same records as metrics.jsonl, with its option applied,
    # and was unregistered when the run ended.
    logged = [json.loads(line) for line in (tmp_path / "runs" / "hooks" / "metrics.jsonl").read_text().splitlines()]
    assert [(t[0], t[1]) for t in ListTracker.seen[:-1]] == [("seen:" + r["stage"], r.get("step")) for r in logged]
    assert ListTracker.seen[-1] == ("end", None, {"error": None})
    assert not [n for n, _ in pm.list_name_plugin() if n.startswith("tracker:")]

    # The side stage got the policy untouched and its adapter unapplied, the reward function, and
    # the earlier stage's output; the next stage continued the head stage's adapter on the same policy.
    seen = ProbeTrainer.seen
    assert seen["adapter"].name == "head-only" and seen["continues"] is False
    assert list(seen["outputs"]) == ["head"]
    probe = summary["stages"]["probe"]
    assert probe["reward_short"] == -2.0 and probe["reward_long"] == -4.0 and probe["saw_output"]
    run = tmp_path / "runs" / "hooks"
    assert (run / "stages" / "probe" / "output" / "probe.safetensors").is_file()
    assert json.loads((run / "stages" / "more" / "COMPLETE.json").read_text())["adapter_from"] == 0
    head = load_file(run / "stages" / "head" / "output" / "model.safetensors")
    for k, v in seen["policy_state"].items():  # the probe saw the head stage's trained policy
        if k in head:
            assert torch.equal(v, head[k]), k

    # --resume after the last stage's marker is gone: the policy is rebuilt through the side
    # stage (from the head stage's output) and only "more" trains again.
    (run / "stages" / "more" / "COMPLETE.json").unlink()
    ProbeTrainer.seen = {}
    plugin.calls.clear()
    Runner(plan, pm, Console(file=open(tmp_path / "out2.txt", "w")), resume=True).run()
    assert ProbeTrainer.seen == {}
    assert [c[1] for c in plugin.calls if c[0] == "stage_start"] == ["load", "more", "evaluate:after",
                                                                       "export:state-dict"]


def test_references_to_stages_and_rewards_are_checked(tmp_path):
    from ftcore.errors import PlanError
    from ftcore.plan import load_plan
    from ftcore.plugins import PluginInfo, get_plugin_manager

    pm = get_plugin_manager(entry_points=False)
    pm.add_plugin(EverythingPlugin(), PluginInfo("everything", "everything-dist", "1.0", "entry point"))
    bad = PLAN.replace('after = "head"', 'after = "more"').replace('reward = "short"', 'reward = "shrot"') \
        .replace("[track.list]", "[track.lst]")
    path = tmp_path / "plan.toml"
    path.write_text(bad)
    with pytest.raises(PlanError) as err:
        load_plan(path, pm.registry())
    problems = err.value.problems
    assert f"{path}: stage[1].after: no earlier stage is named 'more'; earlier stages: head" in problems
    assert f"{path}: stage[1].reward: undefined reward 'shrot'; did you mean 'short'? " \
           f"Available: short (define it as [reward.shrot])" in problems
    assert any(p.startswith(f"{path}: track.lst: unknown tracker 'lst'; did you mean 'list'?") for p in problems)
    assert len(problems) == 3, problems


def test_a_tracker_with_a_misspelled_hook_is_refused_in_one_line():
    from ftcore.errors import FtcoreError
    from ftcore.plugins import get_plugin_manager
    from ftcore.registry import Registration

    class Typo(Component):
        name = "typo"

        @ftcore.hookimpl
        def ftcore_log(self, run, stage, step, metrics):
            pass

        @ftcore.hookimpl
        def ftcore_run_ended(self, run, error):
            pass

    pm = get_plugin_manager(entry_points=False)
    reg = Registration("tracker", "typo", Typo, "acme", "acme-dist", "2.0")
    with pytest.raises(FtcoreError, match=r"^tracker 'typo' from plugin 'acme' \(acme-dist 2.0\) implements unknown "
                                          r"hook 'ftcore_run_ended'; did you mean 'ftcore_run_end'\?$"):
        pm.add_run_plugin(Typo(), reg)
