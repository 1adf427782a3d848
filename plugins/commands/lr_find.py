"""``ftcore lr-find``: a learning-rate range test on a stage's data."""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from pathlib import Path
from typing import Any

import ftcore
from ftcore.command import Command
from ftcore.errors import FtcoreError

from ftcore_plugins.commands._preflight import collate, supervised_rows

SMOOTHING = 0.98  # the loss's exponential moving average (bias-corrected), as fastai's finder keeps it
DIVERGED = 4.0  # the test stops once the smoothed loss is this many times its lowest


class LrFindCommand(Command):
    """Learning-rate range test on a stage's data: loss against a growing learning rate.

    From the plan's starting weights, with the stage's adapter, batch size and data, the learning rate
    grows exponentially from --start to --end over --steps steps (AdamW, one batch a step), and the
    loss is recorded, smoothed (a bias-corrected moving average, factor 0.98). The test stops early
    once the smoothed loss passes 4x its lowest. The suggestion is the rate where the smoothed loss
    falls fastest against log(rate), before its lowest point (fastai's "steep" rule).

    --verify trains --steps steps at a constant suggested rate, and at 10x and 0.1x it, each from the
    same starting weights on the same batches, and prints their losses. Writes the plot to --plot and
    nothing in the run folder.
    """

    name = "lr-find"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("plan", help="the plan (TOML)")
        parser.add_argument("--stage", metavar="NAME", help="the stage (default: the first one that trains the model)")
        parser.add_argument("--steps", type=int, default=100, metavar="N", help="steps of the test (default 100)")
        parser.add_argument("--start", type=float, default=1e-7, help="the first learning rate (default 1e-7)")
        parser.add_argument("--end", type=float, default=1.0, help="the last learning rate (default 1)")
        parser.add_argument("--plot", type=Path, default=Path("lr_find.png"), metavar="PNG",
                            help="where to write the plot (default lr_find.png)")
        parser.add_argument("--verify", action="store_true",
                            help="also train at the suggestion, 10x it and 0.1x it, and compare their losses")
        parser.add_argument("--json", action="store_true", help="print the result as JSON")

    def run(self, args: argparse.Namespace) -> int:
        from rich.console import Console

        from ftcore_plugins.commands.quiet import quiet_libraries

        quiet_libraries(verbose=args.debug)
        from ftcore.runner import Runner

        if args.steps < 10:
            raise FtcoreError(f"--steps: at least 10, got {args.steps}")
        if not 0 < args.start < args.end:
            raise FtcoreError(f"--start and --end: need 0 < start < end, got {args.start:g} and {args.end:g}")
        if args.plot.exists():
            raise FtcoreError(f"--plot: {args.plot} already exists; choose another path (ftcore never overwrites it)")
        plan, pm = self.load_plan(args.plan)
        console = Console(quiet=args.json)
        stage = pick_stage(plan, args.stage)
        with tempfile.TemporaryDirectory(prefix="ftcore-lr-find-") as work:
            runner = Runner(plan, pm, console)
            model, tokenizer = runner.load_model(Path(work))
            rows = supervised_rows(runner, stage, model, tokenizer)
            if rows is None:
                raise FtcoreError(f"stage {stage.name}: trainer '{stage.trainer.name}' learns from answers it "
                                  "generates; lr-find needs a stage with labelled rows")
            from ftcore.runner import calling

            with calling(stage.adapter, "apply"):
                model = stage.adapter.create().apply(model, runner.adapter_context())
            batch_size = min(stage.trainer.options.batch_size, len(rows))
            batches = [collate(rows, [(k * batch_size + i) % len(rows) for i in range(batch_size)], tokenizer)
                       for k in range(args.steps)]
            start = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
            rates = [args.start * (args.end / args.start) ** (k / (args.steps - 1)) for k in range(args.steps)]
            losses = train(model, batches, rates, stop_when_diverged=True)
            smooth = smoothed(losses)
            suggestion = suggest(rates[:len(smooth)], smooth)
            result = {"stage": stage.name, "suggestion": suggestion, "rates": rates[:len(losses)], "losses": losses,
                      "smoothed": smooth, "stopped_at": len(losses), "steps": args.steps}
            if args.verify:
                result["verify"] = {}
                for factor in (0.1, 1.0, 10.0):
                    restore(model, start)
                    arm = train(model, batches, [suggestion * factor] * args.steps)
                    result["verify"][f"{factor:g}x"] = {"learning_rate": suggestion * factor, "losses": arm,
                                                        "final": final_loss(arm)}
        plot(result, args.plot)
        if args.json:
            print(json.dumps(result))
            return 0
        def say(text: str) -> None:
            console.print(text, highlight=False, soft_wrap=True)

        say(f"stage [bold]{stage.name}[/]: {len(losses)} of {args.steps} steps, learning rate {args.start:g} -> "
            f"{rates[len(losses) - 1]:.3g}" + (" (stopped: the loss diverged)" if len(losses) < args.steps else ""))
        lowest = min(range(len(smooth)), key=smooth.__getitem__)
        say(f"lowest smoothed loss {smooth[lowest]:.4f} at learning rate {rates[lowest]:.3g}; "
            f"suggested learning_rate = {suggestion:.3g} (where the loss falls fastest)")
        for name, arm in result.get("verify", {}).items():
            say(f"verify {name}: learning_rate {arm['learning_rate']:.3g}, loss {arm['losses'][0]:.4f} -> "
                f"{arm['final']:.4f} (mean of the last tenth) over {args.steps} steps")
        say(f"plot: {args.plot}")
        return 0


def pick_stage(plan: Any, name: str | None) -> Any:
    if name is None:
        stage = next((s for s in plan.stages if s.trains_policy), None)
        if stage is None:
            raise FtcoreError("the plan has no stage that trains the model")
        return stage
    stage = next((s for s in plan.stages if s.name == name), None)
    if stage is None:
        raise FtcoreError(f"--stage: no stage named {name!r}; stages: {', '.join(s.name for s in plan.stages)}")
    return stage


def train(model: Any, batches: list, rates: list[float], *, stop_when_diverged: bool = False) -> list[float]:
    """One AdamW step per batch at ``rates[k]``; the losses. With ``stop_when_diverged``, stops once
    the smoothed loss passes ``DIVERGED`` times its lowest (or is not finite)."""
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=rates[0], weight_decay=0.0)
    model.train()
    losses: list[float] = []
    for batch, rate in zip(batches, rates):
        for group in optimizer.param_groups:
            group["lr"] = rate
        optimizer.zero_grad(set_to_none=True)
        loss = model(**batch).loss
        value = loss.item()
        if not math.isfinite(value):
            break
        loss.backward()
        optimizer.step()
        losses.append(value)
        if stop_when_diverged:
            smooth = smoothed(losses)
            if smooth[-1] > DIVERGED * min(smooth):
                break
    return losses


def smoothed(losses: list[float]) -> list[float]:
    """The bias-corrected exponential moving average of ``losses`` (factor ``SMOOTHING``)."""
    out, average = [], 0.0
    for k, value in enumerate(losses, 1):
        average = SMOOTHING * average + (1 - SMOOTHING) * value
        out.append(average / (1 - SMOOTHING ** k))
    return out


def suggest(rates: list[float], smooth: list[float]) -> float:
    """The rule: the learning rate where the smoothed loss falls fastest against log(learning rate)
    (a central difference), before its lowest point."""
    lowest = min(range(len(smooth)), key=smooth.__getitem__)
    if lowest < 2:
        return rates[lowest]
    slopes = {i: (smooth[i + 1] - smooth[i - 1]) / (math.log(rates[i + 1]) - math.log(rates[i - 1]))
              for i in range(1, lowest)}
    return rates[min(slopes, key=slopes.__getitem__)]


def final_loss(losses: list[float]) -> float:
    """The mean loss of the last tenth of the steps (infinite when training diverged before the end)."""
    if not losses:
        return math.inf
    tail = losses[-max(1, len(losses) // 10):]
    return sum(tail) / len(tail)


def restore(model: Any, weights: dict[str, Any]) -> None:
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in weights:
                p.copy_(weights[name])


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(result["rates"], result["losses"], color="0.75", linewidth=1, label="loss")
    ax.plot(result["rates"][:len(result["smoothed"])], result["smoothed"], color="C0", label="smoothed loss")
    ax.axvline(result["suggestion"], color="C3", linestyle="--", label=f"suggestion {result['suggestion']:.3g}")
    ax.set_xscale("log")
    ax.set_xlabel("learning rate")
    ax.set_ylabel("training loss")
    ax.set_title(f"learning-rate range test, stage {result['stage']}")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


@ftcore.hookimpl
def register_commands(register):
    register(LrFindCommand)
