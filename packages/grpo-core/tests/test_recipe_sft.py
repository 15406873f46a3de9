"""The shared SFT stage (turnrl.grpo_core.recipe.sft) on the tiny model: phases in order,
a phase of 0 steps skipped, the learning rate set per step, probes only where a phase asks,
every step's metrics handed on, and a phase with nothing to train on refused."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from rich.console import Console
from transformers import AutoTokenizer

from turnrl.grpo_core.recipe.sft import LOSS_WINDOW, SFTPhase, run_sft_stage
from turnrl.grpo_core.training.sft import SFTStop, build_sft_example
from turnrl.grpo_core.training.tiny_model import build_tiny_model, sample_chat
from turnrl.grpo_core.training.torch_engine import OptimizerConfig, TorchEngine, TorchEngineConfig


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


def _engine(tiny: Path) -> TorchEngine:
    config = TorchEngineConfig(
        model_path=str(tiny), optimizer=OptimizerConfig(lr=1.0, weight_decay=0.0)
    )
    return TorchEngine(config)


def test_phases_run_in_order_with_the_scheduled_lr_and_probes_where_asked(tiny: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny)
    short = [build_sft_example(tok, sample_chat(seed=s, num_turns=1)) for s in range(3)]
    long = [build_sft_example(tok, sample_chat(seed=s, num_turns=2)) for s in range(3, 7)]
    engine = _engine(tiny)
    lrs: list[float] = []
    seen: list[tuple[int, dict[str, float]]] = []

    def lr(step: int) -> float:
        lrs.append(1e-3 / (step + 1))
        return lrs[-1]

    def on_step(step: int, metrics: dict[str, float]) -> None:
        seen.append((step, metrics))
        assert engine.optimizer.param_groups[0]["lr"] == lrs[-1]  # set before the step

    # The probe chat is never reproduced by a barely trained model: the stage runs out.
    stop = SFTStop(long[:1], tok.pad_token_id, target=1.0, interval=2)
    out = io.StringIO()
    result = run_sft_stage(
        engine,
        [SFTPhase(3, short, 2, probe=False), SFTPhase(0, short, 2), SFTPhase(4, long, 2)],
        pad_id=tok.pad_token_id,
        seed=0,
        lr=lr,
        stop=stop,
        console=Console(file=out, width=120),
        on_step=on_step,
    )
    assert result.steps == 7 == engine.step and result.stop == "all steps done"
    assert [s for s, _ in seen] == list(range(1, 8))
    assert all(m["sft/loss"] > 0 for _, m in seen)
    # Probes at the 2nd and 4th step of the last phase only, counted over the stage.
    assert [s for s, m in seen if "sft/probe" in m] == [5, 7]
    assert [s for s, _ in result.probes] == [5, 7]
    record = result.record()
    assert record["steps"] == 7 and record["loss_last"] == seen[-1][1]["sft/loss"]
    assert "SFT stopped after 7 steps: all steps done" in out.getvalue()
    assert "SFT step 5: 0.00 of 1 probe conversations reproduced" in out.getvalue()


def test_the_stop_ends_the_stage_early(tiny: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny)
    examples = [build_sft_example(tok, sample_chat(seed=s, num_turns=1)) for s in range(2)]
    stop = SFTStop(max_seconds=1e-9)
    phases = [SFTPhase(5, examples, 2), SFTPhase(5, examples, 2)]
    result = run_sft_stage(
        _engine(tiny), phases, pad_id=tok.pad_token_id, seed=0, lr=lambda _: 1e-3, stop=stop
    )
    assert result.steps == 1 and result.stop.startswith("time bound")


def test_a_requested_stop_ends_the_stage_at_its_next_step(tiny: Path) -> None:
    """A Ctrl-C the interpreter swallowed (``supervise.stop_requested`` set by the run's
    handler) stops SFT before its next step, as KeyboardInterrupt."""
    from turnrl.npu_runtime.supervise import stop_requested

    tok = AutoTokenizer.from_pretrained(tiny)
    examples = [build_sft_example(tok, sample_chat(seed=s, num_turns=1)) for s in range(2)]
    lost: list[int] = []

    def on_step(step: int, metrics: dict[str, float]) -> None:
        lost.append(step)
        stop_requested.set()

    try:
        with pytest.raises(KeyboardInterrupt):
            run_sft_stage(
                _engine(tiny),
                [SFTPhase(5, examples, 2)],
                pad_id=tok.pad_token_id,
                seed=0,
                lr=lambda _: 1e-3,
                on_step=on_step,
            )
    finally:
        stop_requested.clear()
    assert lost == [1]


def test_a_phase_ends_at_its_stop_loss_and_the_next_one_runs(tiny: Path) -> None:
    """A phase's ``stop_loss`` ends it once the mean of its last ``LOSS_WINDOW`` losses is
    at or below it (its ``steps`` the most); one it never reaches runs every step."""
    tok = AutoTokenizer.from_pretrained(tiny)
    examples = [build_sft_example(tok, sample_chat(seed=s, num_turns=1)) for s in range(2)]
    out = io.StringIO()
    phases = [
        SFTPhase(LOSS_WINDOW + 30, examples, 2, probe=False, stop_loss=100.0),
        SFTPhase(LOSS_WINDOW + 1, examples, 2, probe=False, stop_loss=1e-9),
        SFTPhase(2, examples, 2),
    ]
    result = run_sft_stage(
        _engine(tiny),
        phases,
        pad_id=tok.pad_token_id,
        seed=0,
        lr=lambda _: 1e-4,
        console=Console(file=out, width=200),
    )
    assert result.phase_steps == [LOSS_WINDOW, LOSS_WINDOW + 1, 2]
    assert result.steps == 2 * LOSS_WINDOW + 3 and result.stop == "all steps done"
    assert result.record()["phase_steps"] == result.phase_steps
    assert f"SFT phase 1 ended after {LOSS_WINDOW} of {LOSS_WINDOW + 30} steps" in out.getvalue()
    assert "SFT phase 2 ended" not in out.getvalue()


def test_a_phase_with_nothing_to_train_on_is_refused_before_any_step(tiny: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny)
    good = build_sft_example(tok, sample_chat(seed=1, num_turns=1))
    empty = build_sft_example(tok, sample_chat(seed=1, num_turns=1), max_length=5)
    assert not any(empty.loss_mask)
    engine = _engine(tiny)
    phases = [SFTPhase(2, [good], 1), SFTPhase(2, [empty], 1)]
    with pytest.raises(ValueError, match="no example with an assistant token"):
        run_sft_stage(engine, phases, pad_id=tok.pad_token_id, seed=0, lr=lambda _: 1e-3)
    assert engine.step == 0
    # A phase of 0 steps is skipped, whatever it holds.
    result = run_sft_stage(
        engine, [SFTPhase(0, [empty], 1)], pad_id=tok.pad_token_id, seed=0, lr=lambda _: 1e-3
    )
    assert result.steps == 0 and result.record()["loss_last"] is None


def test_train_sft_runs_the_configured_stage_and_exports_it(tiny: Path, tmp_path: Path) -> None:
    """``train_sft``: the first phases then ``num_steps``, the learning rate warmed up and
    decayed over all of them (cosine to ``min_lr_ratio``), the model and its record
    exported."""
    from dataclasses import dataclass, field

    from turnrl.grpo_core.recipe.schema import ModelConfig
    from turnrl.grpo_core.recipe.sft import SFT_DONE, SFTStageConfig, train_sft

    @dataclass
    class App:
        seed: int = 0
        model: ModelConfig = field(default_factory=ModelConfig)
        sft: SFTStageConfig = field(
            default_factory=lambda: SFTStageConfig(
                num_steps=3, global_batch_size=2, micro_batch_size=1, lr=1e-3
            )
        )

    app = App()
    app.sft.lr_decay, app.sft.warmup_steps, app.sft.min_lr_ratio = "cosine", 2, 0.5
    tok = AutoTokenizer.from_pretrained(tiny)
    examples = [build_sft_example(tok, sample_chat(seed=s, num_turns=1)) for s in range(3)]
    seen: list[tuple[int, float]] = []
    record = train_sft(
        app,
        tiny,
        examples,
        [],
        tmp_path / "sft",
        pad_id=tok.pad_token_id,
        first=[SFTPhase(2, examples, 2, probe=False)],
        on_step=lambda step, m: seen.append((step, m["sft/loss"])),
    )
    assert [s for s, _ in seen] == [1, 2, 3, 4, 5] and record["steps"] == 5
    assert json.loads((tmp_path / "sft" / SFT_DONE).read_text()) == record
    assert (tmp_path / "sft" / "config.json").is_file()
    assert not SFTStageConfig(enabled=False).runs and not SFTStageConfig(num_steps=0).runs
    with pytest.raises(ValueError, match="--sft-lr-decay must be constant or cosine"):
        SFTStageConfig(lr_decay="linear")
    with pytest.raises(ValueError, match="--sft-probe-target"):
        SFTStageConfig(probe_target=2.0)
    for bad in ({"prefix_steps": -1}, {"prefix_loss": -0.1}):
        with pytest.raises(ValueError, match="--sft-prefix-steps and --sft-prefix-loss"):
            SFTStageConfig(**bad)  # type: ignore[arg-type]
    for bad in ({"prefix_turns": 0}, {"prefix_batch_size": 0}):
        with pytest.raises(ValueError, match=r"prefix_turns and sft\.prefix_batch_size"):
            SFTStageConfig(**bad)  # type: ignore[arg-type]


def test_train_sft_on_chats_renders_cuts_and_runs_the_prefix_phase_first(
    tiny: Path, tmp_path: Path
) -> None:
    """``train_sft_on_chats``: conversations rendered with the model's template, cut at
    ``parallel.seq_length`` tokens, the ``sft.prefix_steps`` phase on their short prefixes
    before the main one, the run described on the console."""
    from dataclasses import dataclass, field

    from turnrl.grpo_core.recipe.schema import ModelConfig, ParallelConfig
    from turnrl.grpo_core.recipe.sft import SFTStageConfig, train_sft_on_chats

    @dataclass
    class App:
        seed: int = 0
        model: ModelConfig = field(default_factory=ModelConfig)
        parallel: ParallelConfig = field(default_factory=lambda: ParallelConfig(seq_length=48))
        sft: SFTStageConfig = field(
            default_factory=lambda: SFTStageConfig(
                num_steps=2, global_batch_size=2, lr=1e-3, prefix_steps=3, prefix_batch_size=4
            )
        )

    chats = [sample_chat(seed=s, num_turns=2) for s in range(4)]
    out = io.StringIO()
    tokens: list[float] = []
    record = train_sft_on_chats(
        App(),
        tiny,
        chats,
        chats[:1],
        tmp_path / "sft",
        console=Console(file=out, width=200),
        on_step=lambda step, m: tokens.append(m.get("sft/tokens", 0.0)),
    )
    assert record["steps"] == 5 and len(tokens) == 5
    text = out.getvalue()
    assert "SFT: 4 conversations" in text and "3 steps x 4 (prefixes) + 2 steps x 2" in text
    tok = AutoTokenizer.from_pretrained(tiny)
    full = max(len(build_sft_example(tok, c).input_ids) for c in chats)
    assert full > 48  # so the cut is what keeps every example within seq_length
    mean = float(text.split(" tokens on average")[0].rsplit(", ", 1)[1])
    assert mean <= 48


def test_a_chat_prefix_ends_after_the_nth_assistant_turn() -> None:
    from turnrl.grpo_core.recipe.sft import chat_prefix

    chat = [
        {"role": "system", "content": "s"},
        *[{"role": r, "content": f"{r}{i}"} for i in range(3) for r in ("user", "assistant")],
    ]
    assert chat_prefix(chat, 2) == chat[:5] and chat_prefix(chat, 2)[-1]["content"] == "assistant1"
    assert chat_prefix(chat, 99) == chat and chat_prefix(chat, 99) is not chat
