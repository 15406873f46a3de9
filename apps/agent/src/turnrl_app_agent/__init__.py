"""turnrl's agent app: GRPO training of any agent program through the agent gateway."""

__version__ = "0.1.0"
