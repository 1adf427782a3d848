"""Experiment trackers: where a run's metrics are sent as it goes (TensorBoard, MLflow, Weights & Biases)."""
