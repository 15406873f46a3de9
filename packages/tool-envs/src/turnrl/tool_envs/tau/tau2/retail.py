"""tau2-bench retail: the online store's agent tools (orders, products, users).

The database is ``db.json``, one JSON object with the tables ``products``, ``users`` and
``orders`` (each mapping an id to a record). It is parsed once per :func:`load` and
normalised into the form tau2's pydantic ``RetailDB.model_dump()`` gives: fields in the
models' order, unknown fields dropped, numbers of float fields as floats and the optional
order fields (``cancel_reason``, ``exchange_*``, ``return_*``) present as ``None``. Every
episode then runs on a copy-on-write :class:`~turnrl.tool_envs.tau.db.Database` of it: a
tool copies a record the first time it writes it, so the pristine data is never changed
and a fresh toolkit costs a few dict copies.

The tools behave as upstream's, checks and messages in the same order, including its
quirks: ``modify_pending_order_items`` gives every modified item the price and options of
the *last* new item, ``exchange_delivered_order_items`` with no items stores a price
difference of integer ``0``, an error raised part-way keeps what was written before it (a
cancelled order's gift-card refunds), and an address with a non-string field fails with
pydantic's validation message (minus its documentation-link lines).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from turnrl.tool_envs.tau.calculate import calculate as evaluate
from turnrl.tool_envs.tau.db import Database, DataError, PristineData, copy_record
from turnrl.tool_envs.tau.tau2.domain import Tau2Domain
from turnrl.tool_envs.tau.tau2.toolkit import Model, ToolKind, Toolkit, deep_merge, tool

TABLES = ("products", "users", "orders")
"""The tables of the retail database, in ``RetailDB``'s field order."""

CANCEL_REASONS = ("no longer needed", "ordered by mistake")
"""The only reasons ``cancel_pending_order`` accepts."""

ADDRESS_FIELDS = ("address1", "address2", "city", "country", "state", "zip")
"""Fields of an address, in the model's order (which is also its validation order)."""

ORDER_OPTIONAL = (
    "cancel_reason",
    "exchange_items",
    "exchange_new_items",
    "exchange_payment_method_id",
    "exchange_price_difference",
    "return_items",
    "return_payment_method_id",
)
"""Order fields that default to ``None``, in the model's order."""

# --- normalising records into upstream's model_dump form ---------------------------------


def _float(value: Any) -> Any:
    """A float field's value as pydantic stores it: integers become floats."""
    if isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def _address(raw: dict[str, Any]) -> dict[str, Any]:
    return {name: raw[name] for name in ADDRESS_FIELDS}


def _variant(raw: dict[str, Any]) -> dict[str, Any]:
    return {
        "item_id": raw["item_id"],
        "options": dict(raw["options"]),
        "available": raw["available"],
        "price": _float(raw["price"]),
    }


def normalise_product(raw: dict[str, Any]) -> dict[str, Any]:
    """A product record in ``Product.model_dump()`` form."""
    variants = {key: _variant(variant) for key, variant in raw["variants"].items()}
    return {"name": raw["name"], "product_id": raw["product_id"], "variants": variants}


def _payment_method(raw: dict[str, Any]) -> dict[str, Any]:
    source = raw["source"]
    method = {"source": source, "id": raw["id"]}
    if source == "credit_card":
        method["brand"] = raw["brand"]
        method["last_four"] = raw["last_four"]
    elif source == "gift_card":
        method["balance"] = _float(raw["balance"])
    elif source != "paypal":
        raise ValueError(f"unknown payment method source {source!r}")
    return method


def normalise_user(raw: dict[str, Any]) -> dict[str, Any]:
    """A user record in ``User.model_dump()`` form."""
    name = raw["name"]
    methods = raw["payment_methods"]
    return {
        "user_id": raw["user_id"],
        "name": {"first_name": name["first_name"], "last_name": name["last_name"]},
        "address": _address(raw["address"]),
        "email": raw["email"],
        "payment_methods": {key: _payment_method(m) for key, m in methods.items()},
        "orders": list(raw["orders"]),
    }


def _order_item(raw: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": raw["name"],
        "product_id": raw["product_id"],
        "item_id": raw["item_id"],
        "price": _float(raw["price"]),
        "options": dict(raw["options"]),
    }


def _payment(raw: dict[str, Any]) -> dict[str, Any]:
    return {
        "transaction_type": raw["transaction_type"],
        "amount": _float(raw["amount"]),
        "payment_method_id": raw["payment_method_id"],
    }


def normalise_order(raw: dict[str, Any]) -> dict[str, Any]:
    """An order record in ``Order.model_dump()`` form (absent optional fields as ``None``)."""
    order = {
        "order_id": raw["order_id"],
        "user_id": raw["user_id"],
        "address": _address(raw["address"]),
        "items": [_order_item(item) for item in raw["items"]],
        "status": raw["status"],
        "fulfillments": [
            {"tracking_id": list(f["tracking_id"]), "item_ids": list(f["item_ids"])}
            for f in raw["fulfillments"]
        ],
        "payment_history": [_payment(p) for p in raw["payment_history"]],
    }
    for name in ORDER_OPTIONAL:
        value = raw.get(name)
        order[name] = list(value) if isinstance(value, list) else value
    order["exchange_price_difference"] = _float(order["exchange_price_difference"])
    return order


NORMALISERS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "products": normalise_product,
    "users": normalise_user,
    "orders": normalise_order,
}
"""Table name -> the function bringing one of its records into ``model_dump`` form."""


def read_data(path: Path) -> PristineData:
    """Parse and normalise a retail ``db.json`` (once; episodes share the result)."""
    if not path.is_file():
        raise DataError(f"missing retail database {path}")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DataError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict) or any(not isinstance(raw.get(t), dict) for t in TABLES):
        raise DataError(f"{path} must be a JSON object holding the tables {list(TABLES)}")
    tables: dict[str, dict[str, Any]] = {}
    for name in TABLES:
        normalise = NORMALISERS[name]
        try:
            tables[name] = {key: normalise(record) for key, record in raw[name].items()}
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            raise DataError(f"{path}: table {name!r} holds an invalid record ({exc!r})") from exc
    return PristineData(tables)


# --- tool schemas --------------------------------------------------------------------------


def _string(description: str) -> dict[str, Any]:
    return {"type": "string", "description": description}


def _strings(description: str) -> dict[str, Any]:
    return {"type": "array", "items": {"type": "string"}, "description": description}


def _params(required: list[str], **properties: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": required}


ORDER_ID = _string("Order id, starting with '#', e.g. '#W0000000'.")
USER_ID = _string("User id, e.g. 'sara_doe_496'.")
PRODUCT_ID = _string("Product id, e.g. '6086499569' (not an item id).")
PAYMENT_ID = _string(
    "Payment method id, e.g. 'credit_card_0000000' or 'gift_card_0000000' (see the user's "
    "or the order's details); it pays or receives any price difference."
)
ADDRESS_PROPERTIES = {
    "address1": _string("Street line, e.g. '123 Main St'."),
    "address2": _string("Second line, e.g. 'Apt 1', or an empty string."),
    "city": _string("City, e.g. 'San Francisco'."),
    "state": _string("State, e.g. 'CA'."),
    "country": _string("Country, e.g. 'USA'."),
    "zip": _string("Zip code, e.g. '12345'."),
}
ADDRESS_ARGS = ["address1", "address2", "city", "state", "country", "zip"]


def _validation_error(model: str, values: dict[str, Any]) -> ValueError | None:
    """pydantic's error for string fields given non-strings (``None`` when all are strings).

    The text is pydantic's, without the "For further information visit ..." lines, whose
    link names the installed pydantic version.
    """
    lines = []
    for name, value in values.items():
        if not isinstance(value, str):
            lines.append(name)
            lines.append(
                "  Input should be a valid string [type=string_type, "
                f"input_value={value!r}, input_type={type(value).__name__}]"
            )
    if not lines:
        return None
    count = len(lines) // 2
    head = f"{count} validation error{'s' if count > 1 else ''} for {model}"
    return ValueError("\n".join([head, *lines]))


def _new_address(**fields: Any) -> dict[str, Any]:
    address = {name: fields[name] for name in ADDRESS_FIELDS}
    error = _validation_error("UserAddress", address)
    if error is not None:
        raise error
    return address


class RetailTools(Toolkit):
    """The retail agent's 15 tools on one episode's copy-on-write database."""

    side = "assistant"

    def __init__(self, db: Database) -> None:
        self.db = db
        self._written: set[tuple[str, str]] = set()

    # -- database access --

    def state(self) -> dict[str, dict[str, Any]]:
        return self.db.tables

    def db_hash(self) -> str:
        """tau2's hash of the tables, rendering only the records this episode wrote."""
        return self.db.json_hash()

    def update_db(self, data: dict[str, Any]) -> None:
        """Deep-merge ``data`` (table -> id -> fields) into the tables, then re-normalise the
        records written so far, as upstream re-validates its whole model after a merge."""
        for table, patch in data.items():
            if table not in TABLES:
                continue  # upstream's validation ignores unknown fields
            if not isinstance(patch, dict):
                raise ValueError(f"update of table {table!r} must be an object of records")
            records = self.db.tables[table]
            for key, fields in patch.items():
                if key in records and isinstance(fields, dict):
                    deep_merge(self._mutable(table, key), fields)
                else:
                    self.db.put(table, key, copy_record(fields))
                    self._written.add((table, key))
        for table, key in self._written:
            self.db.tables[table][key] = NORMALISERS[table](self.db.tables[table][key])

    def _mutable(self, table: str, key: str) -> dict[str, Any]:
        self._written.add((table, key))
        return self.db.mutable(table, key)

    def _order(self, order_id: str) -> dict[str, Any]:
        if order_id not in self.db.tables["orders"]:
            raise ValueError("Order not found")
        record: dict[str, Any] = self.db.tables["orders"][order_id]
        return record

    def _user(self, user_id: str) -> dict[str, Any]:
        if user_id not in self.db.tables["users"]:
            raise ValueError("User not found")
        record: dict[str, Any] = self.db.tables["users"][user_id]
        return record

    def _variant(self, product_id: str, item_id: str) -> dict[str, Any]:
        products = self.db.tables["products"]
        if product_id not in products:
            raise ValueError("Product not found")
        variants = products[product_id]["variants"]
        if item_id not in variants:
            raise ValueError("Variant not found")
        variant: dict[str, Any] = variants[item_id]
        return variant

    def _payment_method(self, user_id: str, payment_method_id: str) -> dict[str, Any]:
        methods = self._user(user_id)["payment_methods"]
        if payment_method_id not in methods:
            raise ValueError("Payment method not found")
        method: dict[str, Any] = methods[payment_method_id]
        return method

    def _writable_method(self, user_id: str, payment_method_id: str) -> dict[str, Any]:
        """The user's payment method as a private copy (to change a gift card's balance)."""
        self._payment_method(user_id, payment_method_id)
        method: dict[str, Any] = self._mutable("users", user_id)["payment_methods"][
            payment_method_id
        ]
        return method

    def _add_to_gift_card(self, user_id: str, payment_method_id: str, amount: Any) -> None:
        """Add ``amount`` to a gift card's balance (rounded to cents); others are untouched."""
        if self._payment_method(user_id, payment_method_id)["source"] == "gift_card":
            method = self._writable_method(user_id, payment_method_id)
            method["balance"] = round(method["balance"] + amount, 2)

    def _item_count_error(self, order: dict[str, Any], item_ids: list[str]) -> str | None:
        """The first id listed more often than the order holds it, else ``None``."""
        held = [item["item_id"] for item in order["items"]]
        for item_id in item_ids:
            if item_ids.count(item_id) > held.count(item_id):
                return item_id
        return None

    @staticmethod
    def _first_item(order: dict[str, Any], item_id: str) -> dict[str, Any]:
        item = next((item for item in order["items"] if item["item_id"] == item_id), None)
        if item is None:
            raise ValueError(f"Item {item_id} not found")
        return item

    def _new_items(
        self, order: dict[str, Any], item_ids: list[str], new_item_ids: list[str], check_same: bool
    ) -> tuple[Any, dict[str, Any] | None]:
        """Check each (old, new) pair; the summed price difference and the last new variant."""
        diff: Any = 0
        variant = None
        for item_id, new_item_id in zip(item_ids, new_item_ids, strict=False):
            if check_same and item_id == new_item_id:
                raise ValueError("The new item id should be different from the old item id")
            item = self._first_item(order, item_id)
            variant = self._variant(item["product_id"], new_item_id)
            if not variant["available"]:
                raise ValueError(f"New item {new_item_id} not found or available")
            diff += variant["price"] - item["price"]
        return diff, variant

    # -- generic tools --

    @tool(
        ToolKind.GENERIC,
        "Evaluate an arithmetic expression and return the result rounded to 2 decimals.",
        _params(
            ["expression"],
            expression=_string(
                "The expression, e.g. '2 + 2'; only digits, + - * /, parentheses, dots and "
                "spaces are allowed."
            ),
        ),
    )
    def calculate(self, expression: str) -> str:
        if not all(char in "0123456789+-*/(). " for char in expression):
            raise ValueError("Invalid characters in expression")
        if not isinstance(expression, str):  # e.g. a list of allowed characters
            raise TypeError("eval() arg 1 must be a string, bytes or code object")
        result = evaluate(expression)
        if result.startswith("Error: "):
            raise ValueError(result.removeprefix("Error: "))
        return result

    @tool(
        ToolKind.GENERIC,
        "Hand the user over to a human agent, with a summary of their issue. Use it only when "
        "the user explicitly asks for a human, or when the policy and the tools cannot solve "
        "the issue.",
        _params(["summary"], summary=_string("Summary of the user's issue.")),
    )
    def transfer_to_human_agents(self, summary: str) -> str:
        return "Transfer successful"

    # -- read tools --

    @tool(
        ToolKind.READ,
        "Find a user id from an email address; fails when no user has it. Prefer this to the "
        "name-and-zip lookup.",
        _params(["email"], email=_string("Email address, e.g. 'something@example.com'.")),
    )
    def find_user_id_by_email(self, email: str) -> str:
        for user_id, user in self.db.tables["users"].items():
            if user["email"].lower() == email.lower():
                return str(user_id)
        raise ValueError("User not found")

    @tool(
        ToolKind.READ,
        "Find a user id from first name, last name and zip code; fails when no user matches. "
        "Use it only when the user cannot be found by email or does not remember it.",
        _params(
            ["first_name", "last_name", "zip"],
            first_name=_string("First name, e.g. 'John'."),
            last_name=_string("Last name, e.g. 'Doe'."),
            zip=_string("Zip code, e.g. '12345'."),
        ),
    )
    def find_user_id_by_name_zip(self, first_name: str, last_name: str, zip: str) -> str:
        for user_id, user in self.db.tables["users"].items():
            name = user["name"]
            if (
                name["first_name"].lower() == first_name.lower()
                and name["last_name"].lower() == last_name.lower()
                and user["address"]["zip"] == zip
            ):
                return str(user_id)
        raise ValueError("User not found")

    @tool(
        ToolKind.READ,
        "Show an order: status, items, address, fulfilments and payments.",
        _params(["order_id"], order_id=ORDER_ID),
    )
    def get_order_details(self, order_id: str) -> Model:
        return Model(copy_record(self._order(order_id)))

    @tool(
        ToolKind.READ,
        "Show a product's inventory: all its variants (items) with options, availability and "
        "price.",
        _params(["product_id"], product_id=PRODUCT_ID),
    )
    def get_product_details(self, product_id: str) -> Model:
        products = self.db.tables["products"]
        if product_id not in products:
            raise ValueError("Product not found")
        return Model(copy_record(products[product_id]))

    @tool(
        ToolKind.READ,
        "Show a user's details: name, address, email, payment methods and order ids.",
        _params(["user_id"], user_id=USER_ID),
    )
    def get_user_details(self, user_id: str) -> Model:
        return Model(copy_record(self._user(user_id)))

    @tool(
        ToolKind.READ,
        "List every product type (there are 50) as a JSON object from product name to product "
        "id, sorted by name. Each product type has several items (variants) with their own ids "
        "and options.",
    )
    def list_all_product_types(self) -> str:
        by_name = {p["name"]: p["product_id"] for p in self.db.tables["products"].values()}
        return json.dumps(by_name, sort_keys=True)

    # -- write tools --

    @tool(
        ToolKind.WRITE,
        "Cancel a pending order (processed or delivered orders cannot be cancelled). Explain "
        "the cancellation and get the user's explicit yes first. The order becomes 'cancelled' "
        "and every payment is refunded: at once to a gift card, in 5-7 business days "
        "otherwise. Returns the order afterwards.",
        _params(
            ["order_id", "reason"],
            order_id=ORDER_ID,
            reason=_string("Why: 'no longer needed' or 'ordered by mistake'."),
        ),
    )
    def cancel_pending_order(self, order_id: str, reason: str) -> Model:
        order = self._order(order_id)
        if order["status"] != "pending":
            raise ValueError("Non-pending order cannot be cancelled")
        if reason not in CANCEL_REASONS:
            raise ValueError("Invalid reason")
        refunds = []
        for payment in order["payment_history"]:
            refunds.append(
                {
                    "transaction_type": "refund",
                    "amount": payment["amount"],
                    "payment_method_id": payment["payment_method_id"],
                }
            )
            user_id = self._user(order["user_id"])["user_id"]
            self._add_to_gift_card(user_id, payment["payment_method_id"], payment["amount"])
        order = self._mutable("orders", order_id)
        order["status"] = "cancelled"
        order["cancel_reason"] = reason
        order["payment_history"].extend(refunds)
        return Model(copy_record(order))

    @tool(
        ToolKind.WRITE,
        "Exchange items of a delivered order for other items (variants) of the same products. "
        "A delivered order can be returned or exchanged only once. Explain the exchange and "
        "get the user's explicit yes first. Returns the order afterwards.",
        _params(
            ["order_id", "item_ids", "new_item_ids", "payment_method_id"],
            order_id=ORDER_ID,
            item_ids=_strings("Item ids to exchange, e.g. '1008292230'; may repeat an id."),
            new_item_ids=_strings(
                "The replacement item ids, position by position: each must be a variant of "
                "the same product as the item at the same position; may repeat an id."
            ),
            payment_method_id=PAYMENT_ID,
        ),
    )
    def exchange_delivered_order_items(
        self,
        order_id: str,
        item_ids: list[str],
        new_item_ids: list[str],
        payment_method_id: str,
    ) -> Model:
        order = self._order(order_id)
        if order["status"] != "delivered":
            raise ValueError("Non-delivered order cannot be exchanged")
        missing = self._item_count_error(order, item_ids)
        if missing is not None:
            raise ValueError(f"Number of {missing} not found.")
        if len(item_ids) != len(new_item_ids):
            raise ValueError("The number of items to be exchanged should match.")
        diff, _ = self._new_items(order, item_ids, new_item_ids, check_same=False)
        diff = round(diff, 2)
        method = self._payment_method(order["user_id"], payment_method_id)
        if method["source"] == "gift_card" and method["balance"] < diff:
            raise ValueError("Insufficient gift card balance to pay for the price difference")
        order = self._mutable("orders", order_id)
        order["status"] = "exchange requested"
        order["exchange_items"] = sorted(item_ids)
        order["exchange_new_items"] = sorted(new_item_ids)
        order["exchange_payment_method_id"] = payment_method_id
        order["exchange_price_difference"] = diff
        return Model(copy_record(order))

    @tool(
        ToolKind.WRITE,
        "Change the shipping address of a pending order. Explain the change and get the "
        "user's explicit yes first. Returns the order afterwards.",
        _params(["order_id", *ADDRESS_ARGS], order_id=ORDER_ID, **ADDRESS_PROPERTIES),
    )
    def modify_pending_order_address(
        self,
        order_id: str,
        address1: str,
        address2: str,
        city: str,
        state: str,
        country: str,
        zip: str,
    ) -> Model:
        order = self._order(order_id)
        if "pending" not in order["status"]:
            raise ValueError("Non-pending order cannot be modified")
        address = _new_address(
            address1=address1, address2=address2, city=city, state=state, country=country, zip=zip
        )
        order = self._mutable("orders", order_id)
        order["address"] = address
        return Model(copy_record(order))

    @tool(
        ToolKind.WRITE,
        "Swap items of a pending order for other items (variants) of the same products. An "
        "order's items can be modified only once. Explain the change and get the user's "
        "explicit yes first. Returns the order afterwards.",
        _params(
            ["order_id", "item_ids", "new_item_ids", "payment_method_id"],
            order_id=ORDER_ID,
            item_ids=_strings("Item ids to modify, e.g. '1008292230'; may repeat an id."),
            new_item_ids=_strings(
                "The replacement item ids, position by position: each must be a variant of "
                "the same product as the item at the same position; may repeat an id."
            ),
            payment_method_id=PAYMENT_ID,
        ),
    )
    def modify_pending_order_items(
        self,
        order_id: str,
        item_ids: list[str],
        new_item_ids: list[str],
        payment_method_id: str,
    ) -> Model:
        order = self._order(order_id)
        if order["status"] != "pending":
            raise ValueError("Non-pending order cannot be modified")
        missing = self._item_count_error(order, item_ids)
        if missing is not None:
            raise ValueError(f"{missing} not found")
        if len(item_ids) != len(new_item_ids):
            raise ValueError("The number of items to be exchanged should match")
        diff, variant = self._new_items(order, item_ids, new_item_ids, check_same=True)
        user_id = order["user_id"]
        method = self._payment_method(user_id, payment_method_id)
        if method["source"] == "gift_card" and method["balance"] < diff:
            raise ValueError("Insufficient gift card balance to pay for the new item")
        order = self._mutable("orders", order_id)
        order["payment_history"].append(
            {
                "transaction_type": "payment" if diff > 0 else "refund",
                "amount": _float(abs(diff)),
                "payment_method_id": payment_method_id,
            }
        )
        if method["source"] == "gift_card":
            method = self._writable_method(user_id, payment_method_id)
            method["balance"] = round(method["balance"] - diff, 2)
        for item_id, new_item_id in zip(item_ids, new_item_ids, strict=False):
            item = self._first_item(order, item_id)
            item["item_id"] = new_item_id
            if variant is not None:  # upstream: the last pair's variant, for every item
                item["price"] = variant["price"]
                item["options"] = dict(variant["options"])
        order["status"] = "pending (item modified)"
        return Model(copy_record(order))

    @tool(
        ToolKind.WRITE,
        "Pay a pending order with another of the user's payment methods; the old one is "
        "refunded. Explain the change and get the user's explicit yes first. Returns the order "
        "afterwards.",
        _params(["order_id", "payment_method_id"], order_id=ORDER_ID, payment_method_id=PAYMENT_ID),
    )
    def modify_pending_order_payment(self, order_id: str, payment_method_id: str) -> Model:
        order = self._order(order_id)
        if "pending" not in order["status"]:
            raise ValueError("Non-pending order cannot be modified")
        user_id = order["user_id"]
        method = self._payment_method(user_id, payment_method_id)
        history = order["payment_history"]
        if len(history) != 1 or history[0]["transaction_type"] != "payment":
            raise ValueError("There should be exactly one payment for a pending order")
        old_id = history[0]["payment_method_id"]
        if old_id == payment_method_id:
            raise ValueError("The new payment method should be different from the current one")
        amount = history[0]["amount"]
        if method["source"] == "gift_card" and method["balance"] < amount:
            raise ValueError("Insufficient gift card balance to pay for the order")
        order = self._mutable("orders", order_id)
        order["payment_history"].extend(
            [
                {
                    "transaction_type": "payment",
                    "amount": amount,
                    "payment_method_id": payment_method_id,
                },
                {"transaction_type": "refund", "amount": amount, "payment_method_id": old_id},
            ]
        )
        self._add_to_gift_card(user_id, payment_method_id, -amount)
        self._add_to_gift_card(user_id, old_id, amount)
        return Model(copy_record(order))

    @tool(
        ToolKind.WRITE,
        "Change a user's default address. Explain the change and get the user's explicit yes "
        "first. Returns the user afterwards.",
        _params(["user_id", *ADDRESS_ARGS], user_id=USER_ID, **ADDRESS_PROPERTIES),
    )
    def modify_user_address(
        self,
        user_id: str,
        address1: str,
        address2: str,
        city: str,
        state: str,
        country: str,
        zip: str,
    ) -> Model:
        self._user(user_id)
        address = _new_address(
            address1=address1, address2=address2, city=city, state=state, country=country, zip=zip
        )
        user = self._mutable("users", user_id)
        user["address"] = address
        return Model(copy_record(user))

    @tool(
        ToolKind.WRITE,
        "Return items of a delivered order; the order becomes 'return requested' and the user "
        "gets an email on how to send the items back. The refund goes to the original payment "
        "method or to a gift card. Explain the return and get the user's explicit yes first. "
        "Returns the order afterwards.",
        _params(
            ["order_id", "item_ids", "payment_method_id"],
            order_id=ORDER_ID,
            item_ids=_strings("Item ids to return, e.g. '1008292230'; may repeat an id."),
            payment_method_id=_string(
                "Payment method id receiving the refund: the order's original one or a gift "
                "card, e.g. 'gift_card_0000000' or 'credit_card_0000000'."
            ),
        ),
    )
    def return_delivered_order_items(
        self, order_id: str, item_ids: list[str], payment_method_id: str
    ) -> Model:
        order = self._order(order_id)
        if order["status"] != "delivered":
            raise ValueError("Non-delivered order cannot be returned")
        user_id = self._user(order["user_id"])["user_id"]
        method = self._payment_method(user_id, payment_method_id)
        if (
            method["source"] != "gift_card"
            and payment_method_id != order["payment_history"][0]["payment_method_id"]
        ):
            raise ValueError("Payment method should be the original payment method")
        if self._item_count_error(order, item_ids) is not None:
            raise ValueError("Some item not found")
        order = self._mutable("orders", order_id)
        order["status"] = "return requested"
        order["return_items"] = sorted(item_ids)
        order["return_payment_method_id"] = payment_method_id
        return Model(copy_record(order))


def load(data_dir: Path) -> Tau2Domain:
    """The retail domain from ``<data_dir>/db.json`` and ``policy.md`` (parsed once)."""
    data_dir = Path(data_dir)
    pristine = read_data(data_dir / "db.json")
    policy = (data_dir / "policy.md").read_text(encoding="utf-8")

    def new_tools() -> RetailTools:
        return RetailTools(pristine.new_database())

    return Tau2Domain(name="retail", policy=policy, new_tools=new_tools)
