"""docs/writing-plugins.md's way for an ``sft`` subclass to log a metric of its own at every step:
``compute_loss`` keeps the value, the trainer class's ``training_step`` logs it with the step."""

from __future__ import annotations

from ftcore_plugins.trainers.base import SFT, SFTOptions


class FocalSFT(SFT):
    """The docs' focal loss, with the mean probability of the trained tokens logged per step."""

    name = "focal_sft"

    class Options(SFTOptions):
        focal_gamma: float = 2.0

    def compute_loss(self, outputs, labels, num_items_in_batch=None):
        import torch

        logits = outputs.logits[:, :-1].float()
        targets = labels[:, 1:].to(logits.device)
        trained = targets != -100
        logp = torch.log_softmax(logits, dim=-1).gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        self.last_p = float((logp.detach().exp() * trained).sum() / trained.sum().clamp(min=1))
        per_token = -logp * (1 - logp.exp()).pow(self.options.focal_gamma)
        count = num_items_in_batch if num_items_in_batch is not None else trained.sum()
        return (per_token * trained).sum() / torch.as_tensor(count, device=logits.device).clamp(min=1)

    def trainer_class(self, ctx):
        base, component, reporter, stage = super().trainer_class(ctx), self, ctx.reporter, ctx.stage

        class Logged(base):
            def training_step(self, model, inputs, num_items_in_batch=None):
                loss = super().training_step(model, inputs, num_items_in_batch)
                reporter.log(stage, {"focal/p_mean": component.last_p}, step=self.state.global_step + 1)
                return loss

        return Logged


def test_a_subclass_logs_a_metric_at_every_step(ftcore_stage):
    ctx = ftcore_stage()
    FocalSFT(FocalSFT.Options(max_steps=12, batch_size=8, max_length=64, learning_rate=1e-2,
                              logging_steps=4)).train(ctx)
    logged = {r["step"]: r["focal/p_mean"] for r in ctx.reporter.records if "focal/p_mean" in r}
    assert sorted(logged) == list(range(1, 13))
    assert all(0 < p < 1 for p in logged.values())
    assert logged[12] > logged[1]  # the trained tokens grow likelier as it learns
    losses = ctx.reporter.losses("sft")
    assert sorted(losses) == [4, 8, 12]  # the stage's own records are as before
    # Every stage says which loss it trained with: here, the subclass's own.
    assert {r.get("loss_kernel") for r in ctx.reporter.records if r.get("step") == 0} >= {"compute_loss"}
