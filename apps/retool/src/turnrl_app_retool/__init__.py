"""turnrl-app-retool: ReTool (SFT, then GRPO with a code sandbox) on turnrl."""

__version__ = "0.1.0"
