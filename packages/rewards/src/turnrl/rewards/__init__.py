"""turnrl-rewards: tau-bench, math and ReTool rewards, overlong penalty, batched scoring."""

__version__ = "0.1.0"
