"""Exporters: where a trained model is written so that other tools can load it."""
