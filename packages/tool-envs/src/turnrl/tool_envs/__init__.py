"""turnrl-tool-envs: multi-turn episodes, token-exact trajectories, tau-bench environments, code sandbox."""

__version__ = "0.1.0"
