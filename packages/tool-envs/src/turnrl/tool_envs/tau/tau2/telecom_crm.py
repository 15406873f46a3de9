"""tau2-bench telecom, the agent's side: the carrier's CRM (customers, lines, plans, bills).

The database is ``db.toml`` held as a plain dict in the form tau2's pydantic ``TelecomDB``
dumps it (tables ``plans``, ``customers``, ``lines``, ``bills``, ``devices``, each a list of
records; enums as their string values, dates as ``"YYYY-MM-DD"``, date-times as
``"YYYY-MM-DD HH:MM:SS"``, absent optional fields as ``None``), so that tau2's hash of it
and the JSON of every record a tool returns are the ones upstream gives.

Loading and :meth:`CrmTools.update_db` check and coerce records against :data:`MODELS` as
pydantic's validation does (numbers of float fields become floats, defaults are filled
in); the tools write values as they receive them, without coercion, as upstream assigns
attributes without validating them.

Time is frozen: "today" is :data:`TODAY` (2025-02-25), as upstream's telecom code fixes it.

Besides the tools, :class:`CrmTools` has the hidden methods the tasks call on the agent's
side (``set_data_usage``, ``suspend_line_for_overdue_bill``, ``assert_*``) and the lookups
the domain's ``sync`` needs (:meth:`~CrmTools.find_line_by_phone`,
:meth:`~CrmTools.find_plan`, :meth:`~CrmTools.bills_awaiting_payment`,
:meth:`~CrmTools.mark_bill_paid`).
"""

from __future__ import annotations

import datetime as dt
import tomllib
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from turnrl.tool_envs.tau.db import copy_record
from turnrl.tool_envs.tau.tau2.toolkit import Model, ToolKind, Toolkit, deep_merge, tool

TODAY = dt.date(2025, 2, 25)
"""The frozen current date of the telecom domain (upstream: 2025-02-25 12:08)."""

UPSTREAM_CLASS = "TelecomTools"
"""Upstream's toolkit class name, which Python writes into argument errors."""

# --- the database schema (upstream's data_model.py, as field specs) -------------------------

REQUIRED = object()
"""Marks a field without a default."""

LINE_STATUSES = ("Active", "Suspended", "Pending Activation", "Closed")
BILL_STATUSES = ("Draft", "Issued", "Awaiting Payment", "Paid", "Overdue", "Disputed")
ACCOUNT_STATUSES = ("Active", "Suspended", "Pending Verification", "Closed")
DEVICE_TYPES = ("phone", "router", "tablet", "watch", "other")
PAYMENT_METHOD_TYPES = ("Credit Card", "Debit Card", "PayPal")

# A field spec is (name, type, default). Types: "str", "float", "bool", "date",
# "datetime", a tuple of allowed strings (an enum), a model name, or ["<model>"] (a list of
# that model). Optional fields default to None; list defaults are copied per record.
MODELS: dict[str, list[tuple[str, Any, Any]]] = {
    "Address": [
        ("street", "str", REQUIRED),
        ("city", "str", REQUIRED),
        ("state", "str", REQUIRED),
        ("zip_code", "str", REQUIRED),
    ],
    "Plan": [
        ("plan_id", "str", REQUIRED),
        ("name", "str", REQUIRED),
        ("data_limit_gb", "float", REQUIRED),
        ("price_per_month", "float", REQUIRED),
        ("data_refueling_price_per_gb", "float", REQUIRED),
    ],
    "Device": [
        ("device_id", "str", REQUIRED),
        ("device_type", DEVICE_TYPES, REQUIRED),
        ("model", "str", REQUIRED),
        ("imei", "str", None),
        ("is_esim_capable", "bool", REQUIRED),
        ("activated", "bool", False),
        ("activation_date", "datetime", None),
        ("last_esim_transfer_date", "datetime", None),
    ],
    "Line": [
        ("line_id", "str", REQUIRED),
        ("phone_number", "str", REQUIRED),
        ("status", LINE_STATUSES, "Pending Activation"),
        ("plan_id", "str", REQUIRED),
        ("device_id", "str", None),
        ("data_used_gb", "float", 0.0),
        ("data_refueling_gb", "float", 0.0),
        ("roaming_enabled", "bool", False),
        ("contract_end_date", "date", None),
        ("last_plan_change_date", "date", None),
        ("last_sim_replacement_date", "date", None),
        ("suspension_start_date", "date", None),
    ],
    "LineItem": [
        ("description", "str", REQUIRED),
        ("amount", "float", REQUIRED),
        ("date", "date", REQUIRED),
        ("item_type", "str", REQUIRED),
    ],
    "Bill": [
        ("bill_id", "str", REQUIRED),
        ("customer_id", "str", REQUIRED),
        ("period_start", "date", REQUIRED),
        ("period_end", "date", REQUIRED),
        ("issue_date", "date", REQUIRED),
        ("total_due", "float", REQUIRED),
        ("due_date", "date", REQUIRED),
        ("line_items", ["LineItem"], []),
        ("status", BILL_STATUSES, "Draft"),
    ],
    "PaymentMethod": [
        ("method_type", PAYMENT_METHOD_TYPES, REQUIRED),
        ("account_number_last_4", "str", REQUIRED),
        ("expiration_date", "str", REQUIRED),
    ],
    "Customer": [
        ("customer_id", "str", REQUIRED),
        ("full_name", "str", REQUIRED),
        ("date_of_birth", "str", REQUIRED),
        ("email", "str", REQUIRED),
        ("phone_number", "str", REQUIRED),
        ("address", "Address", REQUIRED),
        ("account_status", ACCOUNT_STATUSES, "Pending Verification"),
        ("payment_methods", ["PaymentMethod"], []),
        ("line_ids", ["str"], []),
        ("bill_ids", ["str"], []),
        # upstream's default is a date (not a date-time) and is dumped as it is
        ("created_at", "datetime", "2025-01-01"),
        ("last_extension_date", "date", None),
        ("goodwill_credit_used_this_year", "float", 0.0),
    ],
    "TelecomDB": [
        ("plans", ["Plan"], []),
        ("customers", ["Customer"], []),
        ("lines", ["Line"], []),
        ("bills", ["Bill"], []),
        ("devices", ["Device"], []),
    ],
}


def _as_date(value: Any, where: str) -> str:
    if isinstance(value, dt.datetime):
        if value.time() != dt.time(0):
            raise ValueError(f"{where}: a date-time with a time is not a date: {value}")
        return str(value.date())
    if isinstance(value, dt.date):
        return str(value)
    if isinstance(value, str):
        try:
            return str(dt.date.fromisoformat(value))
        except ValueError:
            return _as_date(dt.datetime.fromisoformat(value), where)
    raise ValueError(f"{where}: expected a date, got {value!r}")


def _as_datetime(value: Any, where: str) -> str:
    if isinstance(value, dt.datetime):
        return str(value)
    if isinstance(value, dt.date):
        return str(dt.datetime(value.year, value.month, value.day))
    if isinstance(value, str):
        return str(dt.datetime.fromisoformat(value))
    raise ValueError(f"{where}: expected a date-time, got {value!r}")


def _as_float(value: Any, where: str) -> float:
    if isinstance(value, int | float | str) and not isinstance(value, bool):
        try:
            return float(value)
        except ValueError:
            pass
    raise ValueError(f"{where}: expected a number, got {value!r}")


def _coerce(value: Any, kind: Any, where: str) -> Any:
    """One field value in ``model_dump`` form; raises ``ValueError`` on a wrong value."""
    if isinstance(kind, list):
        if not isinstance(value, list):
            raise ValueError(f"{where}: expected a list, got {value!r}")
        return [_coerce(item, kind[0], f"{where}[{i}]") for i, item in enumerate(value)]
    if isinstance(kind, tuple):
        if value not in kind:
            raise ValueError(f"{where}: {value!r} is not one of {list(kind)}")
        return value
    if kind in MODELS:
        return normalize_record(kind, value, where)
    if kind == "str":
        if not isinstance(value, str):
            raise ValueError(f"{where}: expected a string, got {value!r}")
        return value
    if kind == "bool":
        if not isinstance(value, bool):
            raise ValueError(f"{where}: expected a boolean, got {value!r}")
        return value
    if kind == "float":
        return _as_float(value, where)
    if kind == "date":
        return _as_date(value, where)
    if kind == "datetime":
        return _as_datetime(value, where)
    raise AssertionError(f"unknown field type {kind!r}")


def normalize_record(model: str, data: Any, where: str = "") -> dict[str, Any]:
    """``data`` checked against :data:`MODELS` ``[model]`` and put in ``model_dump`` form."""
    where = where or model
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected an object, got {data!r}")
    fields = MODELS[model]
    extra = set(data) - {name for name, _, _ in fields}
    if extra:
        raise ValueError(f"{where}: unknown fields {sorted(extra)}")
    out: dict[str, Any] = {}
    for name, kind, default in fields:
        if name not in data:
            if default is REQUIRED:
                raise ValueError(f"{where}: missing field {name!r}")
            out[name] = copy_record(default)
        elif data[name] is None and default is None:
            out[name] = None
        else:
            out[name] = _coerce(data[name], kind, f"{where}.{name}")
    return out


def normalize_crm_db(data: dict[str, Any]) -> dict[str, Any]:
    """The whole CRM database in ``TelecomDB.model_dump()`` form (a new dict)."""
    return normalize_record("TelecomDB", data)


def load_crm_db(path: str | Path) -> dict[str, Any]:
    """Read ``db.toml`` into the ``model_dump`` form."""
    with open(path, "rb") as f:
        return normalize_crm_db(tomllib.load(f))


# --- the toolkit ------------------------------------------------------------------------------


def _string(description: str) -> dict[str, str]:
    return {"type": "string", "description": description}


def _params(required: list[str], **properties: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": required}


CUSTOMER_ID = _string("ID of the customer, e.g. C1001.")
LINE_ID = _string("ID of the line, e.g. L1001.")
CUSTOMER_LINE = _params(
    ["customer_id", "line_id"],
    customer_id=_string("ID of the customer who owns the line."),
    line_id=LINE_ID,
)


def _next_month_start(day: dt.date) -> dt.date:
    return (day.replace(day=1) + dt.timedelta(days=32)).replace(day=1)


def _month_end(start: dt.date) -> dt.date:
    """The last day of the month that begins on ``start``."""
    return _next_month_start(start) - dt.timedelta(days=1)


class CrmTools(Toolkit):
    """The agent's telecom tools over one episode's CRM database (a dict it owns)."""

    side = "assistant"

    def __init__(self, db: dict[str, Any]) -> None:
        self.db = db

    def state(self) -> dict[str, Any]:
        return self.db

    def use(self, name: str, arguments: dict[str, Any]) -> Any:
        """Run a tool; a call that does not fit its signature fails as upstream's does, whose
        error text names upstream's class (``TelecomTools.get_customer_by_id() missing ...``)."""
        try:
            return super().use(name, arguments)
        except TypeError as exc:
            mine = f"{type(self).__name__}.{name}()"
            if str(exc).startswith(mine):
                raise TypeError(UPSTREAM_CLASS + str(exc)[len(type(self).__name__) :]) from None
            raise

    def update_db(self, data: dict[str, Any]) -> None:
        merged = copy_record(self.db)
        deep_merge(merged, data)
        self.db = normalize_crm_db(merged)

    # -- lookups (raise ValueError with upstream's texts) --

    def _table(self, name: str) -> list[dict[str, Any]]:
        table: list[dict[str, Any]] = self.db[name]
        return table

    def _find(self, table: str, key: str, value: Any, label: str) -> dict[str, Any]:
        for record in self._table(table):
            if record[key] == value:
                return record
        raise ValueError(f"{label} with ID {value} not found")

    def find_line(self, line_id: str) -> dict[str, Any]:
        return self._find("lines", "line_id", line_id, "Line")

    def find_line_by_phone(self, phone_number: str) -> dict[str, Any]:
        """The line with this phone number (raises ``ValueError`` when there is none)."""
        for line in self._table("lines"):
            if line["phone_number"] == phone_number:
                return line
        raise ValueError(f"Line with phone number {phone_number} not found")

    def find_plan(self, plan_id: str) -> dict[str, Any]:
        return self._find("plans", "plan_id", plan_id, "Plan")

    def find_device(self, device_id: str) -> dict[str, Any]:
        return self._find("devices", "device_id", device_id, "Device")

    def find_bill(self, bill_id: str) -> dict[str, Any]:
        return self._find("bills", "bill_id", bill_id, "Bill")

    def find_customer(self, customer_id: str) -> dict[str, Any]:
        return self._find("customers", "customer_id", customer_id, "Customer")

    def find_customer_by_phone(self, phone_number: str) -> dict[str, Any]:
        """The customer whose contact number, or one of whose lines, is ``phone_number``."""
        for customer in self._table("customers"):
            if customer["phone_number"] == phone_number:
                return customer
            for line_id in customer["line_ids"]:
                if self.find_line(line_id)["phone_number"] == phone_number:
                    return customer
        raise ValueError(f"Customer with phone number {phone_number} not found")

    def _customer_line(self, customer_id: str, line_id: str) -> dict[str, Any]:
        customer = self.find_customer(customer_id)
        if line_id not in customer["line_ids"]:
            raise ValueError(f"Line {line_id} not found for customer {customer_id}")
        return self.find_line(line_id)

    def bills_awaiting_payment(self, customer: dict[str, Any]) -> list[dict[str, Any]]:
        """The customer's bills in status "Awaiting Payment", in the customer's bill order."""
        bills = [self.find_bill(bill_id) for bill_id in customer["bill_ids"]]
        return [bill for bill in bills if bill["status"] == "Awaiting Payment"]

    def mark_bill_paid(self, bill_id: str) -> None:
        self.find_bill(bill_id)["status"] = "Paid"

    def get_available_plan_ids(self) -> list[str]:
        return [plan["plan_id"] for plan in self.db["plans"]]

    # -- read tools --

    @tool(
        ToolKind.READ,
        "Look up the customer who has this phone number, as contact number or on one of "
        "their lines.",
        _params(["phone_number"], phone_number=_string("Phone number, e.g. 555-123-2002.")),
    )
    def get_customer_by_phone(self, phone_number: str) -> Model:
        return Model(self.find_customer_by_phone(phone_number))

    @tool(
        ToolKind.READ,
        "Look up a customer by customer ID.",
        _params(["customer_id"], customer_id=CUSTOMER_ID),
    )
    def get_customer_by_id(self, customer_id: str) -> Model:
        return Model(self.find_customer(customer_id))

    @tool(
        ToolKind.READ,
        "Find customers by full name and date of birth. Returns a list, which can hold several "
        "customers or none; the date of birth tells same-named customers apart.",
        _params(
            ["full_name", "dob"],
            full_name=_string("The customer's full name."),
            dob=_string("Date of birth as YYYY-MM-DD."),
        ),
    )
    def get_customer_by_name(self, full_name: str, dob: str) -> list[Model]:
        return [
            Model(customer)
            for customer in self.db["customers"]
            if customer["full_name"].lower() == full_name.lower()
            and customer["date_of_birth"] == dob
        ]

    @tool(
        ToolKind.READ,
        "Get the record behind an ID of a customer (C...), line (L...), device (D...), "
        "bill (B...) or plan (P...).",
        _params(["id"], id=_string("The ID to look up; its first letter tells its kind.")),
    )
    def get_details_by_id(self, id: str) -> Model:
        finders: dict[str, Callable[[str], dict[str, Any]]] = {
            "L": self.find_line,
            "D": self.find_device,
            "B": self.find_bill,
            "C": self.find_customer,
            "P": self.find_plan,
        }
        for prefix, find in finders.items():
            if id.startswith(prefix):
                return Model(find(id))
        raise ValueError(f"Unknown ID format or type: {id}")

    @tool(
        ToolKind.READ,
        "List a customer's bills, newest issue date first.",
        _params(
            ["customer_id"],
            customer_id=CUSTOMER_ID,
            limit={"type": "integer", "description": "At most this many bills (default 12)."},
        ),
    )
    def get_bills_for_customer(self, customer_id: str, limit: int = 12) -> list[Model]:
        customer = self.find_customer(customer_id)
        bills = [self.find_bill(bill_id) for bill_id in customer["bill_ids"]]
        newest_first = sorted(bills, key=lambda bill: bill["issue_date"], reverse=True)
        return [Model(bill) for bill in newest_first[:limit]]

    @tool(
        ToolKind.READ,
        "Data usage of a line in the current billing cycle: GB used, the plan's GB limit, GB "
        "refueled this cycle, and the cycle's end date.",
        CUSTOMER_LINE,
    )
    def get_data_usage(self, customer_id: str, line_id: str) -> dict[str, Any]:
        line = self._customer_line(customer_id, line_id)
        plan = self.find_plan(line["plan_id"])
        return {
            "line_id": line_id,
            "data_used_gb": line["data_used_gb"],
            "data_limit_gb": plan["data_limit_gb"],
            "data_refueling_gb": line["data_refueling_gb"],
            "cycle_end_date": str(_month_end(TODAY.replace(day=1))),
        }

    # -- write tools --

    @tool(
        ToolKind.WRITE,
        "Suspend an active line (for at most 6 months); a $5/month holding fee applies while "
        "it is suspended. Fails unless the line is Active.",
        _params(
            ["customer_id", "line_id", "reason"],
            customer_id=_string("ID of the customer who owns the line."),
            line_id=_string("ID of the line to suspend."),
            reason=_string("Why the line is suspended."),
        ),
    )
    def suspend_line(self, customer_id: str, line_id: str, reason: str) -> dict[str, Any]:
        line = self._customer_line(customer_id, line_id)
        if line["status"] != "Active":
            raise ValueError("Line must be active to suspend")
        line["status"] = "Suspended"
        line["suspension_start_date"] = str(TODAY)
        return {
            "message": "Line suspended successfully. $5/month holding fee will apply.",
            "line": Model(line),
        }

    @tool(
        ToolKind.WRITE,
        "Reactivate a line that is Suspended or Pending Activation; clears its suspension date.",
        _params(
            ["customer_id", "line_id"],
            customer_id=_string("ID of the customer who owns the line."),
            line_id=_string("ID of the line to reactivate."),
        ),
    )
    def resume_line(self, customer_id: str, line_id: str) -> dict[str, Any]:
        line = self._customer_line(customer_id, line_id)
        if line["status"] not in ("Suspended", "Pending Activation"):
            raise ValueError("Line must be suspended to resume")
        line["status"] = "Active"
        line["suspension_start_date"] = None
        return {"message": "Line resumed successfully", "line": Model(line)}

    @tool(
        ToolKind.WRITE,
        "Ask the customer to pay one of their bills: the bill becomes Awaiting Payment and the "
        "customer gets the request on their phone. Fails when another of the customer's bills "
        "is already awaiting payment. It does not check whether the bill is already paid, so "
        "check the bill's status first.",
        _params(
            ["customer_id", "bill_id"],
            customer_id=_string("ID of the customer who owns the bill."),
            bill_id=_string("ID of the bill to be paid."),
        ),
    )
    def send_payment_request(self, customer_id: str, bill_id: str) -> str:
        customer = self.find_customer(customer_id)
        if self.bills_awaiting_payment(customer):
            raise ValueError("A bill is already awaiting payment for this customer")
        if bill_id not in customer["bill_ids"]:
            raise ValueError(f"Bill {bill_id} not found for customer {customer_id}")
        bill = self.find_bill(bill_id)
        bill["status"] = "Awaiting Payment"
        return f"Payment request sent to the customer for bill {bill['bill_id']}"

    @tool(ToolKind.WRITE, "Turn international roaming on for a line.", CUSTOMER_LINE)
    def enable_roaming(self, customer_id: str, line_id: str) -> str:
        line = self._customer_line(customer_id, line_id)
        if line["roaming_enabled"]:
            return "Roaming was already enabled"
        line["roaming_enabled"] = True
        return "Roaming enabled successfully"

    @tool(ToolKind.WRITE, "Turn international roaming off for a line.", CUSTOMER_LINE)
    def disable_roaming(self, customer_id: str, line_id: str) -> str:
        line = self._customer_line(customer_id, line_id)
        if not line["roaming_enabled"]:
            return "Roaming was already disabled"
        line["roaming_enabled"] = False
        return "Roaming disabled successfully"

    @tool(
        ToolKind.WRITE,
        "Add extra data to a line for the current cycle; the customer is charged the plan's "
        "refueling price per GB on their next bill.",
        _params(
            ["customer_id", "line_id", "gb_amount"],
            customer_id=_string("ID of the customer who owns the line."),
            line_id=_string("ID of the line to refuel."),
            gb_amount={"type": "number", "description": "GB of data to add (more than 0)."},
        ),
    )
    def refuel_data(self, customer_id: str, line_id: str, gb_amount: float) -> dict[str, Any]:
        line = self._customer_line(customer_id, line_id)
        if gb_amount <= 0:
            raise ValueError("Refuel amount must be positive")
        price = self.find_plan(line["plan_id"])["data_refueling_price_per_gb"]
        charge = gb_amount * price
        line["data_refueling_gb"] += gb_amount
        self._charge_next_bill(
            customer_id, charge, f"Data refueling: {gb_amount} GB at ${price}/GB"
        )
        return {
            "message": f"Successfully added {gb_amount} GB of data for line {line_id} for ${charge:.2f}",
            "new_data_refueling_gb": line["data_refueling_gb"],
            "charge": charge,
        }

    @tool(
        ToolKind.GENERIC,
        "Hand the customer over to a human agent, with a summary of their issue. Only do so "
        "when the customer asks for a human, or when the policy and your tools cannot solve "
        "their issue.",
        _params(["summary"], summary=_string("Summary of the customer's issue.")),
    )
    def transfer_to_human_agents(self, summary: str) -> str:
        return "Transfer successful"

    def _charge_next_bill(self, customer_id: str, amount: float, description: str) -> None:
        """Add a charge (or a credit, when negative) to the customer's draft bill, opening a
        draft bill for next month when there is none."""
        customer = self.find_customer(customer_id)
        drafts = [self.find_bill(b) for b in customer["bill_ids"]]
        draft = next((bill for bill in drafts if bill["status"] == "Draft"), None)
        if draft is None:
            start = _next_month_start(TODAY)
            draft = {
                "bill_id": f"B{uuid.uuid4().hex[:8]}",
                "customer_id": customer_id,
                "period_start": str(start),
                "period_end": str(_month_end(start)),
                "issue_date": str(start),
                "total_due": 0.0,
                "due_date": str(start + dt.timedelta(days=14)),
                "line_items": [],
                "status": "Draft",
            }
            self.db["bills"].append(draft)
            customer["bill_ids"].append(draft["bill_id"])
        item_type = "Credit" if amount < 0 else "Charge"
        draft["line_items"].append(
            {
                "description": description,
                "amount": float(amount),
                "date": str(TODAY),
                "item_type": item_type,
            }
        )
        draft["total_due"] += amount

    # -- hidden methods: task set-up --

    def set_data_usage(self, customer_id: str, line_id: str, data_used_gb: float) -> str:
        """Set the GB a line has used this cycle."""
        self._customer_line(customer_id, line_id)["data_used_gb"] = data_used_gb
        return f"Data usage set to {data_used_gb} GB for line {line_id}"

    def suspend_line_for_overdue_bill(
        self, customer_id: str, line_id: str, new_bill_id: str, contract_ended: bool
    ) -> str:
        """Give the customer an overdue bill for last month's plan charge of the line and
        suspend the line; with ``contract_ended`` its contract also ends last month."""
        line = self.find_line(line_id)
        if line["status"] != "Active":
            raise ValueError("Line must be active to suspend for unpaid bill")
        plan = self.find_plan(line["plan_id"])
        amount = plan["price_per_month"]
        if amount <= 0:
            raise ValueError("Amount must be positive for overdue bill")
        customer = self.find_customer(customer_id)
        if any(self.find_bill(b)["status"] == "Overdue" for b in customer["bill_ids"]):
            raise ValueError("Customer already has an overdue bill")
        last_month_end = TODAY.replace(day=1) - dt.timedelta(days=1)
        last_month_start = last_month_end.replace(day=1)
        charge = {
            "description": f"Charge for line {line['line_id']}",
            "amount": float(amount),
            "date": str(TODAY),
            "item_type": "Charge",
        }
        self.db["bills"].append(
            {
                "bill_id": new_bill_id,
                "customer_id": customer_id,
                "period_start": str(last_month_start),
                "period_end": str(last_month_end),
                "issue_date": str(last_month_start),
                "total_due": 0.0 + amount,
                "due_date": str(last_month_start + dt.timedelta(days=14)),
                "line_items": [charge],
                "status": "Overdue",
            }
        )
        customer["bill_ids"].append(new_bill_id)
        line["status"] = "Suspended"
        line["suspension_start_date"] = str(TODAY)
        if contract_ended:
            line["contract_end_date"] = str(last_month_end)
        return f"Line {line_id} suspended for unpaid bill {new_bill_id}. Contract ended: {contract_ended}"

    # -- hidden methods: assertions --

    def assert_data_refueling_amount(
        self, customer_id: str, line_id: str, expected_amount: float
    ) -> bool:
        """Whether the line's refueled GB this cycle is ``expected_amount`` (within 1e-6)."""
        line = self._customer_line(customer_id, line_id)
        return bool(abs(line["data_refueling_gb"] - expected_amount) < 1e-6)

    def assert_line_status(self, customer_id: str, line_id: str, expected_status: str) -> bool:
        """Whether the line's status is ``expected_status``."""
        return bool(self._customer_line(customer_id, line_id)["status"] == expected_status)

    def assert_overdue_bill_exists(self, customer_id: str, overdue_bill_id: str) -> bool:
        """True when the customer has this bill and it is overdue; raises otherwise."""
        customer = self.find_customer(customer_id)
        if overdue_bill_id not in customer["bill_ids"]:
            raise ValueError(f"Overdue bill {overdue_bill_id} not found")
        if self.find_bill(overdue_bill_id)["status"] != "Overdue":
            raise ValueError(f"Overdue bill {overdue_bill_id} is not overdue")
        return True

    def assert_no_overdue_bill(self, overdue_bill_id: str) -> bool:
        """Whether the bill is gone from the database or paid."""
        try:
            bill = self.find_bill(overdue_bill_id)
        except ValueError:
            return True
        return bool(bill["status"] == "Paid")
