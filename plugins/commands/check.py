"""``ftcore check``: a pre-flight check of each training stage, in a minute and without a run."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

import ftcore
from ftcore.command import Command
from ftcore.errors import ComponentError, FtcoreError

from ftcore_plugins.commands._preflight import collate, supervised_rows
from ftcore_plugins.common.seq2seq import is_encoder_decoder


class CheckCommand(Command):
    """Pre-flight check of a plan's training stages: labels, gradients, one batch overfit.

    For each stage, from the plan's starting model (a later stage's check starts from it too, not
    from the stage before: that output does not exist yet):

    1. renders and labels its first rows and shows them, the trained tokens highlighted;
    2. applies its adapter and takes one forward and backward pass: every trainable parameter must
       get a finite gradient, non-zero within two steps, and no frozen parameter any;
    3. overfits one batch for --steps steps at the stage's learning rate: the loss must fall below
       --threshold times its first value (by a quarter, by default: a stage that learns at all does).

    A preference stage (dpo, kto, orpo) shows its chosen answers and gets the gradient checks on them,
    not the overfit; a stage that trains a model of its own (reward) shows its rows; one that learns
    from answers it generates (ppo, grpo) shows those it has. Exits 0 when every check passes, else 2
    with one line per failed check. Writes no run folder.
    """

    name = "check"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("plan", help="the plan (TOML)")
        parser.add_argument("--stage", action="append", metavar="NAME", help="only this stage (repeat for several)")
        parser.add_argument("--rows", type=int, default=2, metavar="N", help="rows to show per stage (default 2)")
        parser.add_argument("--steps", type=int, default=30, metavar="K",
                            help="steps of the one-batch overfit (default 30)")
        parser.add_argument("--threshold", type=float, default=0.75, metavar="F",
                            help="the overfit passes when the last loss is below F x the first (default 0.75)")

    def run(self, args: argparse.Namespace) -> int:
        import sys

        from rich.console import Console

        from ftcore_plugins.commands.quiet import quiet_libraries

        quiet_libraries(verbose=args.debug)
        from ftcore.runner import Runner

        if args.steps < 2:
            raise FtcoreError(f"--steps: at least 2 (a gradient must move the loss), got {args.steps}")
        plan, pm = self.load_plan(args.plan)
        console = Console()
        runner = Runner(plan, pm, console)
        stages = [s for s in plan.stages if args.stage is None or s.name in args.stage]
        missing = sorted(set(args.stage or ()) - {s.name for s in stages})
        if missing:
            raise FtcoreError(f"no stage named {', '.join(map(repr, missing))}; stages: "
                              f"{', '.join(s.name for s in plan.stages)}")
        failures: list[str] = []
        with tempfile.TemporaryDirectory(prefix="ftcore-check-") as work:
            for stage in stages:
                console.rule(f"stage {stage.name} ({stage.trainer.shown})", style="dim")
                failed = check_stage(runner, stage, Path(work) / stage.name, args, console)
                failures += [f"{Path(args.plan).name}: stage {stage.name}: {line}" for line in failed]
        for line in failures:
            print(f"check failed: {line}", file=sys.stderr)
        if not failures:
            console.print(f"[green]all checks passed[/] ({len(stages)} stage{'s' * (len(stages) != 1)})")
        return 2 if failures else 0


def check_stage(runner: Any, stage: Any, work: Path, args: argparse.Namespace, console: Any) -> list[str]:
    """The three checks of one stage; returns one line per failed check."""
    import torch

    from ftcore.runner import calling

    work.mkdir(parents=True)
    model, tokenizer = runner.load_model(work)
    try:
        rows = supervised_rows(runner, stage, model, tokenizer)
    except (FtcoreError, ComponentError) as exc:
        return [f"data: {exc}"]
    if rows is None:
        console.print(f"trainer '{stage.trainer.name}' learns from answers it generates: no labelled rows to check")
        return []
    seq2seq = is_encoder_decoder(model)
    show_rows(rows, tokenizer, args.rows, console, seq2seq=seq2seq)
    if not stage.trains_policy:
        console.print(f"trainer '{stage.trainer.name}' trains a model of its own: its rows are checked, not its steps")
        return []
    # The overfit test is for supervised stages; a preference loss at its (small) learning rate is not
    # meant to memorise a batch in a few steps, so those stages get the gradient checks alone.
    supervised = hasattr(stage.trainer.create(), "prepare_data")
    steps = args.steps if supervised else 2
    try:
        with calling(stage.adapter, "apply"):
            model = stage.adapter.create().apply(model, runner.adapter_context())
    except (FtcoreError, ComponentError) as exc:
        return [f"adapter: {exc}"]
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not trainable:
        return [f"adapter '{stage.adapter.name}' leaves no parameter trainable: nothing would learn"]
    options = stage.trainer.options
    lr = options.learning_rate
    torch.manual_seed(runner.plan.seed)
    batch = collate(rows, range(min(len(rows), options.batch_size)), tokenizer)
    optimizer = torch.optim.AdamW([p for _, p in trainable], lr=lr, weight_decay=0.0)
    model.train()
    failures, losses, moved, reached = [], [], set(), set()
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss = model(**batch).loss
        if not torch.isfinite(loss):
            failures.append(f"the loss is {loss.item()} at step {step + 1} of the overfit at learning_rate {lr:g}")
            break
        loss.backward()
        if step == 0:
            failures += gradient_problems(model, trainable)
            if failures:
                break
        if step < 2:  # a LoRA A matrix gets its first gradient once B has left zero, at step 2
            reached |= {n for n, p in trainable if p.grad is not None}
            moved |= {n for n, p in trainable if p.grad is not None and bool(p.grad.abs().sum() > 0)}
        optimizer.step()
        losses.append(loss.item())
    if failures:
        return failures
    silent = [n for n, _ in trainable if n not in moved]
    unused = [n for n in silent if n not in reached] if stage.adapter.name == "full" else []
    if unused:  # full marks every weight trainable, read by the loss or not: the model's own design (LLaVA
        # reads its vision tower before the final norm), not a choice of the plan's
        console.print(f"note: {len(unused)} parameters are not on the loss's path (first: {unused[0]}): full "
                      "fine-tuning cannot train them, and the gradient check leaves them out", highlight=False,
                      soft_wrap=True)
        silent = [n for n in silent if n not in unused]
    if silent:
        failures.append(f"{len(silent)} of {len(trainable)} trainable parameters got no gradient in two steps "
                        f"(first: {silent[0]}): they are not on the loss's path")
    else:
        console.print(f"gradients: each of {len(trainable) - len(unused)} trainable parameters got a finite, non-zero "
                      "one; no frozen parameter got any", highlight=False, soft_wrap=True)
    if not supervised:
        console.print(f"overfit: not run for trainer '{stage.trainer.name}' (a preference loss)")
        return failures
    trained = int((batch["labels"][:, 0 if seq2seq else 1:] != -100).sum())  # a causal LM's first is no target
    console.print(f"overfit one batch of {len(batch['input_ids'])} rows ({trained} trained tokens), {steps} steps at "
                  f"learning_rate {lr:g}: loss {losses[0]:.4f} -> {losses[-1]:.4f}", highlight=False, soft_wrap=True)
    if losses[-1] > args.threshold * losses[0]:
        failures.append(f"one batch did not overfit: the loss went {losses[0]:.4f} -> {losses[-1]:.4f} in "
                        f"{steps} steps at learning_rate {lr:g} (the check wants below {args.threshold:g} x "
                        f"the first); {likely_cause(lr, trained, trainable, model)}")
    return failures


def show_rows(rows: Any, tokenizer: Any, n: int, console: Any, seq2seq: bool = False) -> None:
    """The first ``n`` rows as the model reads them: trained tokens in green, the rest dimmed; an
    encoder-decoder's prompt (its encoder's input, dimmed), then its answer (the labels, in green)."""
    from rich.text import Text

    if seq2seq:
        console.print(Text.assemble(("prompt (encoder)", "dim"), " -> ", ("answer (decoder, trained)", "bold green")))
        for i in range(min(n, len(rows))):
            ids, labels = rows[i]["input_ids"], rows[i]["labels"]
            console.print(f"row {i + 1}: {len(ids)} prompt tokens, {len(labels)} trained", style="bold",
                          highlight=False)
            console.print(Text.assemble((tokenizer.decode(ids), "dim"), " -> ",
                                        (tokenizer.decode(labels), "bold green")), soft_wrap=True)
        return

    images = getattr(rows, "image_ids", set())  # rows with images: their image tokens, shown as one run each
    console.print(Text.assemble(("trained", "bold green"), " / ", ("not trained", "dim"),
                                *((" / ", ("image tokens", "bold magenta")) if images else ())))
    for i in range(min(n, len(rows))):
        ids, labels = rows[i]["input_ids"], rows[i]["labels"]
        text, start = Text(), 0
        kind = [2 if t in images else int(label != -100) for t, label in zip(ids, labels)]
        for end in range(1, len(ids) + 1):  # runs of tokens alike, decoded together (multi-byte characters)
            if end == len(ids) or kind[end] != kind[start] or (kind[start] == 2 and ids[end] != ids[start]):
                if kind[start] == 2:  # an image's tokens: the token and how many times it repeats
                    token = tokenizer.convert_ids_to_tokens(ids[start])
                    text.append(token + (f"×{end - start}" if end - start > 1 else ""), style="bold magenta")
                else:
                    text.append(tokenizer.decode(ids[start:end]), style="bold green" if kind[start] else "dim")
                start = end
        trained = sum(label != -100 for label in labels)
        shown = sum(k == 2 for k in kind)
        console.print(f"row {i + 1}: {len(ids)} tokens, {trained} trained"
                      + (f", {shown} image tokens" if images else ""), style="bold", highlight=False)
        console.print(text, soft_wrap=True)


def gradient_problems(model: Any, trainable: list) -> list[str]:
    """After the first backward pass: trainable parameters without a finite gradient, frozen ones with one."""
    import torch

    out = []
    broken = [n for n, p in trainable if p.grad is not None and not bool(torch.isfinite(p.grad).all())]
    if broken:
        out.append(f"{len(broken)} trainable parameters got a NaN or infinite gradient (first: {broken[0]})")
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad and p.grad is not None]
    if frozen:
        out.append(f"{len(frozen)} frozen parameters got a gradient (first: {frozen[0]})")
    return out


def likely_cause(lr: float, trained: int, trainable: list, model: Any) -> str:
    """What most often keeps one batch from being learnt, from what the check saw."""
    if trained == 0:
        return "likely: no token of the batch is trained (every label masked)"
    if lr < 1e-6:
        return f"likely: learning_rate {lr:g} is too small to move the loss in a few steps"
    total = sum(p.numel() for p in model.parameters())
    share = sum(p.numel() for _, p in trainable) / max(total, 1)
    if share < 1e-4:
        return f"likely: the adapter trains {share:.1e} of the model's parameters, too few to learn the batch"
    return "likely: a learning rate too low for this model, or answers the model cannot reach (see the rows above)"


@ftcore.hookimpl
def register_commands(register):
    register(CheckCommand)
