"""tau2-bench telecom: a dual-control domain (the agent's CRM, the user's phone) and its sync.

The agent works on the carrier's CRM (:mod:`.telecom_crm`, ``db.toml``); the user holds a
simulated phone (:mod:`.telecom_phone`, ``user_db.toml``). Neither sees the other's tools.
After every step tau2 runs ``sync_tools``, here :func:`sync`, which carries the facts of
the user's line from the CRM to the phone's surroundings:

- nothing happens until the phone knows its own number (a task's ``set_user_info``);
- the line is active or not, and roaming is allowed or not, as the CRM line says;
- mobile data is used up when the line's usage reaches the plan's limit plus the data
  refueled this cycle;
- a payment request the user has paid marks its bill "Paid" in the CRM and is removed;
- with no request pending, the first of the customer's bills awaiting payment (in the
  customer's bill order) becomes the phone's payment request.

The agent's policy is the main policy followed by the tech-support manual, each in its own
tag, as upstream's ``get_environment`` builds it for the domain ``telecom``.
"""

from __future__ import annotations

from pathlib import Path

from turnrl.tool_envs.tau.db import copy_record
from turnrl.tool_envs.tau.tau2.domain import Tau2Domain
from turnrl.tool_envs.tau.tau2.telecom_crm import CrmTools, load_crm_db
from turnrl.tool_envs.tau.tau2.telecom_phone import PhoneTools, load_phone_db
from turnrl.tool_envs.tau.tau2.toolkit import Toolkit


def telecom_policy(data_dir: Path) -> str:
    """The agent's policy: ``main_policy.md`` and ``tech_support_manual.md``, tagged."""
    main = (data_dir / "main_policy.md").read_text(encoding="utf-8")
    manual = (data_dir / "tech_support_manual.md").read_text(encoding="utf-8")
    return (
        f"<main_policy>\n{main}\n</main_policy>\n"
        f"<tech_support_policy>\n{manual}\n</tech_support_policy>"
    )


def sync(tools: Toolkit, user_tools: Toolkit | None) -> None:
    """tau2's ``TelecomEnvironment.sync_tools``: copy the user's line facts to the phone."""
    if not isinstance(tools, CrmTools) or not isinstance(user_tools, PhoneTools):
        raise TypeError("telecom sync needs the CRM toolkit and the phone toolkit")
    phone_number = user_tools.phone_number
    if phone_number is None:
        return
    line = tools.find_line_by_phone(phone_number)
    plan = tools.find_plan(line["plan_id"])
    limit = plan["data_limit_gb"] + line["data_refueling_gb"]
    user_tools.sync_line(
        line_active=line["status"] == "Active",
        roaming_allowed=bool(line["roaming_enabled"]),
        data_usage_exceeded=line["data_used_gb"] >= limit,
    )
    paid = user_tools.paid_bill_id()
    if paid is not None:
        tools.mark_bill_paid(paid)
        user_tools.clear_payment_request()
    if user_tools.payment_request is None:
        awaiting = tools.bills_awaiting_payment(tools.find_customer_by_phone(phone_number))
        if awaiting:
            user_tools.request_payment(awaiting[0]["bill_id"], awaiting[0]["total_due"])


def load(data_dir: Path) -> Tau2Domain:
    """The telecom domain from its data folder (``db.toml``, ``user_db.toml``, policies)."""
    crm = load_crm_db(data_dir / "db.toml")
    phone = load_phone_db(data_dir / "user_db.toml")
    return Tau2Domain(
        name="telecom",
        policy=telecom_policy(data_dir),
        new_tools=lambda: CrmTools(copy_record(crm)),
        new_user_tools=lambda: PhoneTools(phone),  # it copies the data itself
        sync=sync,
    )
