"""Chat templates: how messages become the text a model is trained on, with the characters that are trained."""
