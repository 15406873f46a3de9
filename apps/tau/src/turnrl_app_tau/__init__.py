"""turnrl's tau-bench app: GRPO training and pass^k evaluation of a customer-service agent."""

__version__ = "0.1.0"
