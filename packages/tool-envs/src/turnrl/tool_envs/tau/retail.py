"""The 16 tau-bench retail tools, behaving as ``SPEC.md`` §8 specifies.

Every tool takes the episode :class:`~turnrl.tool_envs.tau.db.Database` first and the
action's keyword arguments after it, checks in the specified order (returning the exact
``Error: ...`` strings), and only then writes — through ``db.mutable`` so the shared
pristine records stay untouched. Records are returned as ``json.dumps`` with default
settings (insertion key order), exactly as upstream.
"""

from __future__ import annotations

import json
from typing import Any

from turnrl.tool_envs.tau.calculate import calculate as _calculate
from turnrl.tool_envs.tau.db import Database
from turnrl.tool_envs.tau.toolkit import collect_tools, tool

CANCEL_REASONS = ("no longer needed", "ordered by mistake")


def _count_check(order: dict[str, Any], item_ids: list[Any]) -> Any:
    """The first id asked for more often than the order holds it, else ``None``."""
    all_ids = [item["item_id"] for item in order["items"]]
    for x in item_ids:
        if item_ids.count(x) > all_ids.count(x):
            return x
    return None


def _first_item(order: dict[str, Any], item_id: Any) -> dict[str, Any]:
    return next(item for item in order["items"] if item["item_id"] == item_id)


def _price_difference(
    db: Database, order: dict[str, Any], item_ids: list[Any], new_item_ids: list[Any]
) -> tuple[Any, Any]:
    """Sum of (new price - old price) left to right from int 0; or the failing new id."""
    products = db.tables["products"]
    diff: Any = 0
    for old_id, new_id in zip(item_ids, new_item_ids, strict=False):
        item = _first_item(order, old_id)
        variants = products[item["product_id"]]["variants"]
        if new_id not in variants or not variants[new_id]["available"]:
            return None, new_id
        diff = diff + (variants[new_id]["price"] - item["price"])
    return diff, None


@tool("Calculate")
def calculate(db: Database, expression: Any) -> str:
    return _calculate(expression)


@tool("CancelPendingOrder")
def cancel_pending_order(db: Database, order_id: Any, reason: Any) -> str:
    orders = db.tables["orders"]
    if order_id not in orders:
        return "Error: order not found"
    if orders[order_id]["status"] != "pending":
        return "Error: non-pending order cannot be cancelled"
    if reason not in CANCEL_REASONS:
        return "Error: invalid reason"
    order = db.mutable("orders", order_id)
    refunds = []
    for payment in order["payment_history"]:
        pm_id = payment["payment_method_id"]
        refunds.append(
            {"transaction_type": "refund", "amount": payment["amount"], "payment_method_id": pm_id}
        )
        if "gift_card" in pm_id:
            method = db.mutable("users", order["user_id"])["payment_methods"][pm_id]
            method["balance"] = round(method["balance"] + payment["amount"], 2)
    order["status"] = "cancelled"
    order["cancel_reason"] = reason
    order["payment_history"].extend(refunds)
    return json.dumps(order)


@tool("ExchangeDeliveredOrderItems")
def exchange_delivered_order_items(
    db: Database, order_id: Any, item_ids: Any, new_item_ids: Any, payment_method_id: Any
) -> str:
    orders = db.tables["orders"]
    if order_id not in orders:
        return "Error: order not found"
    order = orders[order_id]
    if order["status"] != "delivered":
        return "Error: non-delivered order cannot be exchanged"
    missing = _count_check(order, item_ids)
    if missing is not None:
        return f"Error: {missing} not found"
    if len(item_ids) != len(new_item_ids):
        return "Error: the number of items to be exchanged should match"
    diff, bad_id = _price_difference(db, order, item_ids, new_item_ids)
    if bad_id is not None:
        return f"Error: new item {bad_id} not found or available"
    diff = round(diff, 2)
    methods = db.tables["users"][order["user_id"]]["payment_methods"]
    if payment_method_id not in methods:
        return "Error: payment method not found"
    method = methods[payment_method_id]
    if method["source"] == "gift_card" and method["balance"] < diff:
        return "Error: insufficient gift card balance to pay for the price difference"
    order = db.mutable("orders", order_id)
    order["status"] = "exchange requested"
    order["exchange_items"] = sorted(item_ids)
    order["exchange_new_items"] = sorted(new_item_ids)
    order["exchange_payment_method_id"] = payment_method_id
    order["exchange_price_difference"] = diff
    return json.dumps(order)


@tool("FindUserIdByEmail")
def find_user_id_by_email(db: Database, email: Any) -> str:
    for user_id, user in db.tables["users"].items():
        if user["email"].lower() == email.lower():
            return user_id
    return "Error: user not found"


@tool("FindUserIdByNameZip")
def find_user_id_by_name_zip(db: Database, first_name: Any, last_name: Any, zip: Any) -> str:
    for user_id, user in db.tables["users"].items():
        name = user["name"]
        if (
            name["first_name"].lower() == first_name.lower()
            and name["last_name"].lower() == last_name.lower()
            and user["address"]["zip"] == zip
        ):
            return user_id
    return "Error: user not found"


@tool("GetOrderDetails")
def get_order_details(db: Database, order_id: Any) -> str:
    orders = db.tables["orders"]
    return json.dumps(orders[order_id]) if order_id in orders else "Error: order not found"


@tool("GetProductDetails")
def get_product_details(db: Database, product_id: Any) -> str:
    products = db.tables["products"]
    return (
        json.dumps(products[product_id]) if product_id in products else "Error: product not found"
    )


@tool("GetUserDetails")
def get_user_details(db: Database, user_id: Any) -> str:
    users = db.tables["users"]
    return json.dumps(users[user_id]) if user_id in users else "Error: user not found"


@tool("ListAllProductTypes")
def list_all_product_types(db: Database) -> str:
    by_name = {p["name"]: p["product_id"] for p in db.tables["products"].values()}
    return json.dumps(dict(sorted(by_name.items())))


def _address(address1: Any, address2: Any, city: Any, state: Any, country: Any, zip: Any) -> dict:
    return {
        "address1": address1,
        "address2": address2,
        "city": city,
        "state": state,
        "country": country,
        "zip": zip,
    }


@tool("ModifyPendingOrderAddress")
def modify_pending_order_address(
    db: Database,
    order_id: Any,
    address1: Any,
    address2: Any,
    city: Any,
    state: Any,
    country: Any,
    zip: Any,
) -> str:
    orders = db.tables["orders"]
    if order_id not in orders:
        return "Error: order not found"
    if orders[order_id]["status"] != "pending":
        return "Error: non-pending order cannot be modified"
    order = db.mutable("orders", order_id)
    order["address"] = _address(address1, address2, city, state, country, zip)
    return json.dumps(order)


@tool("ModifyPendingOrderItems")
def modify_pending_order_items(
    db: Database, order_id: Any, item_ids: Any, new_item_ids: Any, payment_method_id: Any
) -> str:
    orders = db.tables["orders"]
    if order_id not in orders:
        return "Error: order not found"
    order = orders[order_id]
    if order["status"] != "pending":
        return "Error: non-pending order cannot be modified"
    missing = _count_check(order, item_ids)
    if missing is not None:
        return f"Error: {missing} not found"
    if len(item_ids) != len(new_item_ids):
        return "Error: the number of items to be exchanged should match"
    diff, bad_id = _price_difference(db, order, item_ids, new_item_ids)
    if bad_id is not None:
        return f"Error: new item {bad_id} not found or available"
    methods = db.tables["users"][order["user_id"]]["payment_methods"]
    if payment_method_id not in methods:
        return "Error: payment method not found"
    method = methods[payment_method_id]
    if method["source"] == "gift_card" and method["balance"] < diff:
        return "Error: insufficient gift card balance to pay for the new item"
    order = db.mutable("orders", order_id)
    order["payment_history"].append(
        {
            "transaction_type": "payment" if diff > 0 else "refund",
            "amount": abs(diff),
            "payment_method_id": payment_method_id,
        }
    )
    if method["source"] == "gift_card":
        method = db.mutable("users", order["user_id"])["payment_methods"][payment_method_id]
        method["balance"] = round(method["balance"] - diff, 2)
    variants_of = db.tables["products"]
    for old_id, new_id in zip(item_ids, new_item_ids, strict=False):
        item = _first_item(order, old_id)
        variant = variants_of[item["product_id"]]["variants"][new_id]
        item["item_id"] = new_id
        item["price"] = variant["price"]
        item["options"] = variant["options"]
    order["status"] = "pending (item modified)"
    return json.dumps(order)


@tool("ModifyPendingOrderPayment")
def modify_pending_order_payment(db: Database, order_id: Any, payment_method_id: Any) -> str:
    orders = db.tables["orders"]
    if order_id not in orders:
        return "Error: order not found"
    order = orders[order_id]
    if order["status"] != "pending":
        return "Error: non-pending order cannot be modified"
    methods = db.tables["users"][order["user_id"]]["payment_methods"]
    if payment_method_id not in methods:
        return "Error: payment method not found"
    history = order["payment_history"]
    if len(history) > 1 or history[0]["transaction_type"] != "payment":
        return "Error: there should be exactly one payment for a pending order"
    old_id = history[0]["payment_method_id"]
    if old_id == payment_method_id:
        return "Error: the new payment method should be different from the current one"
    amount = history[0]["amount"]
    if (
        methods[payment_method_id]["source"] == "gift_card"
        and methods[payment_method_id]["balance"] < amount
    ):
        return "Error: insufficient gift card balance to pay for the order"
    order = db.mutable("orders", order_id)
    order["payment_history"].append(
        {"transaction_type": "payment", "amount": amount, "payment_method_id": payment_method_id}
    )
    order["payment_history"].append(
        {"transaction_type": "refund", "amount": amount, "payment_method_id": old_id}
    )
    user_methods = db.mutable("users", order["user_id"])["payment_methods"]
    new_method = user_methods[payment_method_id]
    if new_method["source"] == "gift_card":
        new_method["balance"] = round(new_method["balance"] - amount, 2)
    if "gift_card" in old_id:
        user_methods[old_id]["balance"] = round(user_methods[old_id]["balance"] + amount, 2)
    return json.dumps(order)


@tool("ModifyUserAddress")
def modify_user_address(
    db: Database,
    user_id: Any,
    address1: Any,
    address2: Any,
    city: Any,
    state: Any,
    country: Any,
    zip: Any,
) -> str:
    if user_id not in db.tables["users"]:
        return "Error: user not found"
    user = db.mutable("users", user_id)
    user["address"] = _address(address1, address2, city, state, country, zip)
    return json.dumps(user)


@tool("ReturnDeliveredOrderItems")
def return_delivered_order_items(
    db: Database, order_id: Any, item_ids: Any, payment_method_id: Any
) -> str:
    orders = db.tables["orders"]
    if order_id not in orders:
        return "Error: order not found"
    order = orders[order_id]
    if order["status"] != "delivered":
        return "Error: non-delivered order cannot be returned"
    if payment_method_id not in db.tables["users"][order["user_id"]]["payment_methods"]:
        return "Error: payment method not found"
    if (
        "gift_card" not in payment_method_id
        and payment_method_id != order["payment_history"][0]["payment_method_id"]
    ):
        return "Error: payment method should be either the original payment method or a gift card"
    if _count_check(order, item_ids) is not None:
        return "Error: some item not found"
    order = db.mutable("orders", order_id)
    order["status"] = "return requested"
    order["return_items"] = sorted(item_ids)
    order["return_payment_method_id"] = payment_method_id
    return json.dumps(order)


@tool("Think")
def think(db: Database, thought: Any) -> str:
    return ""


@tool("TransferToHumanAgents")
def transfer_to_human_agents(db: Database, summary: Any) -> str:
    return "Transfer successful"


RETAIL_TOOLS = collect_tools(
    [
        calculate,
        cancel_pending_order,
        exchange_delivered_order_items,
        find_user_id_by_email,
        find_user_id_by_name_zip,
        get_order_details,
        get_product_details,
        get_user_details,
        list_all_product_types,
        modify_pending_order_address,
        modify_pending_order_items,
        modify_pending_order_payment,
        modify_user_address,
        return_delivered_order_items,
        think,
        transfer_to_human_agents,
    ]
)
"""Retail tools by name, in tau-bench's ``tools.json`` order."""
