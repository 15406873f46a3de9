"""What a run shows while it runs and after: the step logger and ``turnrl-grpo report``.

- :mod:`~turnrl.grpo_core.observe.logger`: :class:`StepLogger` (console line, progress,
  ``metrics.jsonl``, TensorBoard, sample dumps).
- :mod:`~turnrl.grpo_core.observe.trackers`: experiment trackers for the step logger (W&B,
  MLflow, SwanLab; offline / local by default), named as verl's ``trainer.logger`` list.
- :mod:`~turnrl.grpo_core.observe.report`: reads a run folder back (tables, PNG curves).
"""
