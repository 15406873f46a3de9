"""Command line of the ReTool app: a preset, then flags that override it.

    uv run apps/retool                                  # cpu-default
    uv run apps/retool --smoke                          # seconds per stage (CI)
    uv run apps/retool --preset qwen3-4b-npu --hf-checkpoint /models/Qwen3-4B-Instruct-2507 \\
        --sft-data retool_sft.parquet --train-data dapo-math-17k.parquet --val-data aime_2025.jsonl
    uv run apps/retool --sandbox-url http://sandbox:8080   # an external SandboxFusion server
    uv run apps/retool --resume --run-dir runs/retool-X     # continue an interrupted run

Flag names follow slime/verl where one exists (``--num-rollout``, ``--rollout-batch-size``,
``--n-samples-per-prompt``, ``--global-batch-size``, ``--eps-clip``, ``--eps-clip-high``,
``--use-kl-loss``, ``--kl-loss-coef``, ``--entropy-coef``, ``--lr``, ...).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from turnrl.grpo_core.recipe.run_folder import config_from_dict, read_run_config
from turnrl_app_retool.config import PRESETS, RetoolAppConfig, preset

# flag -> (section, field, type); None section means a top-level field.
_OVERRIDES: dict[str, tuple[str | None, str, type]] = {
    "--hf-checkpoint": ("model", "hf_checkpoint", str),
    "--torch-threads": ("model", "torch_threads", int),
    "--sft-data": ("data", "sft_path", str),
    "--train-data": ("data", "train_path", str),
    "--num-sft-chats": ("data", "num_sft_chats", int),
    "--num-train-problems": ("data", "num_train_problems", int),
    "--num-val-problems": ("data", "num_val_problems", int),
    "--sft-steps": ("sft", "num_steps", int),
    "--sft-lr": ("sft", "lr", float),
    "--sft-global-batch-size": ("sft", "global_batch_size", int),
    "--sft-lr-decay": ("sft", "lr_decay", str),
    "--sft-probe-target": ("sft", "probe_target", float),
    "--sft-probe-interval": ("sft", "probe_interval", int),
    "--sft-max-seconds": ("sft", "max_seconds", float),
    "--num-rollout": ("rl", "num_rollout", int),
    "--eval-interval": ("rl", "eval_interval", int),
    "--save-interval": ("rl", "save_interval", int),
    "--rollout-batch-size": ("rl", "rollout_batch_size", int),
    "--n-samples-per-prompt": ("rl", "n_samples_per_prompt", int),
    "--global-batch-size": ("rl", "global_batch_size", int),
    "--micro-batch-size": ("rl", "micro_batch_size", int),
    "--advantage-estimator": ("rl", "advantage_estimator", str),
    "--lr": ("rl", "lr", float),
    "--eps-clip": ("rl", "eps_clip", float),
    "--eps-clip-high": ("rl", "eps_clip_high", float),
    "--kl-loss-coef": ("rl", "kl_loss_coef", float),
    "--entropy-coef": ("rl", "entropy_coef", float),
    "--rollout-temperature": ("rl", "temperature", float),
    "--max-turns": ("rl", "max_turns", int),
    "--max-response-length": ("rl", "max_response_length", int),
    "--filter-metric": ("rl", "filter_metric", str),
    "--gen-batch-size": ("rl", "gen_batch_size", int),
    "--max-num-gen-batches": ("rl", "max_num_gen_batches", int),
    "--overlong-buffer-len": ("rl", "overlong_buffer_len", int),
    "--overlong-penalty-factor": ("rl", "overlong_penalty_factor", float),
    "--n-val-samples": ("eval", "n", int),
    "--max-val-problems": ("eval", "max_problems", int),
    "--sandbox-url": ("sandbox", "url", str),
    "--device": ("engine", "device", str),
    "--runner": ("engine", "runner", str),
    "--trainer-ranks": ("engine", "trainer_ranks", int),
    "--train-backend": ("engine", "train_backend", str),
    "--tensor-model-parallel-size": ("engine", "train_tensor_parallel_size", int),
    "--num-engines": ("engine", "num_engines", int),
    "--rollout-num-gpus-per-engine": ("engine", "tensor_parallel_size", int),
    "--run-dir": (None, "run_dir", str),
    "--seed": (None, "seed", int),
}


def build_parser() -> argparse.ArgumentParser:
    """The app's argument parser (every override defaults to None: keep the preset's value)."""
    parser = argparse.ArgumentParser(
        prog="uv run apps/retool",
        description="ReTool: SFT, then GRPO with a code sandbox, evaluated by mean@k and turns.",
    )
    parser.add_argument(
        "--preset",
        default=None,
        choices=sorted(PRESETS),
        help="configuration to start from (default: cpu-default)",
    )
    parser.add_argument("--smoke", action="store_true", help="shorthand for --preset smoke")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue the interrupted run in --run-dir: its config.json, then these flags",
    )
    parser.add_argument(
        "--val-data",
        action="append",
        default=None,
        metavar="FILE",
        help="AIME 2024/2025 file (repeatable); replaces the preset's",
    )
    parser.add_argument("--no-sft", action="store_true", help="skip the SFT stage")
    parser.add_argument("--no-rl", action="store_true", help="skip the RL stage")
    parser.add_argument("--use-kl-loss", action="store_true", help="add the KL loss")
    parser.add_argument(
        "--sandbox-insecure",
        action="store_true",
        help="let the embedded sandbox run code it cannot contain (not root)",
    )
    parser.add_argument(
        "--dynamic-sampling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="DAPO dynamic sampling filter on/off (default: the preset's)",
    )
    parser.add_argument(
        "--tool-schema-in-prompt",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="render the tool schema into prompts (default: the preset's)",
    )
    parser.add_argument(
        "--logger",
        default=None,
        metavar="NAMES",
        help="experiment trackers besides TensorBoard, comma-separated: wandb,mlflow,swanlab",
    )
    parser.add_argument(
        "--colocate",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="engines on the trainer ranks' devices (default: the preset's)",
    )
    parser.add_argument(
        "--print-config", action="store_true", help="print the resolved config as JSON and exit"
    )
    for flag, (section, name, kind) in _OVERRIDES.items():
        where = f"{section}.{name}" if section else name
        parser.add_argument(flag, type=kind, default=None, help=f"overrides {where}")
    return parser


def resolve(argv: Sequence[str] | None = None) -> tuple[RetoolAppConfig, argparse.Namespace]:
    """Parse ``argv`` into a validated config (preset, then overrides) and the namespace.

    Raises:
        SystemExit: bad flags (argparse) or an invalid resulting config (exit code 2).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.smoke and args.preset is not None:
        parser.error("--smoke and --preset are exclusive")
    if args.resume:
        if args.smoke or args.preset is not None:
            parser.error("--resume continues a run with its own config; drop --preset/--smoke")
        try:
            config = config_from_dict(RetoolAppConfig, read_run_config(args.run_dir))
        except (ValueError, OSError) as exc:
            parser.error(str(exc))
    else:
        config = preset("smoke" if args.smoke else args.preset or "cpu-default")
    for flag, (section, name, _kind) in _OVERRIDES.items():
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if value is not None:
            setattr(getattr(config, section) if section else config, name, value)
    if args.val_data is not None:
        config.data.val_paths = list(args.val_data)
    if args.no_sft:
        config.sft.enabled = False
    if args.sandbox_insecure:
        config.sandbox.insecure = True
    if args.no_rl:
        config.rl.enabled = False
    if args.tool_schema_in_prompt is not None:
        config.data.tool_schema_in_prompt = args.tool_schema_in_prompt
    if args.dynamic_sampling is not None:
        config.rl.dynamic_sampling = args.dynamic_sampling
    if args.logger is not None:
        config.logger = [name.strip() for name in args.logger.split(",") if name.strip()]
    if args.colocate is not None:
        config.engine.colocate = args.colocate
    if args.use_kl_loss:
        config.rl.use_kl_loss = True
    try:
        config.validate()
    except ValueError as exc:
        parser.error(str(exc))
    return config, args
