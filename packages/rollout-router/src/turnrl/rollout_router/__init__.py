"""turnrl-rollout-router: inference engines as servers, token-in/token-out clients and routing."""

__version__ = "0.1.0"
