"""Evaluators: what is measured before, between and after the stages."""
