"""Trainer ``ppo``: PPO with a value head on the policy, a frozen reference, and rewards from reward
functions or a reward model an earlier stage trained. TRL dropped its PPOTrainer; this one is built
on accelerate (device, precision, accumulation), transformers (``generate``, schedulers, optimizers)
and TRL's per-token utilities. The algorithm's pieces are in ``_ppo``."""

from __future__ import annotations

import math
import time
import warnings
from typing import Literal

from pydantic import Field

import ftcore
from ftcore.component import Component
from ftcore.errors import FtcoreError
from ftcore.types import LearningRate, RewardRef, StageRef

from ftcore_plugins.common.model import trainable_counts
from ftcore_plugins.trainers._optimizers import optimizer_arguments
from ftcore_plugins.trainers._router import apply_router_aux
from ftcore_plugins.trainers._training import TrainOptions, resolve_precision, training_problems

# Shared options that have no meaning here: PPO has no eval loss, and its loss (a surrogate that
# hovers around 0 with either sign) has no spikes to watch.
UNUSED = ("eval_steps", "early_stopping_patience", "early_stopping_threshold", "load_best_at_end",
          "guard_spike_factor", "guard_spike_window")


class PPOTrainer(Component):
    """PPO (clipped policy and value losses, GAE, KL penalty against a frozen reference)."""

    name = "ppo"

    class Options(TrainOptions):
        reward: list[RewardRef] = []  # [reward.<name>] functions, summed (weighted by reward_weights)
        reward_weights: list[float] | None = None
        reward_model: StageRef | None = None  # or: an earlier stage that trained a reward model
        learning_rate: LearningRate = 1e-5
        logging_steps: int = Field(1, ge=1)
        total_episodes: int | None = Field(None, gt=0)  # prompts to roll out; else epochs x prompts
        max_new_tokens: int = Field(32, ge=1)
        temperature: float = Field(0.7, gt=0)
        ppo_epochs: int = Field(4, ge=1)
        num_mini_batches: int = Field(1, ge=1)
        kl_coef: float = Field(0.05, ge=0)
        kl_controller: Literal["fixed", "adaptive"] = "fixed"
        target_kl: float = Field(6.0, gt=0)
        kl_horizon: int = Field(10000, gt=0)
        cliprange: float = Field(0.2, gt=0)
        cliprange_value: float = Field(0.2, gt=0)
        vf_coef: float = Field(0.1, ge=0)
        gamma: float = Field(1.0, ge=0, le=1)
        lam: float = Field(0.95, ge=0, le=1)
        whiten_advantages: bool = True
        missing_eos_penalty: float | None = Field(None, ge=0)  # subtracted from the score of a completion with no stop token

    def check(self, plan) -> list[str]:
        o = self.options
        problems = training_problems(self, plan)
        problems += [f"{key}: not used by trainer 'ppo' (it has no eval loss to watch); remove it"
                     for key in UNUSED if key in o.model_fields_set]
        if o.tiled_mlp and not any(p.startswith("tiled_mlp:") for p in problems):  # its own loop: no tiling
            problems.append("tiled_mlp: trainer 'ppo' runs its own rollout and update loop, which does not tile the "
                            "MLPs; set tiled_mlp = false, or use grpo/rloo, which take it")
        d = getattr(plan, "distributed", None)
        if d is not None and d.wanted:  # its own rollout loop would give every rank the same prompts
            problems.append("trainer: 'ppo' runs in one process only; remove [distributed] (or set "
                            "nproc_per_node = 1), or use grpo/rloo, which run distributed")
        for stage in plan.stages:
            if stage.trainer.options is o and stage.eval_data is not None:
                problems.append("eval_data: trainer 'ppo' does not evaluate eval_data; measure the policy with "
                                "an [[evaluate]] entry instead")
        if bool(o.reward) == (o.reward_model is not None):
            problems.append("reward: set exactly one reward source: reward = [\"<name>\", ...] (a [reward.<name>] "
                            "function) or reward_model = \"<stage>\" (an earlier stage that trained a reward model)")
        if o.reward_weights is not None and len(o.reward_weights) != len(o.reward):
            problems.append(f"reward_weights: has {len(o.reward_weights)} weights for {len(o.reward)} rewards; "
                            "give one weight per name in 'reward'")
        if o.reward_model is not None:
            source = next((s for s in plan.stages if s.name == o.reward_model), None)
            if source is not None and source.trains_policy:
                problems.append(f"reward_model: stage {o.reward_model!r} (trainer '{source.trainer.name}') trains "
                                "the policy, not a reward model; name a stage with trainer = \"reward\"")
        if o.max_new_tokens >= o.max_length:
            problems.append(f"max_new_tokens: {o.max_new_tokens} leaves no room for the prompt within "
                            f"max_length = {o.max_length}")
        return problems

    def train(self, ctx):
        import torch
        from accelerate import Accelerator
        from accelerate.utils import set_seed
        from peft import PeftModel
        from transformers import GenerationConfig, Trainer, TrainingArguments, get_scheduler
        from trl.trainer.utils import entropy_from_logits, selective_log_softmax

        with warnings.catch_warnings():  # "trl.experimental is unstable": this helper is plain
            warnings.simplefilter("ignore")
            from trl.experimental.utils import first_true_indices

        from . import _ppo
        from ftcore_plugins.trainers._callbacks import GracefulStop, StabilityGuard
        from ftcore_plugins.common.chat import stop_token_ids

        o, tok, stage = self.options, ctx.tokenizer, ctx.stage
        set_seed(ctx.seed)
        # The optimizer's settings as transformers resolves an ``optim`` name; built before the
        # Accelerator, since TrainingArguments resets accelerate's shared state.
        args = TrainingArguments(output_dir=str(ctx.checkpoint_dir), **optimizer_arguments(o.optimizer),
                                 learning_rate=o.learning_rate,
                                 weight_decay=o.weight_decay, report_to="none")
        mixed = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}[resolve_precision(o.precision)]
        accelerator = Accelerator(mixed_precision=mixed, gradient_accumulation_steps=o.gradient_accumulation_steps)
        device = accelerator.device

        # Prompts, tokenized once; too long for max_length with the completion: dropped and counted.
        texts = _ppo.prompt_texts(ctx.train_data, tok, ctx.template, stage)
        encoded = tok(texts, add_special_tokens=False)["input_ids"]
        limit = o.max_length - o.max_new_tokens
        prompts = [(t, ids) for t, ids in zip(texts, encoded) if 0 < len(ids) <= limit]
        ctx.reporter.data_report(f"{stage}/train", {"prompts": len(texts), "kept": len(prompts),
                                                    "dropped_too_long": len(texts) - len(prompts)})
        if not prompts:
            raise FtcoreError(f"stage {stage}: no prompt fits max_length = {o.max_length} with max_new_tokens = "
                              f"{o.max_new_tokens}; raise max_length")

        # Rollout = batch_size x gradient_accumulation_steps x num_mini_batches (TRL's convention): each
        # mini-batch is one optimizer step, accumulated over micro-batches of batch_size.
        micro, mini = o.batch_size, o.batch_size * o.gradient_accumulation_steps
        rollout = mini * o.num_mini_batches
        episodes = o.total_episodes or math.ceil(o.epochs * len(prompts))
        steps = o.max_steps if o.max_steps > 0 else max(1, math.ceil(episodes / rollout))
        updates = steps * o.ppo_epochs * o.num_mini_batches

        policy = ctx.model
        # The router's auxiliary loss by the stage's router_aux_loss_coef (_router.py), before the reference copy.
        router_coef, restore_router = apply_router_aux(ctx, o)
        saved_dropout = {m: m.p for m in policy.modules() if isinstance(m, torch.nn.Dropout)}
        for m in saved_dropout:  # dropout would make the rollout's log-probs disagree with the update's
            m.p = 0.0
        # The reference: the adapter-disabled base when this stage's adapter starts fresh, else a frozen
        # copy of the policy as it is now (made before a checkpoint is loaded into the policy).
        peft_reference = isinstance(policy, PeftModel) and not ctx.continues_adapter
        reference = None if peft_reference else _ppo.frozen_copy(policy)
        if o.gradient_checkpointing:
            policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model = _ppo.policy_and_value(policy, router_logits=router_coef > 0)

        build = getattr(ctx.adapter, "optimizer", None)  # an adapter with its own optimizer (loraplus)
        if build is not None:
            optimizer = build(model, args)
        else:
            cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)
            params = [p for p in model.parameters() if p.requires_grad]
            optimizer = cls([{"params": [p for p in params if p.ndim >= 2], "weight_decay": o.weight_decay},
                             {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}], **kwargs)
        scheduler = get_scheduler(o.lr_scheduler, optimizer, num_warmup_steps=o.warmup_steps or math.ceil(o.warmup_ratio * updates),
                                  num_training_steps=updates)
        model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
        unwrapped = accelerator.unwrap_model(model)
        if reference is not None:
            reference.to(device)
        ctx.reporter.log(stage, trainable_counts(unwrapped), step=0)

        kl_ctl = (_ppo.AdaptiveKLController(o.kl_coef, o.target_kl, o.kl_horizon) if o.kl_controller == "adaptive"
                  else _ppo.FixedKLController(o.kl_coef))
        state = {"step": 0, "kl_coef": kl_ctl.state_dict(), "reward_history": [], "kl_history": [], "seconds": 0.0}
        if ctx.resume_from is not None:
            state = _ppo.load_checkpoint(ctx.resume_from, unwrapped, optimizer, scheduler)
            kl_ctl.load_state_dict(state["kl_coef"])
            ctx.reporter.info(f"stage {stage}: resumed PPO at step {state['step']} of {steps}")

        if o.reward_model is not None:
            reward_model = _ppo.RewardModel(ctx.outputs[o.reward_model], device, stage, o.reward_model)
        functions = [ctx.rewards[name] for name in o.reward]
        weights = o.reward_weights or [1.0] * len(functions)
        stops = stop_token_ids(tok, ctx.template)
        pad_id = tok.pad_token_id if tok.pad_token_id is not None else stops[0]
        generation = GenerationConfig(do_sample=True, temperature=o.temperature, top_k=0, top_p=1.0,
                                      max_new_tokens=o.max_new_tokens, eos_token_id=stops, pad_token_id=pad_id)
        stop_tensor = torch.tensor(stops, device=device)
        length = o.max_new_tokens

        def batch_for(step: int) -> list[tuple[str, list[int]]]:
            """The prompts of a step: a seeded shuffle per pass over the data, so a resumed run draws
            the same ones without saved sampler state."""
            out = []
            for k in range(step * rollout, (step + 1) * rollout):
                epoch, i = divmod(k, len(prompts))
                order = torch.randperm(len(prompts), generator=torch.Generator().manual_seed(ctx.seed + epoch))
                out.append(prompts[int(order[i])])
            return out

        def left_pad(rows: list[list[int]]):
            width = max(map(len, rows))
            ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
            mask = torch.zeros((len(rows), width), dtype=torch.long)
            for r, row in enumerate(rows):
                ids[r, width - len(row):] = torch.tensor(row)
                mask[r, width - len(row):] = 1
            return ids.to(device), mask.to(device)

        def log_probs(logits, tokens):
            return selective_log_softmax(logits / o.temperature, tokens)

        window: dict[str, list[float]] = {}  # metric -> [weighted sum, weight] since the last log

        def add(name: str, value: float, weight: float = 1.0) -> None:
            total = window.setdefault(name, [0.0, 0.0])
            total[0] += value * weight
            total[1] += weight

        guard = StabilityGuard(ctx.reporter, stage, nan=o.guard_nan, max_grad_norm=o.guard_max_grad_norm)
        update = state["step"] * o.ppo_epochs * o.num_mini_batches  # optimizer steps so far
        start = time.perf_counter() - state["seconds"]
        with ctx.reporter.progress(f"train {stage}", steps) as bar, GracefulStop(
                stage, ctx.checkpoint_dir, getattr(getattr(ctx.run, "plan", None), "path", None)) as stop:
            bar.update(completed=state["step"])
            while state["step"] < steps:
                step = state["step"]
                batch = batch_for(step)
                query, query_mask = left_pad([ids for _, ids in batch])
                width = query.shape[1]

                # -- rollout: sample completions, score them, and record log-probs and values ------------
                unwrapped.eval()
                with torch.no_grad(), accelerator.autocast():
                    chunks = []
                    for s in range(0, rollout, micro):
                        out = unwrapped.policy.generate(input_ids=query[s:s + micro],
                                                        attention_mask=query_mask[s:s + micro],
                                                        generation_config=generation)[:, width:]
                        chunks.append(torch.nn.functional.pad(out, (0, length - out.shape[1]), value=pad_id))
                    response = torch.cat(chunks)
                    end = first_true_indices(torch.isin(response, stop_tensor))  # first stop token, or length
                    response_mask = (torch.arange(length, device=device)[None] <= end[:, None]).long()
                    response = response.masked_fill(response_mask == 0, pad_id)
                    input_ids = torch.cat([query, response], 1)
                    attention = torch.cat([query_mask, response_mask], 1)

                    old_logprobs, ref_logprobs, old_values, entropy = [], [], [], []
                    for s in range(0, rollout, micro):
                        logits, values = model(input_ids[s:s + micro], attention[s:s + micro], length)
                        old_logprobs.append(log_probs(logits, response[s:s + micro]))
                        entropy.append(entropy_from_logits(logits / o.temperature))
                        old_values.append(values.float())
                        if reference is None:
                            with unwrapped.policy.disable_adapter():
                                ref = _ppo.reference_logits(unwrapped.policy, input_ids[s:s + micro],
                                                            attention[s:s + micro], length)
                        else:
                            ref = _ppo.reference_logits(reference, input_ids[s:s + micro],
                                                        attention[s:s + micro], length)
                        ref_logprobs.append(log_probs(ref, response[s:s + micro]))
                    old_logprobs, ref_logprobs = torch.cat(old_logprobs).float(), torch.cat(ref_logprobs).float()
                    old_values, entropy = torch.cat(old_values), torch.cat(entropy).float()

                mask = response_mask.float()
                has_stop = end < length
                completions = tok.batch_decode([r[:min(int(e), length)] for r, e in zip(response, end)],
                                               skip_special_tokens=True)
                if o.reward_model is not None:
                    full = [tok.decode(q[m.bool()]) + tok.decode(r[rm.bool()])
                            for q, m, r, rm in zip(query, query_mask, response, response_mask)]
                    scores = torch.tensor(reward_model.score(full, micro), device=device)
                else:
                    scores = torch.zeros(rollout, device=device)
                    for fn, w in zip(functions, weights):
                        scores += w * torch.tensor(fn.score([t for t, _ in batch], completions),
                                                   dtype=torch.float, device=device)
                if o.missing_eos_penalty is not None:
                    scores = scores - o.missing_eos_penalty * (~has_stop).float()

                # Per-token reward: the KL penalty on every token, the score on the last one.
                kl = (old_logprobs - ref_logprobs) * mask
                rewards = -kl_ctl.value * kl
                last = end.clamp(max=length - 1)
                rewards[torch.arange(rollout, device=device), last] += scores
                advantages, returns = _ppo.gae(rewards, old_values, mask, o.gamma, o.lam)
                if o.whiten_advantages:
                    advantages = _ppo.masked_whiten(advantages, mask)

                sequence_kl = kl.sum(1).mean().item()
                raw_scores = scores + (o.missing_eos_penalty or 0.0) * (~has_stop).float()
                add("reward/mean", raw_scores.mean().item(), rollout)
                add("reward/score", scores.mean().item(), rollout)
                add("kl", sequence_kl, rollout)
                add("entropy", ((entropy * mask).sum() / mask.sum()).item(), mask.sum().item())
                add("completion_length", mask.sum(1).mean().item(), rollout)
                add("completion_stopped", has_stop.float().mean().item(), rollout)

                # -- PPO updates: ppo_epochs passes over the rollout in shuffled mini-batches --------------
                unwrapped.train()
                for _ in range(o.ppo_epochs):
                    order = torch.randperm(rollout, device=device)
                    for m in range(0, rollout, mini):
                        update += 1
                        minibatch_loss = 0.0
                        for s in range(m, m + mini, micro):
                            idx = order[s:s + micro]
                            with accelerator.accumulate(model), accelerator.autocast():
                                logits, values = model(input_ids[idx], attention[idx], length)
                                new_logprobs = log_probs(logits, response[idx]).float()
                                pg_loss, pg_clip = _ppo.policy_loss(new_logprobs, old_logprobs[idx],
                                                                    advantages[idx], mask[idx], o.cliprange)
                                vf_loss, vf_clip = _ppo.value_loss(values.float(), old_values[idx], returns[idx],
                                                                   mask[idx], o.cliprange_value)
                                loss = pg_loss + o.vf_coef * vf_loss
                                aux = unwrapped.aux_loss if router_coef else None
                                if aux is not None:
                                    loss = loss + router_coef * aux
                                accelerator.backward(loss)
                                minibatch_loss += loss.item() / o.gradient_accumulation_steps
                                if accelerator.sync_gradients:
                                    norm = accelerator.clip_grad_norm_(model.parameters(), o.max_grad_norm or math.inf)
                                    if guard.check(update, minibatch_loss, float(norm)):
                                        optimizer.zero_grad()  # a NaN step (guard_nan = "skip") changes nothing
                                optimizer.step()
                                scheduler.step()
                                optimizer.zero_grad()
                            tokens = mask[idx].sum().item()
                            add("loss/policy", pg_loss.item(), tokens)
                            add("loss/value", vf_loss.item(), tokens)
                            add("policy/clip_fraction", pg_clip.item(), tokens)
                            add("value/clip_fraction", vf_clip.item(), tokens)
                            if aux is not None:
                                add("aux_loss", aux.item(), tokens)
                kl_ctl.update(sequence_kl, rollout)

                state["step"] = step = step + 1
                state["reward_history"].append(raw_scores.mean().item())
                state["kl_history"].append(sequence_kl)
                state["seconds"] = time.perf_counter() - start
                state["kl_coef"] = kl_ctl.state_dict()
                if step % o.logging_steps == 0 or step == steps:
                    logged = {k: s / w for k, (s, w) in window.items() if w}
                    logged.update({"kl_coef": kl_ctl.value, "lr": scheduler.get_last_lr()[0], "episodes": step * rollout})
                    ctx.reporter.log(stage, logged, step=step)
                    window.clear()
                bar.update(completed=step, note=f"reward {state['reward_history'][-1]:.3f} kl {sequence_kl:.3f}")
                stopping = stop.requested  # SIGINT/SIGTERM: save this step, then stop
                if (step % o.save_steps == 0 and step < steps) or stopping:
                    folder = ctx.checkpoint_dir / f"checkpoint-{step}"
                    if accelerator.is_main_process:
                        _ppo.save_checkpoint(folder, unwrapped, optimizer, scheduler, state, o.save_total_limit)
                    accelerator.wait_for_everyone()
                    if stopping:
                        raise stop.interrupted(stage, step, folder, ctx.run.plan.path)

        for m, p in saved_dropout.items():
            m.p = p
        restore_router()
        ctx.model = unwrapped.policy  # the runner saves the causal LM with the stage's adapter
        history = state["reward_history"]
        first = max(1, len(history) // 10)  # the first and last tenth of the run
        return {"reward_first": sum(history[:first]) / first, "reward_last": sum(history[-first:]) / first,
                "kl_last": sum(state["kl_history"][-first:]) / first, "global_step": state["step"],
                "episodes": state["step"] * rollout, "train_seconds": state["seconds"],
                **trainable_counts(ctx.model), **guard.counts()}


@ftcore.hookimpl
def register_trainers(register):
    register(PPOTrainer)
