"""An example third-party ftcore plugin: the ``focal_sft`` trainer.

The built-in ``sft`` trainer with another loss: the focal loss of Lin et al. (2017),
``-(1 - p)^gamma * log p`` on each trained token, which weighs down the tokens the model already
predicts well. It subclasses the public base ``ftcore_plugins.trainers.base.SFT`` and overrides two
things: ``Options`` (one more option, ``focal_gamma``) and ``compute_loss``. Everything else is
``sft``'s: the data preparation (assistant-only labels, truncation, packing), every option of the
shared table, checkpoints, ``--resume``, the stability guard, the progress bar, metrics and
``ftcore estimate``. With ``focal_gamma = 0`` it is ``sft``'s cross-entropy.
"""

from __future__ import annotations

from pydantic import Field

import ftcore
from ftcore_plugins.trainers.base import SFT, SFTOptions

__version__ = "0.2.0"


class FocalSFT(SFT):
    """SFT with the focal loss: -(1-p)^gamma log p per assistant token; gamma = 0 is sft's loss."""

    name = "focal_sft"

    class Options(SFTOptions):
        focal_gamma: float = Field(2.0, ge=0)  # 0: plain cross-entropy, as sft

    def compute_loss(self, outputs, labels, num_items_in_batch=None):
        import torch

        logits = outputs.logits[:, :-1].float()  # position i predicts token i + 1
        targets = labels[:, 1:].to(logits.device)
        trained = targets != -100
        logp = torch.log_softmax(logits, dim=-1).gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        per_token = -logp
        if self.options.focal_gamma:
            per_token = per_token * (1 - logp.exp()).pow(self.options.focal_gamma)
        # Divided by the trainable tokens of all the step's micro-batches, as sft's loss is, so that
        # gradient accumulation gives the gradient of one big batch.
        count = num_items_in_batch if num_items_in_batch is not None else trained.sum()
        return (per_token * trained).sum() / torch.as_tensor(count, device=logits.device).clamp(min=1)


@ftcore.hookimpl
def register_trainers(register):
    register(FocalSFT)
