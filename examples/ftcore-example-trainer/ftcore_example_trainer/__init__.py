"""An example third-party ftcore plugin: the ``plain_sft`` trainer.

Supervised fine-tuning written as a plain PyTorch loop, to show the whole trainer
contract in one page: the runner hands ``train(ctx)`` the model (with the stage's
adapter already applied), the tokenizer, the plan's chat template and the stage's rows;
the trainer trains the model in place and returns its final metrics. The runner saves
the adapter, measures memory and writes ``COMPLETE.json``.

Each row's last assistant turn is the target: the loss is on its tokens only (the
conversation before it is rendered with the generation prompt and masked). Batches are
drawn from a seeded shuffle, AdamW with a linearly decaying learning rate.

What it leaves out, on purpose: checkpoints (a killed run starts this stage again),
gradient accumulation and mixed precision. The built-in ``sft`` trainer has them all.
"""

from __future__ import annotations

from pydantic import Field

import ftcore
from ftcore.component import Component, Options

__version__ = "0.1.0"


class PlainSFT(Component):
    """SFT in a plain PyTorch loop: loss on each row's last assistant turn, AdamW, linear decay."""

    name = "plain_sft"

    class Options(Options):
        max_steps: int = Field(100, ge=1)  # the same names as the built-in sft options, so a plan swaps by name
        learning_rate: float = Field(1e-3, gt=0)
        batch_size: int = Field(8, ge=1)
        max_length: int = Field(256, ge=8)  # longer samples are cut at the end
        logging_steps: int = Field(10, ge=1)

    def train(self, ctx):
        import torch

        o = self.options
        samples = encode(ctx, o.max_length)
        model, tok = ctx.model, ctx.tokenizer
        device = next(model.parameters()).device
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=o.learning_rate)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / o.max_steps)
        order = torch.Generator().manual_seed(ctx.seed)
        queue: list[int] = []
        losses: list[float] = []
        model.train()
        with ctx.reporter.progress(f"train {ctx.stage}", o.max_steps) as bar:
            for step in range(1, o.max_steps + 1):
                while len(queue) < o.batch_size:  # a new seeded shuffle each epoch
                    queue += torch.randperm(len(samples), generator=order).tolist()
                batch, queue = [samples[i] for i in queue[:o.batch_size]], queue[o.batch_size:]
                width = max(len(ids) for ids, _ in batch)
                ids = torch.tensor([x + [pad] * (width - len(x)) for x, _ in batch], device=device)
                labels = torch.tensor([y + [-100] * (width - len(y)) for _, y in batch], device=device)
                mask = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x, _ in batch], device=device)
                loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                optimizer.step()
                schedule.step()
                optimizer.zero_grad(set_to_none=True)
                losses.append(loss.item())
                if step % o.logging_steps == 0 or step == o.max_steps:
                    window = losses[-o.logging_steps:]
                    ctx.reporter.log(ctx.stage, {"loss": sum(window) / len(window),
                                                 "learning_rate": schedule.get_last_lr()[0]}, step=step)
                bar.update(completed=step, note=f"loss {loss.item():.4f}")
        head = losses[:o.logging_steps]
        tail = losses[-o.logging_steps:]
        return {"first_loss": sum(head) / len(head), "train_loss": sum(tail) / len(tail), "global_step": o.max_steps}


def encode(ctx, max_length: int) -> list[tuple[list[int], list[int]]]:
    """(input_ids, labels) per chat row; labels are -100 except on the last assistant turn."""
    if "messages" not in ctx.train_data.column_names:
        raise ftcore.FtcoreError(f"stage {ctx.stage}: trainer 'plain_sft' needs chat rows (messages); "
                                 f"this data has {', '.join(ctx.train_data.column_names)}")
    tok, template = ctx.tokenizer, ctx.template
    out = []
    for row in ctx.train_data:
        messages = row["messages"]
        if len(messages) < 2 or messages[-1]["role"] != "assistant":
            continue
        prompt = tok(template.render(messages[:-1], tok, add_generation_prompt=True),
                     add_special_tokens=False)["input_ids"]
        full = tok(template.render(messages, tok, add_generation_prompt=False),
                   add_special_tokens=False)["input_ids"][:max_length]
        labels = [-100] * min(len(prompt), len(full)) + full[len(prompt):]
        if any(label != -100 for label in labels):
            out.append((full, labels))
    if not out:
        raise ftcore.FtcoreError(f"stage {ctx.stage}: trainer 'plain_sft' found no row ending in an "
                                 f"assistant turn that fits max_length={max_length}")
    return out


@ftcore.hookimpl
def register_trainers(register):
    register(PlainSFT)
