"""Ascend environment defaults: documented, applied without overriding the user."""

from __future__ import annotations

import os
import sys
import time

import pytest

from turnrl.npu_runtime.ascend_env import (
    ASCEND_ENV_DEFAULTS,
    CONFLICTING_ENV_VARS,
    apply_ascend_env,
    ascend_env_defaults,
    remove_conflicting_env,
)
from turnrl.npu_runtime.supervise import start_process


def test_defaults_cover_the_validated_script_and_are_documented():
    values = ascend_env_defaults()
    # The values the validated tau-bench NPU script exports.
    assert values["HCCL_HOST_SOCKET_PORT_RANGE"] == "60000-60050"
    assert values["HCCL_NPU_SOCKET_PORT_RANGE"] == "61000-61050"
    assert values["VLLM_ASCEND_ENABLE_NZ"] == "0"
    assert values["RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES"] == "1"
    for name in ("HCCL_CONNECT_TIMEOUT", "TASK_QUEUE_ENABLE"):
        assert name in values
    for name, default in ASCEND_ENV_DEFAULTS.items():
        assert default.why.strip(), f"{name} has no explanation"
        assert name.isupper() and "=" not in name


def test_apply_sets_only_what_is_missing():
    env = {"HCCL_CONNECT_TIMEOUT": "60", "PATH": "/bin"}
    changed = apply_ascend_env(env=env)
    assert "HCCL_CONNECT_TIMEOUT" not in changed
    assert env["HCCL_CONNECT_TIMEOUT"] == "60"  # the user's value wins
    assert env["PATH"] == "/bin"
    expected = {k: v for k, v in ascend_env_defaults().items() if k != "HCCL_CONNECT_TIMEOUT"}
    assert changed == expected
    assert apply_ascend_env(env=env) == {}  # second call: nothing left to set


def test_force_replaces_user_values():
    env = {"HCCL_CONNECT_TIMEOUT": "60", "VLLM_ASCEND_ENABLE_NZ": "0"}
    changed = apply_ascend_env(env=env, force=True)
    assert env["HCCL_CONNECT_TIMEOUT"] == ASCEND_ENV_DEFAULTS["HCCL_CONNECT_TIMEOUT"].value
    assert changed["HCCL_CONNECT_TIMEOUT"] == env["HCCL_CONNECT_TIMEOUT"]
    assert "VLLM_ASCEND_ENABLE_NZ" not in changed  # already that value: not a change


def test_overrides_replace_add_and_drop():
    env: dict[str, str] = {}
    changed = apply_ascend_env(
        {"HCCL_CONNECT_TIMEOUT": "3600", "DISABLE_L2_CACHE": None, "MY_VAR": "x"}, env=env
    )
    assert env["HCCL_CONNECT_TIMEOUT"] == "3600"
    assert "DISABLE_L2_CACHE" not in env and "DISABLE_L2_CACHE" not in changed
    assert env["MY_VAR"] == changed["MY_VAR"] == "x"
    assert "DISABLE_L2_CACHE" in ASCEND_ENV_DEFAULTS  # the defaults themselves are untouched


@pytest.mark.parametrize(
    ("overrides", "match"),
    [({"": "1"}, "name"), ({"A=B": "1"}, "name"), ({"HCCL_CONNECT_TIMEOUT": 60}, "string")],
)
def test_bad_overrides(overrides, match):
    with pytest.raises(ValueError, match=match):
        apply_ascend_env(overrides, env={})


def test_apply_to_os_environ_by_default(monkeypatch):
    for name in ASCEND_ENV_DEFAULTS:
        monkeypatch.setenv(name, "placeholder")  # so monkeypatch restores the original state
        monkeypatch.delenv(name)
    monkeypatch.setenv("TASK_QUEUE_ENABLE", "2")
    changed = apply_ascend_env()
    assert os.environ["VLLM_ASCEND_ENABLE_NZ"] == "0"
    assert os.environ["TASK_QUEUE_ENABLE"] == "2"
    assert set(changed) == set(ASCEND_ENV_DEFAULTS) - {"TASK_QUEUE_ENABLE"}


def test_remove_conflicting_env():
    env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "KEEP": "1"}
    assert remove_conflicting_env(env) == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert env == {"KEEP": "1"}
    assert remove_conflicting_env(env) == {}
    assert "PYTORCH_ALLOC_CONF" in CONFLICTING_ENV_VARS


def test_a_child_process_sees_the_defaults(tmp_path):
    env: dict[str, str] = {}
    apply_ascend_env({"HCCL_CONNECT_TIMEOUT": "42"}, env=env)
    script = (
        "import os; print(os.environ['HCCL_CONNECT_TIMEOUT'], os.environ['VLLM_ASCEND_ENABLE_NZ'])"
    )
    proc = start_process(
        [sys.executable, "-c", script], name="env", log_path=tmp_path / "e.log", env=env
    )
    deadline = time.monotonic() + 20
    while proc.alive and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.stop() == 0
    assert proc.tail(1) == "42 0"
