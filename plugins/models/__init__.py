"""Model loaders: where the base model and its tokenizer come from (a Hugging Face folder or id, or a config with random weights)."""
