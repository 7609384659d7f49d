"""Framework integrations, each importing its framework only when it is imported itself:
``jitckpt.integrations.transformers`` (Hugging Face ``Trainer``)."""
