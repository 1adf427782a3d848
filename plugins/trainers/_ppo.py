"""The pieces of PPO for language models (Ziegler et al. 2019; Huang et al. 2024, "The N implementation
details of RLHF with PPO"), used by ``trainer_ppo``: masked statistics, GAE, the clipped losses, the
KL controllers, the value head, prompts, reward sources and resumable checkpoints.

TRL 1.16 dropped its PPOTrainer and, with it, ``masked_whiten`` and the KL controllers; the
per-token pieces it still ships (``selective_log_softmax``, ``entropy_from_logits``,
``first_true_indices``, ``create_reference_model``) are used by the trainer. Heavy imports stay
inside functions: this module is imported by ``ftcore validate`` through the trainer.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from ftcore.errors import FtcoreError

# -- masked statistics, GAE, losses ------------------------------------------------------------------


def masked_mean(values: Any, mask: Any) -> Any:
    return (values * mask).sum() / mask.sum().clamp(min=1)


def masked_var(values: Any, mask: Any) -> Any:
    """Variance over the masked entries, with Bessel's correction (as TRL's old PPO did)."""
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    n = mask.sum()
    return var * n / (n - 1) if n > 1 else var


def masked_whiten(values: Any, mask: Any) -> Any:
    """Zero mean, unit variance over the masked entries; zero elsewhere."""
    import torch

    mean, var = masked_mean(values, mask), masked_var(values, mask)
    return (values - mean) * torch.rsqrt(var + 1e-8) * mask


def gae(rewards: Any, values: Any, mask: Any, gamma: float, lam: float) -> tuple[Any, Any]:
    """Generalised advantage estimation over the response tokens, right to left; ``mask`` marks each
    row's response. The value after a row's last token is 0 (the episode ends there).
    Returns ``(advantages, returns)``, both zero outside the mask."""
    import torch

    rewards, values = rewards * mask, values * mask
    length = rewards.shape[1]
    last = torch.zeros_like(rewards[:, 0])
    advantages = torch.zeros_like(rewards)
    for t in reversed(range(length)):
        next_value = values[:, t + 1] if t + 1 < length else torch.zeros_like(last)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        last = delta + gamma * lam * last
        advantages[:, t] = last
    advantages = advantages * mask
    return advantages, (advantages + values) * mask


def policy_loss(logprobs: Any, old_logprobs: Any, advantages: Any, mask: Any, cliprange: float) -> tuple[Any, Any]:
    """The clipped surrogate: mean over tokens of max(-A r, -A clip(r, 1-c, 1+c)), r the probability
    ratio. Returns ``(loss, clip_fraction)``: the share of tokens where the clipped term won."""
    import torch

    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    loss = masked_mean(torch.maximum(unclipped, clipped), mask)
    return loss, masked_mean((clipped > unclipped).float(), mask)


def value_loss(values: Any, old_values: Any, returns: Any, mask: Any, cliprange_value: float) -> tuple[Any, Any]:
    """The clipped value loss: 0.5 mean of max((v - R)^2, (v_clipped - R)^2), v_clipped kept within
    ``cliprange_value`` of the rollout's value. Returns ``(loss, clip_fraction)``."""
    import torch

    clipped_values = old_values + torch.clamp(values - old_values, -cliprange_value, cliprange_value)
    unclipped = (values - returns) ** 2
    clipped = (clipped_values - returns) ** 2
    loss = 0.5 * masked_mean(torch.maximum(unclipped, clipped), mask)
    return loss, masked_mean((clipped > unclipped).float(), mask)


# -- KL controllers ---------------------------------------------------------------------------------


class FixedKLController:
    def __init__(self, kl_coef: float):
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        pass

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = state["value"]


class AdaptiveKLController(FixedKLController):
    """Ziegler et al. (2019), section 2.2: move the coefficient towards the KL target, by at most
    20% of ``n_steps / horizon`` per update."""

    def __init__(self, kl_coef: float, target: float, horizon: int):
        super().__init__(kl_coef)
        self.target, self.horizon = target, horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target - 1, -0.2), 0.2)
        self.value *= 1 + error * n_steps / self.horizon


# -- the policy with a value head -------------------------------------------------------------------


def policy_and_value(policy: Any, router_logits: bool = False) -> Any:
    """An ``nn.Module`` holding the policy and a scalar value head on its last hidden state: one
    forward pass gives the response tokens' logits and values (and, with ``router_logits``, a mixture of
    experts' router loss as ``aux_loss``)."""
    import torch

    config = policy.config.get_text_config() if hasattr(policy.config, "get_text_config") else policy.config

    class PolicyAndValue(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.policy = policy
            self.value_head = torch.nn.Linear(config.hidden_size, 1)
            # Small initial values (std 1/sqrt(d+1), as TRL's value heads used) keep early value loss tame.
            torch.nn.init.normal_(self.value_head.weight, std=1 / math.sqrt(config.hidden_size + 1))
            torch.nn.init.zeros_(self.value_head.bias)

        def forward(self, input_ids, attention_mask, response_length: int):
            """Logits and values at the positions that predict the last ``response_length`` tokens."""
            keep = response_length + 1
            position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)  # left padding: positions start at 0
            router = {"output_router_logits": True} if router_logits else {}
            out = self.policy(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                              output_hidden_states=True, use_cache=False, logits_to_keep=keep, **router)
            hidden = out.hidden_states[-1][:, -keep:-1]
            values = self.value_head(hidden.to(self.value_head.weight.dtype)).squeeze(-1)
            self.aux_loss = getattr(out, "aux_loss", None) if router_logits else None
            return out.logits[:, -keep:-1], values

    return PolicyAndValue()


def frozen_copy(model: Any) -> Any:
    """TRL's ``create_reference_model`` (a frozen deep copy in eval mode), without the forward patches
    that close over the original model: TRL's SFTTrainer installs one (its fused LM head calls the
    original's bound ``forward``), and a deep copy keeps the closure, so the "reference" would run
    with the policy's live weights."""
    import warnings

    from ftcore_plugins.common.model import strip_forward_patches

    with warnings.catch_warnings():  # "trl.experimental is unstable": this helper is a plain deep copy
        warnings.simplefilter("ignore")
        from trl.experimental.utils import create_reference_model

    return strip_forward_patches(create_reference_model(model))


def reference_logits(reference: Any, input_ids: Any, attention_mask: Any, response_length: int) -> Any:
    keep = response_length + 1
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    out = reference(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                    use_cache=False, logits_to_keep=keep)
    return out.logits[:, -keep:-1]


# -- prompts and rewards ----------------------------------------------------------------------------


def prompt_texts(data: Any, tokenizer: Any, template: Any, stage: str) -> list[str]:
    """The prompts PPO generates from (see ``_chat.prompt_text``)."""
    from ftcore_plugins.common.chat import prompt_rows, prompt_text

    out = [p for p in (prompt_text(row, tokenizer, template) for row in prompt_rows(data, stage, "ppo")) if p]
    if not out:
        raise FtcoreError(f"stage {stage}: trainer 'ppo' found no prompt in the data (every row was only an answer)")
    return out


class RewardModel:
    """A sequence-classification reward model saved by an earlier stage: its score (one logit) of
    prompt + completion, re-tokenized with the reward model's own tokenizer."""

    def __init__(self, folder: Path, device: Any, stage: str, ref: str):
        from ftcore_plugins.common import reward_model as _reward_model

        self.model, self.tokenizer = _reward_model.load(folder, device, stage, ref)
        self.device = device

    def score(self, texts: list[str], batch_size: int) -> list[float]:
        from ftcore_plugins.common import reward_model as _reward_model

        return _reward_model.scores(self.model, self.tokenizer, texts, self.device, batch_size)


# -- checkpoints --------------------------------------------------------------------------------------

TRAINABLE = "trainable.safetensors"


def rng_state() -> dict[str, Any]:
    import random

    import numpy as np
    import torch

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    import random

    import numpy as np
    import torch

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(folder: Path, module: Any, optimizer: Any, scheduler: Any, state: dict[str, Any],
                    keep: int | None) -> None:
    """Trainable weights (policy adapter or full weights, and the value head), optimizer, scheduler,
    RNG states and the trainer's state (step, KL coefficient, reward history); marked complete last,
    so a save killed halfway is never resumed from. Then only the newest ``keep`` checkpoints stay."""
    import torch
    from safetensors.torch import save_file

    from ftcore import rundir

    from ftcore_plugins.trainers._callbacks import mark_checkpoint, rotate_checkpoints

    folder.mkdir(parents=True, exist_ok=True)
    save_file({n: p.detach().cpu().contiguous() for n, p in module.named_parameters() if p.requires_grad},
              str(folder / TRAINABLE))
    torch.save(optimizer.state_dict(), folder / "optimizer.pt")
    torch.save(scheduler.state_dict(), folder / "scheduler.pt")
    torch.save(rng_state(), folder / "rng_state.pt")
    rundir.write_json(folder / "trainer_state.json", state)
    mark_checkpoint(folder, state["step"])
    rotate_checkpoints(folder.parent, keep)


def load_checkpoint(folder: Path, module: Any, optimizer: Any, scheduler: Any) -> dict[str, Any]:
    import torch
    from safetensors.torch import load_file

    weights = load_file(str(folder / TRAINABLE))
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    if set(weights) != trainable:
        raise FtcoreError(f"{folder}: the checkpoint's trainable weights do not match this stage's model "
                          f"({len(set(weights) ^ trainable)} names differ); was the plan changed?")
    module.load_state_dict(weights, strict=False)
    optimizer.load_state_dict(torch.load(folder / "optimizer.pt", weights_only=False))
    scheduler.load_state_dict(torch.load(folder / "scheduler.pt", weights_only=False))
    set_rng_state(torch.load(folder / "rng_state.pt", weights_only=False))
    return json.loads((folder / "trainer_state.json").read_text())
