"""The public, stable API for trainers built on ftcore's own: import from here, not from ``_*`` modules.

    from ftcore_plugins.trainers.base import SFT, SFTOptions

    class FocalSFT(SFT):
        name = "focal_sft"

        class Options(SFTOptions):
            focal_gamma: float = 2.0

        def compute_loss(self, outputs, labels, num_items_in_batch=None):
            ...

A subclass of ``SFT`` (or ``Pretrain``) overrides any of ``Options``, ``prepare_data(ctx)``,
``trl_config(ctx)``, ``trainer_class(ctx)``, ``compute_loss(outputs, labels, num_items_in_batch)``
and ``check(plan)`` (call ``super().check(plan)``), and keeps checkpoints, ``--resume``, the
stability guard, progress, metrics, SIGINT/SIGTERM handling and the memory estimate: they come
from ``run_trl``/``run_trainer``, which ``SFT.train`` calls. docs/trainers.md, "Extending sft",
has the details and a complete example.

The names in ``__all__`` are stable: they keep their meaning and signatures within a minor
version; anything else in ``ftcore_plugins.trainers`` (modules starting with ``_``) may change.
This module imports no heavy library, so ``ftcore plugins``/``validate`` stay light.
"""

from __future__ import annotations

from ftcore_plugins.trainers._callbacks import (GracefulStop, StabilityGuard, mark_checkpoint, newest_checkpoint,
                                                 rotate_checkpoints)
from ftcore_plugins.trainers._training import (TrainChecks, TrainOptions, run_trainer, run_trl, tokenize_splits,
                                                training_arguments)
from ftcore_plugins.trainers.pretrain import Pretrain, PretrainOptions
from ftcore_plugins.trainers.sft import SFT, SFTOptions, chosen_as_chat

__all__ = [
    # trainers to subclass, and their options
    "SFT", "SFTOptions", "Pretrain", "PretrainOptions",
    # the shared options and their validation, for a trainer of your own on transformers/TRL
    "TrainOptions", "TrainChecks",
    # the training run every built-in trainer uses (checkpoints, resume, guard, progress, metrics)
    "run_trainer", "run_trl", "training_arguments", "tokenize_splits", "chosen_as_chat",
    # the same pieces for a trainer with its own loop (as ppo)
    "GracefulStop", "StabilityGuard", "mark_checkpoint", "rotate_checkpoints", "newest_checkpoint",
]
