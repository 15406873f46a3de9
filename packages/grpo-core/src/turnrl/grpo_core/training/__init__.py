"""Training side of turnrl-grpo-core: tiny test models, the torch engine, SFT."""
