"""Reward functions for the online trainers (GRPO, RLOO, PPO)."""
