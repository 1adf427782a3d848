"""Trainers: one per ``[[stage]]`` kind (pre-training, SFT, DPO, KTO, ORPO, reward modelling, GRPO, RLOO, PPO), with the training loop machinery they share."""
