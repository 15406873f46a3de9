"""Test support, named as such: production code never imports it.

- :mod:`~turnrl.grpo_core.testing.golden`: the seeded toy GRPO task, its golden loss curve
  and the pieces resume and Ray tests reuse.
- :mod:`~turnrl.grpo_core.testing.smoke`: ``python -m turnrl.grpo_core.testing.smoke``, a
  few real GRPO steps with a tiny model on this machine's device (``ci/device_smoke.sh``).
"""
