"""tau2 telecom: the CRM toolkit, the domain's ``sync`` and both against tau2-bench's code.

Upstream-free tests run on the data alone (``tau2_data``); the parity tests also need
tau2-bench's code (``tau2_upstream``, installed by ``nox -s tau2-parity``) and replay every
task of the ``base`` split on both implementations: initial state, gold actions (texts,
error flags), database hashes after every step, environment assertions.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest

from turnrl.tool_envs.tau.tau2.domain import Tau2Domain, load_domain
from turnrl.tool_envs.tau.tau2.telecom import load
from turnrl.tool_envs.tau.tau2.telecom_crm import CrmTools, load_crm_db, normalize_crm_db
from turnrl.tool_envs.tau.tau2.toolkit import ToolKind, Toolkit, state_hash

PRISTINE_CRM_HASH = "304cf5ef059852e117ea801ab9a5efc24c9713ec887679dc2e30acceb4b6742d"
"""tau2's hash of ``TelecomDB.load(db.toml)`` (upstream's ``get_hash()``, data at a2c0247)."""
BASE_TASKS = 114
CRM_TOOLS = {
    "get_customer_by_phone": ToolKind.READ,
    "get_customer_by_id": ToolKind.READ,
    "get_customer_by_name": ToolKind.READ,
    "get_details_by_id": ToolKind.READ,
    "get_bills_for_customer": ToolKind.READ,
    "get_data_usage": ToolKind.READ,
    "suspend_line": ToolKind.WRITE,
    "resume_line": ToolKind.WRITE,
    "send_payment_request": ToolKind.WRITE,
    "enable_roaming": ToolKind.WRITE,
    "disable_roaming": ToolKind.WRITE,
    "refuel_data": ToolKind.WRITE,
    "transfer_to_human_agents": ToolKind.GENERIC,
}


@pytest.fixture(scope="module")
def telecom(tau2_data: Path) -> Tau2Domain:
    return load(tau2_data / "telecom")


@pytest.fixture(scope="module")
def splits(tau2_data: Path) -> dict[str, list[dict[str, Any]]]:
    """Split name -> its tasks (``tasks.json`` is 14 MB: read once per module)."""
    folder = tau2_data / "telecom"
    tasks = json.loads((folder / "tasks.json").read_text())
    split_ids = json.loads((folder / "split_tasks.json").read_text())
    return {
        name: [task for task in tasks if task["id"] in set(ids)] for name, ids in split_ids.items()
    }


@pytest.fixture(scope="module")
def base_tasks(splits: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    return splits["base"]


def _apply_initial_state(domain: Tau2Domain, task: dict[str, Any]) -> tuple[Toolkit, Toolkit]:
    agent = domain.new_tools()
    assert domain.new_user_tools is not None
    phone = domain.new_user_tools()
    state = task.get("initial_state") or {}
    data = state.get("initialization_data") or {}
    if data.get("agent_data"):
        agent.update_db(data["agent_data"])
    if data.get("user_data"):
        phone.update_db(data["user_data"])
    for action in state.get("initialization_actions") or []:
        side = agent if action["env_type"] == "assistant" else phone
        side.run_function(action["func_name"], action["arguments"])
        domain.sync(agent, phone)
    return agent, phone


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


# --- upstream-free -----------------------------------------------------------------------------


def test_tools_and_kinds(telecom: Tau2Domain) -> None:
    assert CrmTools.tool_kinds() == CRM_TOOLS
    schemas = {s["function"]["name"]: s["function"]["parameters"] for s in CrmTools.schemas()}
    assert schemas["refuel_data"]["required"] == ["customer_id", "line_id", "gb_amount"]
    assert schemas["get_bills_for_customer"]["required"] == ["customer_id"]
    assert telecom.new_tools().side == "assistant"
    assert telecom.new_user_tools is not None and telecom.new_user_tools().side == "user"


def test_policy_wraps_main_policy_and_manual(tau2_data: Path, telecom: Tau2Domain) -> None:
    folder = tau2_data / "telecom"
    main = (folder / "main_policy.md").read_text()
    manual = (folder / "tech_support_manual.md").read_text()
    assert telecom.policy == (
        f"<main_policy>\n{main}\n</main_policy>\n"
        f"<tech_support_policy>\n{manual}\n</tech_support_policy>"
    )
    assert load_domain("telecom", folder).policy == telecom.policy


def test_fresh_toolkits_start_pristine_and_episodes_do_not_leak(telecom: Tau2Domain) -> None:
    first = telecom.new_tools()
    assert first.db_hash() == PRISTINE_CRM_HASH
    phone = telecom.new_user_tools()  # type: ignore[misc]
    phone_hash = phone.db_hash()
    phone.call("toggle_airplane_mode", {})
    assert phone.db_hash() != phone_hash
    first.call("suspend_line", {"customer_id": "C1001", "line_id": "L1001", "reason": "travel"})
    first.call("refuel_data", {"customer_id": "C1001", "line_id": "L1002", "gb_amount": 1.5})
    assert first.db_hash() != PRISTINE_CRM_HASH
    assert telecom.new_tools().db_hash() == PRISTINE_CRM_HASH
    assert telecom.new_user_tools().db_hash() == phone_hash  # type: ignore[misc]


def test_refuel_charges_the_draft_bill(telecom: Tau2Domain) -> None:
    crm = telecom.new_tools()
    text, error = crm.call(
        "refuel_data", {"customer_id": "C1001", "line_id": "L1002", "gb_amount": 2.0}
    )
    assert not error
    assert json.loads(text) == {
        "message": "Successfully added 2.0 GB of data for line L1002 for $4.00",
        "new_data_refueling_gb": "2.0",
        "charge": "4.0",
    }
    db = crm.state()
    line = next(line for line in db["lines"] if line["line_id"] == "L1002")
    draft = next(bill for bill in db["bills"] if bill["bill_id"] == "B1003")
    assert line["data_refueling_gb"] == 2.0
    assert draft["total_due"] == 4.0
    assert draft["line_items"] == [
        {
            "description": "Data refueling: 2.0 GB at $2.0/GB",
            "amount": 4.0,
            "date": "2025-02-25",
            "item_type": "Charge",
        }
    ]
    assert crm.run_function(
        "assert_data_refueling_amount",
        {"customer_id": "C1001", "line_id": "L1002", "expected_amount": 2.0},
    )


def test_reads_and_errors(telecom: Tau2Domain) -> None:
    crm = telecom.new_tools()
    text, error = crm.call("get_customer_by_phone", {"phone_number": "555-123-2003"})
    assert not error and json.loads(text)["customer_id"] == "C1001"
    text, _ = crm.call("get_customer_by_name", {"full_name": "JOHN smith", "dob": "1985-06-15"})
    assert [c["customer_id"] for c in json.loads(text)] == ["C1001"]
    text, _ = crm.call("get_bills_for_customer", {"customer_id": "C1001", "limit": 2})
    assert [b["bill_id"] for b in json.loads(text)] == ["B1003", "B1002"]
    text, _ = crm.call("get_data_usage", {"customer_id": "C1001", "line_id": "L1001"})
    assert json.loads(text)["cycle_end_date"] == "2025-02-28"
    assert crm.call("get_customer_by_id", {"customer_id": "C9"}) == (
        "Error: Customer with ID C9 not found",
        True,
    )
    assert crm.call("get_details_by_id", {"id": "X1"}) == (
        "Error: Unknown ID format or type: X1",
        True,
    )
    assert crm.call(
        "suspend_line", {"customer_id": "C1001", "line_id": "L1003", "reason": "r"}
    ) == (
        "Error: Line must be active to suspend",
        True,
    )
    assert crm.call("get_data_usage", {"customer_id": "C1001", "line_id": "L1004"}) == (
        "Error: Line L1004 not found for customer C1001",
        True,
    )
    text, error = crm.call("get_customer_by_id", {})
    assert error
    assert text == (
        "Error: TelecomTools.get_customer_by_id() missing 1 required positional argument: "
        "'customer_id'"
    )
    assert crm.db_hash() == PRISTINE_CRM_HASH


def test_overdue_bill_setup_and_payment_through_sync(telecom: Tau2Domain) -> None:
    """The overdue-bill story: set-up, payment request, the user pays, sync marks it paid."""
    task = {
        "initial_state": {
            "initialization_actions": [
                {
                    "env_type": "user",
                    "func_name": "set_user_info",
                    "arguments": {"name": "John Smith", "phone_number": "555-123-2002"},
                },
                {
                    "env_type": "assistant",
                    "func_name": "suspend_line_for_overdue_bill",
                    "arguments": {
                        "customer_id": "C1001",
                        "line_id": "L1002",
                        "new_bill_id": "B1234321",
                        "contract_ended": False,
                    },
                },
            ]
        }
    }
    crm, phone = _apply_initial_state(telecom, task)
    bill = crm.run_function("get_details_by_id", {"id": "B1234321"})
    assert (bill["status"], bill["total_due"], bill["due_date"]) == ("Overdue", 65.0, "2025-01-15")
    assert phone.state()["surroundings"]["line_active"] is False
    assert not crm.run_function("assert_no_overdue_bill", {"overdue_bill_id": "B1234321"})
    assert phone.call("check_payment_request", {})[0] == "No payment request has been made."

    crm.call("send_payment_request", {"customer_id": "C1001", "bill_id": "B1234321"})
    telecom.sync(crm, phone)
    assert phone.state()["surroundings"]["payment_request"] == {
        "bill_id": "B1234321",
        "amount_due": 65.0,
        "paid": False,
    }
    phone.call("make_payment", {})
    telecom.sync(crm, phone)
    assert phone.state()["surroundings"]["payment_request"] is None
    assert crm.run_function("assert_no_overdue_bill", {"overdue_bill_id": "B1234321"})
    crm.call("resume_line", {"customer_id": "C1001", "line_id": "L1002"})
    telecom.sync(crm, phone)
    assert phone.state()["surroundings"]["line_active"] is True


def test_sync_reports_data_usage_against_limit_plus_refuel(telecom: Tau2Domain) -> None:
    crm, phone = telecom.new_tools(), telecom.new_user_tools()  # type: ignore[misc]
    phone.run_function("set_user_info", {"name": "John Smith", "phone_number": "555-123-2002"})
    crm.run_function(
        "set_data_usage", {"customer_id": "C1001", "line_id": "L1002", "data_used_gb": 15}
    )
    telecom.sync(crm, phone)
    surroundings = phone.state()["surroundings"]
    assert surroundings["mobile_data_usage_exceeded"] is True  # 15 >= 15 GB limit + 0
    assert surroundings["roaming_allowed"] is True
    crm.call("refuel_data", {"customer_id": "C1001", "line_id": "L1002", "gb_amount": 0.5})
    telecom.sync(crm, phone)
    assert phone.state()["surroundings"]["mobile_data_usage_exceeded"] is False


def test_sync_without_a_phone_number_changes_nothing(telecom: Tau2Domain) -> None:
    crm, phone = telecom.new_tools(), telecom.new_user_tools()  # type: ignore[misc]
    before = phone.db_hash()
    telecom.sync(crm, phone)
    assert phone.db_hash() == before and crm.db_hash() == PRISTINE_CRM_HASH


def test_normalize_coerces_like_pydantic_and_rejects_bad_records(tau2_data: Path) -> None:
    db = load_crm_db(tau2_data / "telecom" / "db.toml")
    assert state_hash(normalize_crm_db(db)) == PRISTINE_CRM_HASH  # idempotent
    line = dict(db["lines"][0], data_used_gb=3, suspension_start_date="2025-02-01T00:00:00")
    del line["device_id"]
    fixed = normalize_crm_db({"lines": [line]})
    assert fixed["plans"] == [] and fixed["lines"][0]["device_id"] is None
    assert fixed["lines"][0]["data_used_gb"] == 3.0
    assert isinstance(fixed["lines"][0]["data_used_gb"], float)
    assert fixed["lines"][0]["suspension_start_date"] == "2025-02-01"
    bad_dbs: list[dict[str, Any]] = [
        {"lines": [dict(db["lines"][0], status="Gone")]},
        {"lines": [dict(db["lines"][0], colour="red")]},
        {"lines": [dict(db["lines"][0], data_used_gb="lots")]},
        {"plans": [{"plan_id": "P1"}]},
        {"tables": []},
    ]
    for bad in bad_dbs:
        with pytest.raises(ValueError):
            normalize_crm_db(bad)


def test_update_db_merges_and_revalidates(telecom: Tau2Domain) -> None:
    crm = telecom.new_tools()
    crm.update_db({"plans": [{**crm.state()["plans"][0], "price_per_month": 41}]})
    assert crm.state()["plans"] == [
        {**telecom.new_tools().state()["plans"][0], "price_per_month": 41.0}
    ]
    assert len(crm.state()["lines"]) == 9


def test_base_split_gold_actions_reach_every_assertion(
    telecom: Tau2Domain, base_tasks: list[dict[str, Any]]
) -> None:
    """Without the reference: on every base task, the gold actions (each followed by sync)
    run without error and make every environment assertion hold."""
    assert len(base_tasks) == BASE_TASKS
    for task in base_tasks:
        agent, phone = _apply_initial_state(telecom, task)
        for action in task["evaluation_criteria"]["actions"] or []:
            side = phone if action.get("requestor", "assistant") == "user" else agent
            text, error = side.call(action["name"], action["arguments"])
            assert not error, (task["id"], action["name"], text)
            telecom.sync(agent, phone)
        for check in task["evaluation_criteria"]["env_assertions"] or []:
            side = phone if check["env_type"] == "user" else agent
            value = side.run_function(check["func_name"], check["arguments"])
            telecom.sync(agent, phone)
            assert value is check.get("assert_value", True), (task["id"], check)


# --- parity with tau2-bench's code -------------------------------------------------------------


@pytest.fixture(scope="module")
def upstream(tau2_upstream: Any, tau2_data: Path) -> Any:
    """A factory of upstream telecom environments on ``tau2_data``'s files (loguru muted)."""
    from loguru import logger
    from tau2.domains.telecom import environment as env_module
    from tau2.domains.telecom.data_model import TelecomDB
    from tau2.domains.telecom.user_data_model import TelecomUserDB

    folder = tau2_data / "telecom"
    db = TelecomDB.load(str(folder / "db.toml"))
    user_db = TelecomUserDB.load(str(folder / "user_db.toml"))
    patch = pytest.MonkeyPatch()
    patch.setattr(env_module, "TELECOM_MAIN_POLICY_PATH", folder / "main_policy.md")
    patch.setattr(
        env_module, "TELECOM_TECH_SUPPORT_POLICY_MANUAL_PATH", folder / "tech_support_manual.md"
    )
    logger.disable("tau2")

    def make() -> Any:
        return env_module.get_environment(
            db=db.model_copy(deep=True), user_db=user_db.model_copy(deep=True)
        )

    yield make
    logger.enable("tau2")
    patch.undo()


def _same_state(env: Any, agent: Toolkit, phone: Toolkit, where: Any) -> None:
    assert agent.db_hash() == env.get_db_hash(), where
    assert phone.db_hash() == env.get_user_db_hash(), where


def test_parity_policy_schemas_and_pristine_hashes(upstream: Any, telecom: Tau2Domain) -> None:
    env = upstream()
    assert telecom.policy == env.get_policy()
    assert {t.name for t in env.get_tools()} == set(CRM_TOOLS)
    for kind_name, kind in CRM_TOOLS.items():
        assert env.tools.tool_type(kind_name).value == kind.value
    ours = {s["function"]["name"]: s["function"]["parameters"] for s in CrmTools.schemas()}
    for up_tool in env.get_tools():
        theirs = up_tool.openai_schema["function"]["parameters"]
        mine = ours[up_tool.name]
        assert set(mine["properties"]) == set(theirs["properties"]), up_tool.name
        assert set(mine["required"]) == set(theirs.get("required", [])), up_tool.name
        for name, prop in theirs["properties"].items():
            assert mine["properties"][name]["type"] == prop["type"], (up_tool.name, name)
    _same_state(env, telecom.new_tools(), telecom.new_user_tools(), "pristine")  # type: ignore[misc]
    assert telecom.new_tools().db_hash() == PRISTINE_CRM_HASH


@pytest.mark.parametrize(
    ("split", "count"),
    [("base", BASE_TASKS), pytest.param("full", 2285, marks=pytest.mark.slow)],  # full: ~20 s
)
def test_parity_split(
    upstream: Any,
    telecom: Tau2Domain,
    splits: dict[str, list[dict[str, Any]]],
    split: str,
    count: int,
) -> None:
    """Every task of the split: initial state, gold actions (texts, errors, hashes after each
    step) and assertions; with the gold actions applied, all assertions hold on both."""
    from tau2.data_model.message import ToolCall
    from tau2.data_model.tasks import EnvAssertion, EnvFunctionCall

    assert len(splits[split]) == count
    ours_pass = theirs_pass = 0
    for task in splits[split]:
        env = upstream()
        agent, phone = telecom.new_tools(), telecom.new_user_tools()  # type: ignore[misc]
        state = task.get("initial_state") or {}
        data = state.get("initialization_data") or {}
        if data.get("agent_data"):
            env.tools.update_db(data["agent_data"])
            agent.update_db(data["agent_data"])
        if data.get("user_data"):
            env.user_tools.update_db(data["user_data"])
            phone.update_db(data["user_data"])
        for action in state.get("initialization_actions") or []:
            theirs = env.run_env_function_call(EnvFunctionCall(**action))
            side = agent if action["env_type"] == "assistant" else phone
            mine = side.run_function(action["func_name"], action["arguments"])
            telecom.sync(agent, phone)
            assert mine == theirs, (task["id"], action)
            _same_state(env, agent, phone, (task["id"], action))
        for i, action in enumerate(task["evaluation_criteria"]["actions"] or []):
            requestor = action.get("requestor", "assistant")
            call = ToolCall(
                id=str(i), name=action["name"], arguments=action["arguments"], requestor=requestor
            )
            reply = env.get_response(call)
            side = phone if requestor == "user" else agent
            text, error = side.call(action["name"], action["arguments"])
            if not error:
                telecom.sync(agent, phone)
            where = (task["id"], i, action["name"])
            assert (_loads(text), error) == (_loads(reply.content), reply.error), where
            _same_state(env, agent, phone, where)
        all_mine = all_theirs = True
        for check in task["evaluation_criteria"]["env_assertions"] or []:
            theirs = env.run_env_assertion(EnvAssertion(**check), raise_assertion_error=False)
            side = agent if check["env_type"] == "assistant" else phone
            value = side.run_function(check["func_name"], check["arguments"])
            telecom.sync(agent, phone)
            mine = value == check.get("assert_value", True)
            assert mine == theirs, (task["id"], check)
            all_mine, all_theirs = all_mine and mine, all_theirs and theirs
        _same_state(env, agent, phone, (task["id"], "assertions"))
        ours_pass += all_mine
        theirs_pass += all_theirs
    assert ours_pass == theirs_pass == count


def test_parity_crm_calls_and_errors(
    upstream: Any, telecom: Tau2Domain, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One long session of CRM calls, good and bad, on both: same texts, flags and hashes."""
    from tau2.data_model.message import ToolCall

    fixed = uuid.UUID(int=0xABCDEF0123456789)
    monkeypatch.setattr(uuid, "uuid4", lambda: fixed)  # refuel opens a draft bill with a uuid id
    c1, c2 = "C1001", "C1002"
    calls: list[tuple[str, dict[str, Any]]] = [
        ("get_customer_by_id", {"customer_id": c1}),
        ("get_customer_by_id", {"customer_id": "C9999"}),
        ("get_customer_by_id", {}),
        ("get_customer_by_id", {"customer_id": c1, "extra": 1}),
        ("no_such_tool", {}),
        ("get_customer_by_phone", {"phone_number": "555-123-1002"}),
        ("get_customer_by_phone", {"phone_number": "555-123-2008"}),
        ("get_customer_by_phone", {"phone_number": "000"}),
        ("get_customer_by_name", {"full_name": "sarah JOHNSON", "dob": "1990-11-22"}),
        ("get_customer_by_name", {"full_name": "Sarah Johnson", "dob": "1990-11-23"}),
        ("get_customer_by_name", {"full_name": 7, "dob": "1990-11-22"}),
        *[("get_details_by_id", {"id": i}) for i in ("L1009", "D1002", "B1005", "C1004", "P1003")],
        *[("get_details_by_id", {"id": i}) for i in ("L0", "D0", "B0", "C0", "P0", "X1", "")],
        ("get_details_by_id", {"id": 5}),
        ("get_bills_for_customer", {"customer_id": c1}),
        ("get_bills_for_customer", {"customer_id": c1, "limit": 1}),
        ("get_bills_for_customer", {"customer_id": c2, "limit": 0}),
        ("get_bills_for_customer", {"customer_id": c1, "limit": "2"}),
        ("get_bills_for_customer", {"customer_id": "C1004"}),
        ("get_data_usage", {"customer_id": c1, "line_id": "L1002"}),
        ("get_data_usage", {"customer_id": c1, "line_id": "L1004"}),
        ("get_data_usage", {"customer_id": "C0", "line_id": "L1001"}),
        ("suspend_line", {"customer_id": c1, "line_id": "L1003", "reason": "again"}),
        ("suspend_line", {"customer_id": c1, "line_id": "L1001", "reason": "travel"}),
        ("suspend_line", {"customer_id": c1, "line_id": "L1001", "reason": "travel"}),
        ("resume_line", {"customer_id": c1, "line_id": "L1002"}),
        ("resume_line", {"customer_id": c1, "line_id": "L1001"}),
        ("resume_line", {"customer_id": c2, "line_id": "L1001"}),
        ("enable_roaming", {"customer_id": c1, "line_id": "L1002"}),
        ("enable_roaming", {"customer_id": c1, "line_id": "L1001"}),
        ("disable_roaming", {"customer_id": c1, "line_id": "L1001"}),
        ("disable_roaming", {"customer_id": c1, "line_id": "L1001"}),
        ("refuel_data", {"customer_id": c1, "line_id": "L1001", "gb_amount": 0}),
        ("refuel_data", {"customer_id": c1, "line_id": "L1001", "gb_amount": -1.5}),
        ("refuel_data", {"customer_id": c1, "line_id": "L1001", "gb_amount": "2"}),
        ("refuel_data", {"customer_id": c1, "line_id": "L1001", "gb_amount": 2}),
        ("refuel_data", {"customer_id": c1, "line_id": "L1002", "gb_amount": 1.25}),
        ("refuel_data", {"customer_id": c2, "line_id": "L1005", "gb_amount": 3.3}),
        ("refuel_data", {"customer_id": c2, "line_id": "L1006", "gb_amount": 1}),
        ("send_payment_request", {"customer_id": c1, "bill_id": "B1004"}),
        ("send_payment_request", {"customer_id": c1, "bill_id": "B1002"}),
        ("send_payment_request", {"customer_id": c1, "bill_id": "B1001"}),
        ("send_payment_request", {"customer_id": "C0", "bill_id": "B1001"}),
        ("get_bills_for_customer", {"customer_id": c2}),
        ("transfer_to_human_agents", {"summary": "wants a human"}),
        ("transfer_to_human_agents", {}),
    ]
    env = upstream()
    crm, phone = telecom.new_tools(), telecom.new_user_tools()  # type: ignore[misc]
    errors = 0
    for i, (name, arguments) in enumerate(calls):
        reply = env.get_response(ToolCall(id=str(i), name=name, arguments=arguments))
        text, error = crm.call(name, arguments)
        assert (_loads(text), error) == (_loads(reply.content), reply.error), (name, arguments)
        if isinstance(_loads(text), str):
            assert text == reply.content, (name, arguments)
        _same_state(env, crm, phone, (name, arguments))
        errors += error
    assert errors >= 25


def test_parity_hidden_functions(upstream: Any, telecom: Tau2Domain) -> None:
    """Set-up and assertion functions, including their failures, on both."""
    calls: list[tuple[str, dict[str, Any]]] = [
        ("get_available_plan_ids", {}),
        ("set_data_usage", {"customer_id": "C1001", "line_id": "L1001", "data_used_gb": 7}),
        ("set_data_usage", {"customer_id": "C1001", "line_id": "L1004", "data_used_gb": 7}),
        ("assert_line_status", {"customer_id": "C1001", "line_id": "L1003", "expected_status": "Suspended"}),
        ("assert_line_status", {"customer_id": "C1001", "line_id": "L1001", "expected_status": "Suspended"}),
        ("assert_overdue_bill_exists", {"customer_id": "C1002", "overdue_bill_id": "B1005"}),
        ("assert_overdue_bill_exists", {"customer_id": "C1002", "overdue_bill_id": "B1004"}),
        ("assert_overdue_bill_exists", {"customer_id": "C1002", "overdue_bill_id": "B1001"}),
        ("assert_no_overdue_bill", {"overdue_bill_id": "B1005"}),
        ("assert_no_overdue_bill", {"overdue_bill_id": "B1004"}),
        ("assert_no_overdue_bill", {"overdue_bill_id": "B404"}),
        ("assert_data_refueling_amount", {"customer_id": "C1001", "line_id": "L1001", "expected_amount": 0}),
        ("suspend_line_for_overdue_bill", {"customer_id": "C1002", "line_id": "L1004", "new_bill_id": "B77", "contract_ended": False}),
        ("suspend_line_for_overdue_bill", {"customer_id": "C1001", "line_id": "L1003", "new_bill_id": "B77", "contract_ended": False}),
        ("suspend_line_for_overdue_bill", {"customer_id": "C1001", "line_id": "L1001", "new_bill_id": "B77", "contract_ended": True}),
        ("suspend_line_for_overdue_bill", {"customer_id": "C1001", "line_id": "L1002", "new_bill_id": "B78", "contract_ended": True}),
        ("assert_overdue_bill_exists", {"customer_id": "C1001", "overdue_bill_id": "B77"}),
    ]  # fmt: skip
    env = upstream()
    crm, phone = telecom.new_tools(), telecom.new_user_tools()  # type: ignore[misc]
    for name, arguments in calls:
        try:
            theirs: Any = ("ok", getattr(env.tools, name)(**arguments))
        except ValueError as exc:
            theirs = ("error", str(exc))
        try:
            mine: Any = ("ok", crm.run_function(name, arguments))
        except ValueError as exc:
            mine = ("error", str(exc))
        assert mine == theirs, (name, arguments)
        _same_state(env, crm, phone, (name, arguments))
