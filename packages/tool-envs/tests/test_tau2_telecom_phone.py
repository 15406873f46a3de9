"""The telecom user's phone (``tau2.telecom_phone``): its rules, and parity with tau2-bench.

Parity tests (skipped unless tau2-bench's code is installed, ``nox -s tau2-parity``) run
upstream's ``TelecomUserTools`` behind a plain ``Environment`` (no agent side, so no
``sync_tools``) next to ``PhoneTools`` from the same ``user_db.toml``: every distinct
user-side set-up of telecom's tasks.json, each followed by every read tool and every
user assertion; the tasks' gold user actions; a seeded walk of write tools, hidden
set-up functions and backend facts on every set-up; and bad arguments. Texts, error
flags, return values and the state hash must agree at every step.
"""

from __future__ import annotations

import copy
import json
import random
import tomllib
from pathlib import Path
from typing import Any

import pytest

from turnrl.tool_envs.tau.tau2.telecom_phone import PhoneTools, load_phone_db
from turnrl.tool_envs.tau.tau2.toolkit import ToolKind, state_hash

NUM_TASKS = 2285
NUM_USER_SETUPS = 1142  # distinct user-side initialisation sequences (assistant actions left out)
NUM_SETUP_AND_GOLD = 1150  # distinct (user set-up, gold user actions) pairs
NUM_SOLVED_BY_PHONE_ALONE = (
    321  # pairs whose own user assertions pass after the gold user actions alone
)
USER_ASSERTIONS = {  # the distinct user-side env_assertions of tasks.json
    ("assert_can_send_mms", '{"expected_status": true}', True),
    ("assert_mobile_data_status", '{"expected_status": true}', True),
    ("assert_internet_speed", '{"expected_desc": "excellent", "expected_speed": 200}', True),
    ("assert_service_status", '{"expected_status": "no_service"}', True),
    ("assert_service_status", '{"expected_status": "connected"}', True),
}
EXTRA_ASSERTIONS = [
    ("assert_airplane_mode_status", {"expected_status": True}),
    ("assert_airplane_mode_status", {"expected_status": False}),
    ("assert_service_status", {"expected_status": "searching"}),
    ("assert_service_status", {"expected_status": "emergency_only"}),
    ("assert_mobile_data_status", {"expected_status": False}),
    ("assert_mobile_roaming_status", {"expected_status": True}),
    ("assert_mobile_data_saver_mode_status", {"expected_status": True}),
    ("assert_internet_speed", {"expected_speed": 0}),
    ("assert_internet_speed", {"expected_speed": 1.5, "expected_desc": "Poor"}),
    ("assert_internet_speed", {"expected_speed": 30, "expected_desc": "good"}),
    ("assert_internet_speed", {"expected_speed": 0, "expected_desc": "no connection"}),
    ("assert_internet_not_excellent", {}),
    ("assert_can_send_mms", {"expected_status": False}),
    ("assert_mobile_data_usage_exceeded", {"expected_status": False}),
]
APP_ARGS = [{"app_name": "messaging"}, {"app_name": "browser"}, {"app_name": "camera"}]
WRITES: list[tuple[str, dict[str, Any]]] = [
    *(
        ("set_network_mode_preference", {"mode": m})
        for m in ("4g_5g_preferred", "4g_only", "3g_only", "2g_only", "5g")
    ),
    ("toggle_airplane_mode", {}),
    ("reseat_sim_card", {}),
    ("toggle_data", {}),
    ("toggle_roaming", {}),
    ("toggle_data_saver_mode", {}),
    ("set_apn_settings", {"apn_settings": {}}),
    ("set_apn_settings", {"apn_settings": {"apn_name": "broken"}}),
    ("set_apn_settings", {"apn_settings": {"apn_name": "internet", "mmsc_url": None}}),
    (
        "set_apn_settings",
        {"apn_settings": {"mms_port": "8080", "reset_at_reboot": "yes", "mms_proxy": "10.0.0.1"}},
    ),
    (
        "set_apn_settings",
        {"apn_settings": {"apn_name": "internet", "mmsc_url": "http://mms.example/x"}},
    ),
    ("reset_apn_settings", {}),
    ("toggle_wifi", {}),
    ("toggle_wifi_calling", {}),
    ("connect_vpn", {}),
    ("disconnect_vpn", {}),
    ("grant_app_permission", {"app_name": "messaging", "permission": "sms"}),
    ("grant_app_permission", {"app_name": "messaging", "permission": "STORAGE"}),
    ("grant_app_permission", {"app_name": "browser", "permission": "phone"}),
    ("grant_app_permission", {"app_name": "messaging", "permission": "camera"}),
    ("grant_app_permission", {"app_name": "camera", "permission": "sms"}),
    ("reboot_device", {}),
    ("make_payment", {}),
]
HIDDEN: list[tuple[str, dict[str, Any]]] = [
    *(
        (name, {})
        for name in (
            "turn_airplane_mode_on",
            "turn_airplane_mode_off",
            "turn_data_on",
            "turn_data_off",
        )
    ),
    *((name, {}) for name in ("turn_roaming_on", "turn_roaming_off", "turn_data_saver_mode_on")),
    *(
        (name, {})
        for name in (
            "turn_data_saver_mode_off",
            "break_vpn",
            "break_apn_settings",
            "break_apn_mms_setting",
        )
    ),
    ("unseat_sim_card", {}),
    ("simulate_network_search", {}),
    ("lock_sim_card", {"mode": "pin"}),
    ("lock_sim_card", {"mode": "puk"}),
    ("set_wifi_calling", {"enabled": True, "mms_over_wifi": True}),
    ("set_wifi_calling", {"enabled": False}),
    ("set_wifi_calling", {"enabled": True, "mms_over_wifi": False}),
    ("remove_app_permission", {"app_name": "messaging", "permission": "sms"}),
    ("remove_app_permission", {"app_name": "browser", "permission": "Network"}),
    ("remove_app_permission", {"app_name": "camera", "permission": "sms"}),
    ("remove_app_permission", {"app_name": "messaging", "permission": "camera"}),
    ("set_user_location", {"abroad": True}),
    ("set_user_location", {"abroad": False}),
]
FACTS: list[dict[str, Any]] = [  # what sync_tools copies from the CRM
    {"line_active": False, "roaming_allowed": False, "data_usage_exceeded": False},
    {"line_active": True, "roaming_allowed": True, "data_usage_exceeded": False},
    {"line_active": True, "roaming_allowed": False, "data_usage_exceeded": True},
    {"payment": ("B1234321", 65)},
]


@pytest.fixture(scope="session")
def telecom_tasks(tau2_data: Path) -> list[dict[str, Any]]:
    """telecom's tasks.json, read once per session."""
    tasks: list[dict[str, Any]] = json.loads((tau2_data / "telecom" / "tasks.json").read_text())
    return tasks


def _user_setup(task: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    actions = (task.get("initial_state") or {}).get("initialization_actions") or []
    return tuple(
        (a["func_name"], json.dumps(a["arguments"], sort_keys=True))
        for a in actions
        if a["env_type"] == "user"
    )


def _gold_user_actions(task: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    actions = (task.get("evaluation_criteria") or {}).get("actions") or []
    return tuple(
        (a["name"], json.dumps(a["arguments"], sort_keys=True))
        for a in actions
        if a.get("requestor") == "user"
    )


@pytest.fixture(scope="session")
def user_setups(telecom_tasks: list[dict[str, Any]]) -> list[tuple[tuple[str, str], ...]]:
    return sorted({_user_setup(task) for task in telecom_tasks})


@pytest.fixture(scope="session")
def pristine(tau2_data: Path) -> dict[str, Any]:
    return load_phone_db(tau2_data / "telecom" / "user_db.toml")


class Upstream:
    """tau2-bench's user toolkit behind a bare ``Environment`` (no agent side, so no sync)."""

    def __init__(self, user_db_path: Path) -> None:
        from loguru import logger
        from tau2.data_model.message import ToolCall
        from tau2.data_model.tasks import EnvAssertion, EnvFunctionCall
        from tau2.domains.telecom import user_data_model as model
        from tau2.domains.telecom.user_tools import TelecomUserTools
        from tau2.environment.environment import Environment

        logger.disable("tau2")  # get_response logs every result at DEBUG
        self.model, self.raw = model, tomllib.loads(user_db_path.read_text())
        self.Environment, self.TelecomUserTools, self.ToolCall = (
            Environment,
            TelecomUserTools,
            ToolCall,
        )
        self.EnvFunctionCall, self.EnvAssertion = EnvFunctionCall, EnvAssertion

    def new(self) -> Any:
        tools = self.TelecomUserTools(
            self.model.TelecomUserDB.model_validate(copy.deepcopy(self.raw))
        )
        # Upstream's connect_vpn installs one class-level record that break_vpn degrades for the
        # whole process; a fresh one per episode keeps the comparison to one episode's behaviour.
        tools.default_vpn_details = self.model.VpnDetails(
            server_address="192.168.1.1", protocol="OpenVPN", server_performance="excellent"
        )
        return self.Environment(domain_name="telecom", policy="", tools=None, user_tools=tools)

    def call(self, env: Any, name: str, args: dict[str, Any]) -> tuple[str, bool]:
        message = env.get_response(
            self.ToolCall(id="c", name=name, arguments=args, requestor="user")
        )
        return message.content, message.error

    def run(self, env: Any, name: str, args: dict[str, Any]) -> Any:
        return env.run_env_function_call(
            self.EnvFunctionCall(env_type="user", func_name=name, arguments=args)
        )

    def assertion(self, env: Any, name: str, args: dict[str, Any], value: bool = True) -> bool:
        check = self.EnvAssertion(
            env_type="user", func_name=name, arguments=args, assert_value=value
        )
        passed: bool = env.run_env_assertion(check, raise_assertion_error=False)
        return passed

    def set_facts(self, env: Any, facts: dict[str, Any]) -> None:
        around = env.user_tools.db.surroundings
        if "payment" in facts:
            bill_id, amount = facts["payment"]
            around.payment_request = self.model.PaymentRequest(bill_id=bill_id, amount_due=amount)
            return
        around.line_active = facts["line_active"]
        around.roaming_allowed = facts["roaming_allowed"]
        around.mobile_data_usage_exceeded = facts["data_usage_exceeded"]


@pytest.fixture(scope="session")
def upstream(tau2_upstream: Any, tau2_data: Path) -> Upstream:
    return Upstream(tau2_data / "telecom" / "user_db.toml")


def _set_facts(phone: PhoneTools, facts: dict[str, Any]) -> None:
    if "payment" in facts:
        phone.request_payment(*facts["payment"])
    else:
        phone.sync_line(**facts)


def _run_both(up: Upstream, env: Any, phone: PhoneTools, name: str, args: dict[str, Any]) -> None:
    """A hidden function on both sides: same return value, or the same error."""
    try:
        expected: Any = up.run(env, name, args)
    except Exception as exc:
        expected = ("raised", type(exc).__name__, str(exc))
    try:
        got: Any = phone.run_function(name, args)
    except Exception as exc:
        got = ("raised", type(exc).__name__, str(exc))
    assert got == expected, (name, args)


def _call_both(
    up: Upstream, env: Any, phone: PhoneTools, name: str, args: dict[str, Any]
) -> tuple[str, bool]:
    expected = up.call(env, name, args)
    assert phone.call(name, args) == expected, (name, args)
    return expected


def _same_hash(env: Any, phone: PhoneTools, where: Any) -> None:
    assert phone.db_hash() == env.user_tools.get_db_hash(), where


def _read_all(up: Upstream, env: Any, phone: PhoneTools) -> None:
    for name, kind in PhoneTools.tool_kinds().items():
        if kind is ToolKind.READ:
            for args in APP_ARGS if name in ("check_app_status", "check_app_permissions") else [{}]:
                _call_both(up, env, phone, name, args)


def _assert_all(up: Upstream, env: Any, phone: PhoneTools) -> None:
    checks = [(name, json.loads(args), value) for name, args, value in USER_ASSERTIONS]
    checks += [(name, args, value) for name, args in EXTRA_ASSERTIONS for value in (True, False)]
    for name, args, value in checks:
        assert (phone.run_function(name, args) == value) == up.assertion(env, name, args, value), (
            name,
            args,
        )


def _set_up_both(
    up: Upstream, pristine: dict[str, Any], setup: tuple[tuple[str, str], ...]
) -> tuple[Any, PhoneTools]:
    env, phone = up.new(), PhoneTools(pristine)
    for name, args in setup:
        _run_both(up, env, phone, name, json.loads(args))
    _same_hash(env, phone, setup)
    return env, phone


# --- parity ---


def test_task_counts(telecom_tasks: list[dict[str, Any]], user_setups: list[Any]) -> None:
    assert len(telecom_tasks) == NUM_TASKS
    assert len(user_setups) == NUM_USER_SETUPS
    pairs = {(_user_setup(t), _gold_user_actions(t)) for t in telecom_tasks}
    assert len(pairs) == NUM_SETUP_AND_GOLD
    found = {
        (a["func_name"], json.dumps(a["arguments"], sort_keys=True), a.get("assert_value", True))
        for t in telecom_tasks
        for a in (t.get("evaluation_criteria") or {}).get("env_assertions") or []
        if a["env_type"] == "user"
    }
    assert found == USER_ASSERTIONS
    hidden = {name for setup in user_setups for name, _ in setup}
    assert all(callable(getattr(PhoneTools, name, None)) for name in hidden)


def test_tools_match_upstream(upstream: Upstream) -> None:
    env = upstream.new()
    theirs = env.user_tools
    assert list(PhoneTools.tool_kinds()) == list(theirs.tools)
    assert {n: k.value for n, k in PhoneTools.tool_kinds().items()} == {
        n: theirs.tool_type(n).value for n in theirs.tools
    }
    assert sum(k is ToolKind.READ for k in PhoneTools.tool_kinds().values()) == 15
    their_tools = theirs.get_tools()
    for schema in PhoneTools.schemas():
        function = schema["function"]
        params = their_tools[function["name"]].openai_schema["function"]["parameters"]
        assert set(function["parameters"]["properties"]) == set(params["properties"]), function[
            "name"
        ]
        assert function["parameters"].get("required", []) == params.get("required", []), function[
            "name"
        ]


def test_pristine_phone_matches_upstream(upstream: Upstream, pristine: dict[str, Any]) -> None:
    env = upstream.new()
    assert pristine == env.user_tools.db.model_dump(mode="json")
    _same_hash(env, PhoneTools(pristine), "pristine")


def test_every_user_setup_reads_and_assertions_match_upstream(
    upstream: Upstream, pristine: dict[str, Any], user_setups: list[Any]
) -> None:
    for setup in user_setups:
        env, phone = _set_up_both(upstream, pristine, setup)
        _read_all(upstream, env, phone)
        _assert_all(upstream, env, phone)


def test_gold_user_actions_match_upstream(
    upstream: Upstream, pristine: dict[str, Any], telecom_tasks: list[dict[str, Any]]
) -> None:
    pairs: dict[Any, set[tuple[str, str]]] = {}
    for task in telecom_tasks:
        checks = (task.get("evaluation_criteria") or {}).get("env_assertions") or []
        own = pairs.setdefault((_user_setup(task), _gold_user_actions(task)), set())
        own |= {
            (a["func_name"], json.dumps(a["arguments"])) for a in checks if a["env_type"] == "user"
        }
    solved = 0
    for (setup, gold), own in sorted(pairs.items()):
        env, phone = _set_up_both(upstream, pristine, setup)
        for name, args in gold:
            _call_both(upstream, env, phone, name, json.loads(args))
            _same_hash(env, phone, (setup, name))
        _assert_all(upstream, env, phone)
        solved += all(phone.run_function(name, json.loads(args)) for name, args in own)
    # The rest also need the agent's side (roaming on the line, more data, a paid bill).
    assert solved == NUM_SOLVED_BY_PHONE_ALONE


def test_write_walks_match_upstream_on_every_setup(
    upstream: Upstream, pristine: dict[str, Any], user_setups: list[Any]
) -> None:
    rng = random.Random(2285)
    steps: list[Any] = (
        [("write", w) for w in WRITES]
        + [("hidden", h) for h in HIDDEN]
        + [("facts", f) for f in FACTS]
    )
    seen: set[str] = set()
    for setup in user_setups:
        env, phone = _set_up_both(upstream, pristine, setup)
        for kind, step in rng.sample(steps, 14):
            if kind == "write":
                _call_both(upstream, env, phone, *step)
                seen.add(step[0])
            elif kind == "hidden":
                _run_both(upstream, env, phone, *step)
            else:
                upstream.set_facts(env, step)
                _set_facts(phone, step)
            _same_hash(env, phone, (setup, step))
        _read_all(upstream, env, phone)
        _assert_all(upstream, env, phone)
    assert seen == {n for n, k in PhoneTools.tool_kinds().items() if k is ToolKind.WRITE}


BAD_CALLS: list[tuple[str, dict[str, Any]]] = [
    ("check_app_status", {}),
    ("check_app_permissions", {"app_name": "messaging", "extra": 1}),
    ("check_status_bar", {"verbose": True}),
    ("grant_app_permission", {"app_name": "messaging"}),
    ("grant_app_permission", {"app_name": "messaging", "permission": 5}),
    ("grant_app_permission", {"app_name": ["messaging"], "permission": "sms"}),
    ("grant_app_permission", {"app_name": 7, "permission": "sms"}),
    ("check_app_status", {"app_name": {"a": 1}}),
    ("check_app_permissions", {"app_name": None}),
    ("set_network_mode_preference", {}),
    ("set_network_mode_preference", {"mode": "4G_ONLY"}),
    ("set_apn_settings", {}),
    ("no_such_tool", {}),
    ("set_apn_settings", {"apn_settings": {"apn_name": "foo"}}),
    (
        "set_apn_settings",
        {"apn_settings": {"apn_name": 1, "mms_port": "x", "zz": "y" * 80, "aa": 2}},
    ),
    (
        "set_apn_settings",
        {"apn_settings": {"reset_at_reboot": "maybe", "mms_apn": 5, "mmsc_url": ["u"]}},
    ),
    ("set_apn_settings", {"apn_settings": {"reset_at_reboot": 2, "mms_port": 80.5}}),
    ("set_apn_settings", {"apn_settings": {"reset_at_reboot": 0.5, "mms_port": {}}}),
    ("set_apn_settings", {"apn_settings": {"reset_at_reboot": None, "mms_port": "1e3"}}),
    (
        "set_apn_settings",
        {"apn_settings": {"reset_at_reboot": "ON", "mms_port": " 1_000 ", "mms_proxy": "p"}},
    ),
    (
        "set_apn_settings",
        {"apn_settings": {"reset_at_reboot": 1.0, "mms_port": "8.00", "mms_apn": None}},
    ),
    ("set_apn_settings", {"apn_settings": {"mms_port": True, "apn_name": "broken"}}),
]
HIDDEN_BAD: list[tuple[str, dict[str, Any]]] = [
    ("assert_service_status", {"expected_status": "offline"}),
    ("assert_service_status", {"expected_status": 3}),
    ("assert_internet_speed", {"expected_speed": "fast"}),
    ("lock_sim_card", {"mode": "other"}),
    ("set_wifi_calling", {"enabled": "yes", "mms_over_wifi": "no"}),
]


@pytest.mark.filterwarnings(
    "ignore::UserWarning"
)  # set_wifi_calling stores "no" where a bool belongs
def test_bad_arguments_match_upstream(upstream: Upstream, pristine: dict[str, Any]) -> None:
    env, phone = upstream.new(), PhoneTools(pristine)
    for name, args in BAD_CALLS:
        _call_both(upstream, env, phone, name, args)
        _same_hash(env, phone, (name, args))
    for name, args in HIDDEN_BAD:
        _run_both(upstream, env, phone, name, args)
        _same_hash(env, phone, (name, args))
    _read_all(upstream, env, phone)


@pytest.mark.filterwarnings("ignore::UserWarning")  # pydantic dumps the stray value with a warning
@pytest.mark.parametrize("mode", [5, None, True, [1], {"value": "4g_only"}])
def test_non_string_network_mode_matches_upstream(
    upstream: Upstream, pristine: dict[str, Any], mode: Any
) -> None:
    env, phone = upstream.new(), PhoneTools(pristine)
    phone.set_user_location(True)  # so that later reads differ by more than the mode
    upstream.run(env, "set_user_location", {"abroad": True})
    _call_both(upstream, env, phone, "set_network_mode_preference", {"mode": mode})
    _same_hash(env, phone, mode)
    _call_both(upstream, env, phone, "check_network_mode_preference", {})
    _call_both(upstream, env, phone, "toggle_data", {})
    _same_hash(env, phone, mode)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("settings", ["internet", None, 5, ["internet"]])
def test_non_object_apn_settings_break_the_phone_as_upstream(
    upstream: Upstream, pristine: dict[str, Any], settings: Any
) -> None:
    env, phone = upstream.new(), PhoneTools(pristine)
    text, error = _call_both(upstream, env, phone, "set_apn_settings", {"apn_settings": settings})
    assert error and "object has no attribute 'apn_name'" in text
    _same_hash(env, phone, settings)
    for name in PhoneTools.tool_kinds():
        args = (
            {"app_name": "messaging", "permission": "sms"} if name == "grant_app_permission" else {}
        )
        if name in ("check_app_status", "check_app_permissions"):
            args = {"app_name": "messaging"}
        if name in ("set_apn_settings", "set_network_mode_preference"):
            continue
        _call_both(upstream, env, phone, name, args)
    for name, args in HIDDEN:
        _run_both(upstream, env, phone, name, args)


def test_update_db_matches_upstream(upstream: Upstream, pristine: dict[str, Any]) -> None:
    env, phone = upstream.new(), PhoneTools(pristine)
    data = {
        "device": {
            "wifi_enabled": True,
            "wifi_connected": True,
            "wifi_ssid": "Home",
            "wifi_signal_strength": "good",
            "vpn_connected": True,
            "vpn_details": {"server_address": "10.1.1.1"},
            "app_statuses": {
                "camera": {"app_name": "camera"},
                "messaging": {"permissions": {"sms": False}},
            },
        },
        "surroundings": {
            "signal_strength": {"5G": "none"},
            "payment_request": {"bill_id": "B1", "amount_due": 12},
        },
    }
    env.user_tools.update_db(data)
    phone.update_db(data)
    _same_hash(env, phone, "update_db")
    _read_all(upstream, env, phone)
    for name, args in WRITES:
        _call_both(upstream, env, phone, name, args)
        _same_hash(env, phone, name)
    _read_all(upstream, env, phone)


# --- without upstream ---


def test_load_fills_upstream_defaults(pristine: dict[str, Any]) -> None:
    device, around = pristine["device"], pristine["surroundings"]
    assert device["active_apn_settings"] == {
        "apn_name": "internet",
        "reset_at_reboot": False,
        "mms_apn": "mms",
        "mmsc_url": "http://mms.carrier.com/mms/wapenc",
        "mms_proxy": None,
        "mms_port": None,
    }
    assert device["vpn_details"] is None and device["wifi_ssid"] is None
    assert around == {
        "name": None,
        "phone_number": None,
        "is_abroad": False,
        "roaming_allowed": False,
        "signal_strength": {"2G": "poor", "3G": "fair", "4G": "good", "5G": "excellent"},
        "mobile_data_usage_exceeded": False,
        "line_active": True,
        "payment_request": None,
    }
    kinds = PhoneTools.tool_kinds()
    assert len(kinds) == 30 and sum(k is ToolKind.WRITE for k in kinds.values()) == 15
    assert PhoneTools.side == "user"


def test_episodes_never_touch_the_pristine_data(pristine: dict[str, Any]) -> None:
    before = copy.deepcopy(pristine)
    first = PhoneTools(pristine)
    start = first.db_hash()
    for name, args in WRITES + HIDDEN:
        first.call(name, args) if name in first.tool_kinds() else first.run_function(name, args)
    first.update_db({"device": {"battery_level": 5}})
    assert first.db_hash() != start
    assert pristine == before
    assert PhoneTools(pristine).db_hash() == start == state_hash(before)


def test_network_speed_and_mms_rules(pristine: dict[str, Any]) -> None:
    phone = PhoneTools(pristine)
    assert phone.call("run_speed_test", {}) == (
        "Speed Test Result: 220.00 Mbps (Excellent). Connection is very fast.",
        False,
    )
    phone.simulate_network_search()  # 5G at the surroundings' excellent signal
    assert phone.run_speed_test().startswith("Speed Test Result: 275.00 Mbps (Excellent)")
    phone.set_network_mode_preference("3g_only")  # (1 + 5) / 2 * 0.5 (fair)
    assert phone.run_speed_test().startswith("Speed Test Result: 1.50 Mbps (Poor)")
    phone.set_network_mode_preference("2g_only")
    assert phone.assert_can_send_mms(False) and phone.assert_mobile_data_status(True)
    phone.set_network_mode_preference("4g_only")  # 55 * 0.8 = 44, then data saver: 8.8
    phone.toggle_data_saver_mode()
    assert phone.run_speed_test().startswith("Speed Test Result: 8.80 Mbps (Fair)")
    assert phone.assert_can_send_mms(True)

    phone.turn_airplane_mode_on()
    assert phone.check_status_bar() == "Status Bar: ✈️ Airplane Mode | 🔋 80%"
    assert (
        phone.assert_service_status("no_service")
        and phone.run_speed_test() == "Speed test failed: No Connection."
    )
    phone.turn_airplane_mode_off()
    phone.set_user_location(True)  # abroad: roaming must be on and allowed
    phone.turn_roaming_on()
    assert phone.assert_mobile_data_status(False)
    phone.sync_line(line_active=True, roaming_allowed=True, data_usage_exceeded=False)
    assert phone.assert_mobile_data_status(True)
    phone.sync_line(line_active=False, roaming_allowed=True, data_usage_exceeded=False)
    assert phone.assert_service_status("connected")  # the phone notices at its next search
    phone.reboot_device()
    assert phone.assert_service_status("no_service")


def test_mms_fix_and_poor_vpn_persist_as_upstream(pristine: dict[str, Any]) -> None:
    phone = PhoneTools(pristine)
    phone.break_apn_mms_setting()
    phone.remove_app_permission("messaging", "storage")
    assert "cannot send" in phone.can_send_mms()
    phone.grant_app_permission("messaging", "storage")
    phone.reset_apn_settings()
    assert phone.assert_can_send_mms(False)  # the APN reset waits for a reboot
    assert "Resetting APN settings..." in phone.reboot_device()
    assert phone.assert_can_send_mms(True)

    phone.break_vpn()  # 275 * 0.1 behind the poor VPN
    assert phone.run_speed_test().startswith("Speed Test Result: 27.50 Mbps (Good)")
    assert "<PerformanceLevel.POOR: 'poor'>" in phone.check_vpn_status()
    phone.disconnect_vpn()
    assert phone.assert_internet_speed(200, "excellent")
    phone.connect_vpn()  # upstream reconnects to the same degraded record
    assert not phone.assert_internet_speed(200, "excellent")
    assert PhoneTools(pristine).connect_vpn().startswith("VPN connected")
    fresh = PhoneTools(pristine)
    fresh.connect_vpn()
    assert "'excellent'>" in fresh.check_vpn_status()


def test_payment_request_round_trip(pristine: dict[str, Any]) -> None:
    phone = PhoneTools(pristine)
    assert (
        phone.make_payment() == "You do not have a payment request."
        and phone.paid_bill_id() is None
    )
    phone.set_user_info("John Smith", "555-123-2002")
    assert phone.phone_number == "555-123-2002"
    phone.request_payment("B1234321", 65)
    assert (
        phone.check_payment_request() == "You have a payment request for bill B1234321 of 65.0 USD."
    )
    assert phone.paid_bill_id() is None
    assert phone.call("make_payment", {}) == (
        "Payment of 65.0 USD has been made for bill B1234321.",
        False,
    )
    assert phone.paid_bill_id() == "B1234321"
    phone.clear_payment_request()
    assert (
        phone.payment_request is None
        and phone.check_payment_request() == "No payment request has been made."
    )


def test_bad_arguments_are_errors_worded_as_upstream(pristine: dict[str, Any]) -> None:
    phone = PhoneTools(pristine)
    before = phone.db_hash()
    assert phone.call("check_app_status", {}) == (
        "Error: TelecomUserTools.check_app_status() missing 1 required positional argument: 'app_name'",
        True,
    )
    text, error = phone.call("set_apn_settings", {"apn_settings": {"apn_name": "wap", "proxy": 1}})
    assert error and text.startswith(
        "Error: 2 validation errors for APNSettings\napn_name\n  Input should be"
    )
    assert (
        "proxy\n  Extra inputs are not permitted [type=extra_forbidden, input_value=1, input_type=int]"
        in text
    )
    assert phone.call("check_app_permissions", {"app_name": "camera"}) == (
        "App 'camera' not found on this phone.",
        False,
    )
    assert phone.call("no_such_tool", {}) == ("Error: Tool 'no_such_tool' not found.", True)
    text, error = phone.call("set_network_mode_preference", {"mode": "5g"})
    assert not error and text.startswith("Failed to set network mode: '5g' is not a valid option.")
    assert phone.db_hash() == before
    with pytest.raises(ValueError, match="'offline' is not a valid NetworkStatus"):
        phone.assert_service_status("offline")
    with pytest.raises(ValueError, match="validation error"):
        PhoneTools({"device": {"battery_level": "full"}})
