"""turnrl-grpo-core: GRPO-family algorithms, training engines and the RL loop."""

__version__ = "0.1.0"
