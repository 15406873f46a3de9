"""tau2 retail: the agent's tools, their database, and parity with tau2-bench's own code.

The first tests run anywhere, on a small database written for them. The error table runs
on tau2's retail data (``tau2_data``); with tau2-bench's code installed (``tau2_upstream``,
``nox -s tau2-parity``) the same calls, every task's gold actions and a scripted sequence
are replayed on upstream's environment as well and compared text for text, error flag for
error flag and hash for hash.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from turnrl.tool_envs.tau.db import DataError
from turnrl.tool_envs.tau.tau2.domain import Tau2Domain, load_domain
from turnrl.tool_envs.tau.tau2.retail import RetailTools, load
from turnrl.tool_envs.tau.tau2.toolkit import ToolKind, state_hash

KINDS = {
    "calculate": ToolKind.GENERIC,
    "cancel_pending_order": ToolKind.WRITE,
    "exchange_delivered_order_items": ToolKind.WRITE,
    "find_user_id_by_email": ToolKind.READ,
    "find_user_id_by_name_zip": ToolKind.READ,
    "get_order_details": ToolKind.READ,
    "get_product_details": ToolKind.READ,
    "get_user_details": ToolKind.READ,
    "list_all_product_types": ToolKind.READ,
    "modify_pending_order_address": ToolKind.WRITE,
    "modify_pending_order_items": ToolKind.WRITE,
    "modify_pending_order_payment": ToolKind.WRITE,
    "modify_user_address": ToolKind.WRITE,
    "return_delivered_order_items": ToolKind.WRITE,
    "transfer_to_human_agents": ToolKind.GENERIC,
}

# --- a small database of our own (no tau2 data needed) ------------------------------------

ADDRESS = {
    "address1": "1 Main St",
    "address2": "",
    "city": "Austin",
    "country": "USA",
    "state": "TX",
    "zip": "78701",
}


def _variant(item_id: str, color: str, price: Any, available: bool = True) -> dict[str, Any]:
    return {"item_id": item_id, "options": {"color": color}, "available": available, "price": price}


def _item(item_id: str, color: str, price: Any) -> dict[str, Any]:
    return {
        "name": "Lamp",
        "product_id": "P1",
        "item_id": item_id,
        "price": price,
        "options": {"color": color},
    }


def _mini_db() -> dict[str, Any]:
    """One product (four variants), one user (three payment methods), two orders."""
    variants = [
        _variant("V1", "red", 10),
        _variant("V2", "blue", 12.5),
        _variant("V3", "green", 9.0, available=False),
        _variant("V4", "white", 11),
    ]
    return {
        "products": {
            "P1": {
                "name": "Lamp",
                "product_id": "P1",
                "variants": {v["item_id"]: v for v in variants},
            }
        },
        "users": {
            "ann_lee_1": {
                "user_id": "ann_lee_1",
                "name": {"first_name": "Ann", "last_name": "Lee"},
                "address": dict(ADDRESS),
                "email": "ann@example.com",
                "payment_methods": {
                    "credit_card_1": {
                        "source": "credit_card",
                        "id": "credit_card_1",
                        "brand": "visa",
                        "last_four": "1234",
                    },
                    "gift_card_1": {"source": "gift_card", "id": "gift_card_1", "balance": 20},
                    "paypal_1": {"source": "paypal", "id": "paypal_1"},
                },
                "orders": ["#W1", "#W2"],
                "nickname": "not a field of the model",
            }
        },
        "orders": {
            "#W1": {
                "order_id": "#W1",
                "user_id": "ann_lee_1",
                "address": dict(ADDRESS),
                "items": [_item("V1", "red", 10), _item("V1", "red", 10)],
                "status": "pending",
                "fulfillments": [],
                "payment_history": [
                    {
                        "transaction_type": "payment",
                        "amount": 20,
                        "payment_method_id": "gift_card_1",
                    }
                ],
            },
            "#W2": {
                "order_id": "#W2",
                "user_id": "ann_lee_1",
                "address": dict(ADDRESS),
                "items": [_item("V2", "blue", 12.5)],
                "status": "delivered",
                "fulfillments": [{"tracking_id": ["T1"], "item_ids": ["V2"]}],
                "payment_history": [
                    {
                        "transaction_type": "payment",
                        "amount": 12.5,
                        "payment_method_id": "credit_card_1",
                    }
                ],
            },
        },
    }


@pytest.fixture
def mini(tmp_path: Path) -> Tau2Domain:
    (tmp_path / "db.json").write_text(json.dumps(_mini_db()), encoding="utf-8")
    (tmp_path / "policy.md").write_text("# Retail policy\nBe nice.\n", encoding="utf-8")
    return load(tmp_path)


def _tools(domain: Tau2Domain) -> RetailTools:
    tools = domain.new_tools()
    assert isinstance(tools, RetailTools)
    return tools


def test_tools_have_upstreams_names_kinds_and_signatures() -> None:
    assert RetailTools.tool_kinds() == KINDS
    assert RetailTools.side == "assistant"
    for schema in RetailTools.schemas():
        function = schema["function"]
        params = inspect.signature(getattr(RetailTools, function["name"])).parameters
        args = [name for name in params if name != "self"]
        assert list(function["parameters"]["properties"]) == args, function["name"]
        assert function["parameters"].get("required", []) == args, function["name"]
        assert function["description"]


def test_load_puts_records_in_model_dump_form(mini: Tau2Domain) -> None:
    state = _tools(mini).state()
    assert list(state) == ["products", "users", "orders"]
    assert mini.name == "retail" and "Be nice." in mini.policy
    assert "Be nice." in mini.system_prompt
    variant = state["products"]["P1"]["variants"]["V1"]
    assert variant["price"] == 10.0 and isinstance(variant["price"], float)
    user = state["users"]["ann_lee_1"]
    assert "nickname" not in user  # pydantic drops fields the model does not have
    assert list(user["address"]) == ["address1", "address2", "city", "country", "state", "zip"]
    assert isinstance(user["payment_methods"]["gift_card_1"]["balance"], float)
    order = state["orders"]["#W1"]
    assert list(order)[7:] == [
        "cancel_reason",
        "exchange_items",
        "exchange_new_items",
        "exchange_payment_method_id",
        "exchange_price_difference",
        "return_items",
        "return_payment_method_id",
    ]
    assert all(order[key] is None for key in list(order)[7:])
    assert isinstance(order["payment_history"][0]["amount"], float)


def test_load_refuses_a_database_without_its_tables(tmp_path: Path) -> None:
    (tmp_path / "db.json").write_text(json.dumps({"products": {}, "users": {}}), encoding="utf-8")
    (tmp_path / "policy.md").write_text("policy", encoding="utf-8")
    with pytest.raises(DataError, match="orders"):
        load(tmp_path)
    broken = _mini_db()
    del broken["orders"]["#W1"]["status"]
    (tmp_path / "db.json").write_text(json.dumps(broken), encoding="utf-8")
    with pytest.raises(DataError, match="status"):
        load(tmp_path)


def test_load_domain_finds_the_module(mini: Tau2Domain, tmp_path: Path) -> None:
    domain = load_domain("retail", tmp_path)
    assert domain.new_tools().db_hash() == mini.new_tools().db_hash()


def test_cancel_refunds_a_gift_card_at_once_and_leaves_the_pristine_data(mini: Tau2Domain) -> None:
    tools = _tools(mini)
    pristine_hash = tools.db_hash()
    text, error = tools.call(
        "cancel_pending_order", {"order_id": "#W1", "reason": "no longer needed"}
    )
    assert not error
    order = json.loads(text)
    assert order["status"] == "cancelled" and order["cancel_reason"] == "no longer needed"
    assert order["payment_history"][-1] == {
        "transaction_type": "refund",
        "amount": 20.0,
        "payment_method_id": "gift_card_1",
    }
    assert '"amount": 20.0' in text  # a returned record keeps its numbers as numbers
    assert tools.state()["users"]["ann_lee_1"]["payment_methods"]["gift_card_1"]["balance"] == 40.0
    assert tools.db_hash() != pristine_hash
    fresh = _tools(mini)
    assert fresh.db_hash() == pristine_hash
    assert fresh.state()["orders"]["#W1"]["status"] == "pending"
    again, error = tools.call(
        "cancel_pending_order", {"order_id": "#W1", "reason": "no longer needed"}
    )
    assert error and again == "Error: Non-pending order cannot be cancelled"


def test_fresh_toolkits_share_unwritten_records(mini: Tau2Domain) -> None:
    first, second = _tools(mini), _tools(mini)
    first.call("modify_user_address", {"user_id": "ann_lee_1", **ADDRESS, "city": "Dallas"})
    assert first.state()["users"]["ann_lee_1"]["address"]["city"] == "Dallas"
    assert second.state()["users"]["ann_lee_1"]["address"]["city"] == "Austin"
    assert first.state()["orders"]["#W1"] is second.state()["orders"]["#W1"]
    assert first.state()["users"]["ann_lee_1"] is not second.state()["users"]["ann_lee_1"]


def test_modify_items_gives_every_item_the_last_new_variant(mini: Tau2Domain) -> None:
    tools = _tools(mini)
    args = {
        "order_id": "#W1",
        "item_ids": ["V1", "V1"],
        "new_item_ids": ["V2", "V4"],
        "payment_method_id": "gift_card_1",
    }
    text, error = tools.call("modify_pending_order_items", args)
    assert not error, text
    order = tools.state()["orders"]["#W1"]
    assert [item["item_id"] for item in order["items"]] == ["V2", "V4"]
    # upstream's quirk: price and options of the last pair's variant, for both items
    assert [item["price"] for item in order["items"]] == [11.0, 11.0]
    assert [item["options"] for item in order["items"]] == [{"color": "white"}] * 2
    assert order["status"] == "pending (item modified)"
    assert order["payment_history"][-1] == {
        "transaction_type": "payment",
        "amount": 3.5,
        "payment_method_id": "gift_card_1",
    }
    assert tools.state()["users"]["ann_lee_1"]["payment_methods"]["gift_card_1"]["balance"] == 16.5
    # the product's own variant is not shared with the order
    order["items"][0]["options"]["color"] = "changed"
    assert tools.state()["products"]["P1"]["variants"]["V4"]["options"] == {"color": "white"}


def test_exchange_of_no_items_stores_an_integer_zero_until_update_db(mini: Tau2Domain) -> None:
    tools = _tools(mini)
    args = {
        "order_id": "#W2",
        "item_ids": [],
        "new_item_ids": [],
        "payment_method_id": "paypal_1",
    }
    text, error = tools.call("exchange_delivered_order_items", args)
    assert not error and '"exchange_price_difference": 0,' in text
    difference = tools.state()["orders"]["#W2"]["exchange_price_difference"]
    assert difference == 0 and isinstance(difference, int)
    tools.update_db({})  # upstream re-validates its model: the float field becomes 0.0
    difference = tools.state()["orders"]["#W2"]["exchange_price_difference"]
    assert isinstance(difference, float)


def test_update_db_merges_and_copies_only_the_touched_records(mini: Tau2Domain) -> None:
    tools = _tools(mini)
    pristine = _tools(mini).state()
    tools.update_db(
        {
            "users": {"ann_lee_1": {"payment_methods": {"gift_card_1": {"balance": 5}}}},
            "orders": {"#W2": {"status": "pending"}},
            "not_a_table": {"x": 1},
        }
    )
    state = tools.state()
    method = state["users"]["ann_lee_1"]["payment_methods"]["gift_card_1"]
    assert method == {"source": "gift_card", "id": "gift_card_1", "balance": 5.0}
    assert isinstance(method["balance"], float)
    assert state["users"]["ann_lee_1"]["email"] == "ann@example.com"
    assert state["orders"]["#W2"]["status"] == "pending"
    assert state["orders"]["#W1"] is pristine["orders"]["#W1"]
    assert state["products"]["P1"] is pristine["products"]["P1"]
    assert pristine["users"]["ann_lee_1"]["payment_methods"]["gift_card_1"]["balance"] == 20.0
    assert "not_a_table" not in state


def test_argument_errors_read_as_python_writes_them(mini: Tau2Domain) -> None:
    tools = _tools(mini)
    assert tools.call("cancel_pending_order", {"order_id": "#W1"}) == (
        "Error: RetailTools.cancel_pending_order() missing 1 required positional argument: 'reason'",
        True,
    )
    text, error = tools.call("get_user_details", {"user_id": "ann_lee_1", "verbose": True})
    assert error and text.endswith("got an unexpected keyword argument 'verbose'")
    assert tools.call("refund_everything", {}) == (
        "Error: Tool 'refund_everything' not found.",
        True,
    )
    assert tools.db_hash() == _tools(mini).db_hash()


def test_an_address_with_a_non_string_field_fails_as_pydantic_does(mini: Tau2Domain) -> None:
    tools = _tools(mini)
    text, error = tools.call(
        "modify_pending_order_address",
        {"order_id": "#W1", **ADDRESS, "address1": None, "zip": 78701},
    )
    assert error
    assert text.splitlines() == [
        "Error: 2 validation errors for UserAddress",
        "address1",
        "  Input should be a valid string [type=string_type, input_value=None, input_type=NoneType]",
        "zip",
        "  Input should be a valid string [type=string_type, input_value=78701, input_type=int]",
    ]
    assert tools.state()["orders"]["#W1"]["address"] == ADDRESS


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("2 + 2", ("4.0", False)),
        ("10 / 3", ("3.33", False)),
        ("2 ** 10", ("1024.0", False)),
        ("1 / 0", ("Error: division by zero", True)),
        ("abs(-1)", ("Error: Invalid characters in expression", True)),
        ("(1 + 2", ("Error: '(' was never closed (<string>, line 1)", True)),
        (["1", "+", "1"], ("Error: eval() arg 1 must be a string, bytes or code object", True)),
    ],
)
def test_calculate(mini: Tau2Domain, expression: Any, expected: tuple[str, bool]) -> None:
    assert _tools(mini).call("calculate", {"expression": expression}) == expected


# --- tau2's retail data -------------------------------------------------------------------

PENDING = "#W4538969"
"""yara_martin_9470's pending order, paid 6307.49 by credit_card_1006622; four items."""
PENDING_GIFT = "#W6779827"
"""ethan_lopez_6291's pending order, paid by gift_card_7219486 (also has credit_card_9789590)."""
DELIVERED = "#W4250821"
"""sophia_jackson_6355's delivered order, paid by credit_card_8041020; gift_card_6052478 holds 10."""
PROCESSED = "#W2611340"

ADDRESS_ARGS = {
    "address1": "10 Elm St",
    "address2": "Apt 2",
    "city": "Denver",
    "state": "CO",
    "country": "USA",
    "zip": "80203",
}


def _exchange(items: list[str], new: list[str], method: str = "credit_card_8041020") -> dict:
    return {
        "order_id": DELIVERED,
        "item_ids": items,
        "new_item_ids": new,
        "payment_method_id": method,
    }


def _modify(items: Any, new: Any, method: str = "credit_card_1006622") -> dict:
    return {
        "order_id": PENDING,
        "item_ids": items,
        "new_item_ids": new,
        "payment_method_id": method,
    }


CASES: list[tuple[str, str, dict[str, Any], str]] = [
    # (case id, tool, arguments, what our text starts with)
    ("unknown-order", "get_order_details", {"order_id": "#W0000000"}, "Error: Order not found"),
    ("order-without-hash", "get_order_details", {"order_id": "W4538969"}, "Error: Order not found"),
    ("order", "get_order_details", {"order_id": PENDING}, '{"order_id": "#W4538969"'),
    ("unknown-user", "get_user_details", {"user_id": "nobody_1"}, "Error: User not found"),
    ("item-id-as-product", "get_product_details", {"product_id": "4875647558"}, "Error: Product not found"),
    ("product", "get_product_details", {"product_id": "1656367028"}, '{"name": "Mechanical Keyboard"'),
    ("product-types", "list_all_product_types", {}, '{"Action Camera": '),
    ("unknown-email", "find_user_id_by_email", {"email": "nobody@example.com"}, "Error: User not found"),
    ("email-any-case", "find_user_id_by_email", {"email": "Yara.Martin8360@EXAMPLE.com"}, "yara_martin_9470"),
    ("name-wrong-zip", "find_user_id_by_name_zip", {"first_name": "Yara", "last_name": "Martin", "zip": "00000"}, "Error: User not found"),
    ("name-any-case", "find_user_id_by_name_zip", {"first_name": "yARA", "last_name": "martin", "zip": "80209"}, "yara_martin_9470"),
    ("email-not-a-string", "find_user_id_by_email", {"email": 7}, "Error: 'int' object has no attribute 'lower'"),
    ("cancel-delivered", "cancel_pending_order", {"order_id": DELIVERED, "reason": "no longer needed"}, "Error: Non-pending order cannot be cancelled"),
    ("cancel-processed", "cancel_pending_order", {"order_id": PROCESSED, "reason": "ordered by mistake"}, "Error: Non-pending order cannot be cancelled"),
    ("cancel-bad-reason", "cancel_pending_order", {"order_id": PENDING, "reason": "changed my mind"}, "Error: Invalid reason"),
    ("cancel-no-reason", "cancel_pending_order", {"order_id": PENDING}, "Error: RetailTools.cancel_pending_order() missing 1 required positional argument: 'reason'"),
    ("cancel-extra-arg", "cancel_pending_order", {"order_id": PENDING, "reason": "no longer needed", "note": "x"}, "Error: RetailTools.cancel_pending_order() got an unexpected keyword argument 'note'"),
    ("cancel-gift-card-paid", "cancel_pending_order", {"order_id": PENDING_GIFT, "reason": "ordered by mistake"}, '{"order_id": "#W6779827"'),
    ("exchange-pending", "exchange_delivered_order_items", {**_exchange(["4875647558"], ["3709608322"]), "order_id": PENDING}, "Error: Non-delivered order cannot be exchanged"),
    ("exchange-item-not-in-order", "exchange_delivered_order_items", _exchange(["4875647558"], ["3709608322"]), "Error: Number of 4875647558 not found."),
    ("exchange-item-twice", "exchange_delivered_order_items", _exchange(["5222576926"] * 2, ["7706410293"] * 2), "Error: Number of 5222576926 not found."),
    ("exchange-count-mismatch", "exchange_delivered_order_items", _exchange(["5222576926"], []), "Error: The number of items to be exchanged should match."),
    ("exchange-unavailable", "exchange_delivered_order_items", _exchange(["5222576926"], ["9690244451"]), "Error: New item 9690244451 not found or available"),
    ("exchange-other-product", "exchange_delivered_order_items", _exchange(["5222576926"], ["3709608322"]), "Error: Variant not found"),
    ("exchange-others-payment", "exchange_delivered_order_items", _exchange(["5222576926"], ["7706410293"], "credit_card_1006622"), "Error: Payment method not found"),
    ("exchange-gift-card-short", "exchange_delivered_order_items", _exchange(["5222576926"], ["7706410293"], "gift_card_6052478"), "Error: Insufficient gift card balance to pay for the price difference"),
    ("exchange-cheaper-to-gift-card", "exchange_delivered_order_items", _exchange(["5222576926"], ["3616838507"], "gift_card_6052478"), '{"order_id": "#W4250821"'),
    ("exchange-nothing", "exchange_delivered_order_items", _exchange([], []), '{"order_id": "#W4250821"'),
    ("modify-items-delivered", "modify_pending_order_items", {**_modify(["5222576926"], ["7706410293"]), "order_id": DELIVERED}, "Error: Non-pending order cannot be modified"),
    ("modify-items-same-id", "modify_pending_order_items", _modify(["4875647558"], ["4875647558"]), "Error: The new item id should be different from the old item id"),
    ("modify-items-not-in-order", "modify_pending_order_items", _modify(["5222576926"], ["7706410293"]), "Error: 5222576926 not found"),
    ("modify-items-count-mismatch", "modify_pending_order_items", _modify(["4875647558"], ["3709608322", "7407838442"]), "Error: The number of items to be exchanged should match"),
    ("modify-items-unavailable", "modify_pending_order_items", _modify(["4875647558"], ["6324294385"]), "Error: New item 6324294385 not found or available"),
    ("modify-items-gift-card-short", "modify_pending_order_items", _modify(["4875647558"], ["7407838442"], "gift_card_3902147"), "Error: Insufficient gift card balance to pay for the new item"),
    ("modify-items-unknown-payment", "modify_pending_order_items", _modify(["4875647558"], ["3709608322"], "paypal_0000000"), "Error: Payment method not found"),
    ("modify-items-ids-as-string", "modify_pending_order_items", _modify("4875647558", "3709608322"), "Error: 4 not found"),
    ("modify-items-refund-to-gift-card", "modify_pending_order_items", _modify(["4875647558"], ["3709608322"], "gift_card_3902147"), '{"order_id": "#W4538969"'),
    ("modify-items-two", "modify_pending_order_items", _modify(["4875647558", "7441167885"], ["3709608322", "7407838442"]), '{"order_id": "#W4538969"'),
    ("modify-items-nothing", "modify_pending_order_items", _modify([], []), '{"order_id": "#W4538969"'),
    ("modify-payment-delivered", "modify_pending_order_payment", {"order_id": DELIVERED, "payment_method_id": "paypal_7425862"}, "Error: Non-pending order cannot be modified"),
    ("modify-payment-same", "modify_pending_order_payment", {"order_id": PENDING, "payment_method_id": "credit_card_1006622"}, "Error: The new payment method should be different from the current one"),
    ("modify-payment-gift-card-short", "modify_pending_order_payment", {"order_id": PENDING, "payment_method_id": "gift_card_3902147"}, "Error: Insufficient gift card balance to pay for the order"),
    ("modify-payment-others-method", "modify_pending_order_payment", {"order_id": PENDING, "payment_method_id": "credit_card_8041020"}, "Error: Payment method not found"),
    ("modify-payment-to-paypal", "modify_pending_order_payment", {"order_id": PENDING, "payment_method_id": "paypal_9012851"}, '{"order_id": "#W4538969"'),
    ("modify-payment-from-gift-card", "modify_pending_order_payment", {"order_id": PENDING_GIFT, "payment_method_id": "credit_card_9789590"}, '{"order_id": "#W6779827"'),
    ("order-address-delivered", "modify_pending_order_address", {"order_id": DELIVERED, **ADDRESS_ARGS}, "Error: Non-pending order cannot be modified"),
    ("order-address-int-zip", "modify_pending_order_address", {"order_id": PENDING, **ADDRESS_ARGS, "zip": 80203}, "Error: 1 validation error for UserAddress\nzip\n"),
    ("order-address", "modify_pending_order_address", {"order_id": PENDING, **ADDRESS_ARGS}, '{"order_id": "#W4538969"'),
    ("user-address-unknown-user", "modify_user_address", {"user_id": "nobody_1", **ADDRESS_ARGS}, "Error: User not found"),
    ("user-address-two-bad-fields", "modify_user_address", {"user_id": "yara_martin_9470", **ADDRESS_ARGS, "city": ["Denver"], "state": 1.5}, "Error: 2 validation errors for UserAddress\ncity\n"),
    ("user-address-missing-zip", "modify_user_address", {"user_id": "yara_martin_9470", **{k: v for k, v in ADDRESS_ARGS.items() if k != "zip"}}, "Error: RetailTools.modify_user_address() missing 1 required positional argument: 'zip'"),
    ("user-address", "modify_user_address", {"user_id": "yara_martin_9470", **ADDRESS_ARGS}, '{"user_id": "yara_martin_9470"'),
    ("return-pending", "return_delivered_order_items", {"order_id": PENDING, "item_ids": ["4875647558"], "payment_method_id": "credit_card_1006622"}, "Error: Non-delivered order cannot be returned"),
    ("return-to-other-card", "return_delivered_order_items", {"order_id": DELIVERED, "item_ids": ["5222576926"], "payment_method_id": "credit_card_6547060"}, "Error: Payment method should be the original payment method"),
    ("return-unknown-payment", "return_delivered_order_items", {"order_id": DELIVERED, "item_ids": ["5222576926"], "payment_method_id": "gift_card_0000000"}, "Error: Payment method not found"),
    ("return-item-not-in-order", "return_delivered_order_items", {"order_id": DELIVERED, "item_ids": ["5222576926", "4875647558"], "payment_method_id": "credit_card_8041020"}, "Error: Some item not found"),
    ("return-to-gift-card", "return_delivered_order_items", {"order_id": DELIVERED, "item_ids": ["9970989750", "5222576926"], "payment_method_id": "gift_card_6052478"}, '{"order_id": "#W4250821"'),
    ("calculate", "calculate", {"expression": "(2805.77 - 2744.7) * 2"}, "122.14"),
    ("calculate-bad-chars", "calculate", {"expression": "2 ^ 3"}, "Error: Invalid characters in expression"),
    ("calculate-by-zero", "calculate", {"expression": "5 / (2 - 2)"}, "Error: division by zero"),
    ("transfer", "transfer_to_human_agents", {"summary": "wants a refund"}, "Transfer successful"),
    ("unknown-tool", "refund_everything", {"order_id": PENDING}, "Error: Tool 'refund_everything' not found."),
]  # fmt: skip


@pytest.fixture(scope="module")
def retail(tau2_data: Path) -> Tau2Domain:
    return load(tau2_data / "retail")


def test_retail_data_loads_as_tau2_describes_it(retail: Tau2Domain) -> None:
    tools = _tools(retail)
    assert {name: len(table) for name, table in tools.state().items()} == {
        "products": 50,
        "users": 500,
        "orders": 1000,
    }
    variants = sum(len(p["variants"]) for p in tools.state()["products"].values())
    assert variants == 591
    assert _tools(retail).db_hash() == tools.db_hash() == state_hash(tools.state())


@pytest.mark.parametrize(
    ("tool", "args", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_error_table(retail: Tau2Domain, tool: str, args: dict[str, Any], expected: str) -> None:
    tools = _tools(retail)
    pristine = tools.db_hash()
    text, error = tools.call(tool, args)
    assert text.startswith(expected)
    assert error == expected.startswith("Error:")
    if error or KINDS.get(tool) != ToolKind.WRITE:
        assert tools.db_hash() == pristine
    else:
        assert tools.db_hash() != pristine
    assert _tools(retail).db_hash() == pristine


# --- parity with tau2-bench's own code ----------------------------------------------------


def _drop_doc_links(text: str) -> str:
    """Upstream's text without pydantic's "For further information visit" lines."""
    lines = text.split("\n")
    return "\n".join(line for line in lines if not line.startswith("    For further information"))


class Upstream:
    """Fresh tau2-bench retail environments on the same data, and calls on them."""

    def __init__(self, db_text: str) -> None:
        from tau2.domains.retail.data_model import RetailDB
        from tau2.domains.retail.tools import RetailTools as UpstreamTools
        from tau2.environment.environment import Environment

        self._new = lambda: Environment(
            domain_name="retail",
            policy="",
            tools=UpstreamTools(RetailDB.model_validate_json(db_text)),
        )
        self._count = 0

    def env(self) -> Any:
        return self._new()

    def call(self, env: Any, name: str, args: dict[str, Any]) -> tuple[str, bool]:
        from tau2.data_model.message import ToolCall

        self._count += 1
        call = ToolCall(id=f"c{self._count}", name=name, arguments=args, requestor="assistant")
        message = env.get_response(call)
        return _drop_doc_links(message.content), bool(message.error)


@pytest.fixture(scope="module")
def upstream(tau2_upstream: Any, tau2_data: Path) -> Iterator[Upstream]:
    from loguru import logger

    logger.disable("tau2")  # upstream logs every tool response
    yield Upstream((tau2_data / "retail" / "db.json").read_text(encoding="utf-8"))
    logger.enable("tau2")


def test_pristine_state_is_upstreams_model_dump(retail: Tau2Domain, upstream: Upstream) -> None:
    env = upstream.env()
    tools = _tools(retail)
    assert tools.state() == env.tools.db.model_dump()
    assert tools.db_hash() == env.get_db_hash()


def test_tool_names_kinds_and_arguments_match_upstream(upstream: Upstream) -> None:
    from tau2.environment.toolkit import get_tool_types

    env = upstream.env()
    assert {name: kind.value for name, kind in get_tool_types(env.tools).items()} == {
        name: kind.value for name, kind in KINDS.items()
    }
    ours = {s["function"]["name"]: s["function"]["parameters"] for s in RetailTools.schemas()}
    for name, tool in env.tools.get_tools().items():
        theirs = tool.openai_schema["function"]["parameters"]
        assert ours[name].get("required", []) == theirs.get("required", []), name
        types = {arg: spec["type"] for arg, spec in theirs["properties"].items()}
        assert {arg: spec["type"] for arg, spec in ours[name]["properties"].items()} == types


def test_gold_actions_of_every_task_match_upstream(
    retail: Tau2Domain, upstream: Upstream, tau2_data: Path
) -> None:
    tasks = json.loads((tau2_data / "retail" / "tasks.json").read_text(encoding="utf-8"))
    assert len(tasks) == 114
    pristine = _tools(retail).db_hash()
    calls = changed = 0
    for task in tasks:
        assert not task.get("initial_state"), task["id"]  # retail tasks start from the db as is
        tools, env = _tools(retail), upstream.env()
        for action in task["evaluation_criteria"]["actions"]:
            assert action.get("requestor", "assistant") == "assistant"
            name, args = action["name"], action["arguments"]
            assert tools.call(name, args) == upstream.call(env, name, args), (task["id"], name)
            calls += 1
        assert tools.db_hash() == env.get_db_hash(), task["id"]
        changed += tools.db_hash() != pristine
    assert calls == 550
    assert changed > 90  # most tasks write: the comparison covers the write tools


@pytest.mark.parametrize(("tool", "args"), [c[1:3] for c in CASES], ids=[c[0] for c in CASES])
def test_error_table_matches_upstream(
    retail: Tau2Domain, upstream: Upstream, tool: str, args: dict[str, Any]
) -> None:
    tools, env = _tools(retail), upstream.env()
    assert tools.call(tool, args) == upstream.call(env, tool, args)
    assert tools.db_hash() == env.get_db_hash()


SEQUENCE: list[tuple[str, dict[str, Any]]] = [
    ("modify_pending_order_payment", {"order_id": PENDING, "payment_method_id": "paypal_9012851"}),
    ("modify_pending_order_payment", {"order_id": PENDING, "payment_method_id": "credit_card_1006622"}),
    ("modify_pending_order_items", _modify(["4875647558"], ["3709608322"], "gift_card_3902147")),
    ("modify_pending_order_items", _modify(["7441167885"], ["7407838442"])),
    ("modify_pending_order_address", {"order_id": PENDING, **ADDRESS_ARGS}),
    ("cancel_pending_order", {"order_id": PENDING, "reason": "no longer needed"}),
    ("get_user_details", {"user_id": "yara_martin_9470"}),
    ("modify_pending_order_payment", {"order_id": PENDING_GIFT, "payment_method_id": "credit_card_9789590"}),
    ("cancel_pending_order", {"order_id": PENDING_GIFT, "reason": "no longer needed"}),
    ("get_user_details", {"user_id": "ethan_lopez_6291"}),
    ("exchange_delivered_order_items", _exchange(["5222576926"], ["3616838507"], "gift_card_6052478")),
    ("exchange_delivered_order_items", _exchange(["5222576926"], ["3616838507"])),
    ("return_delivered_order_items", {"order_id": DELIVERED, "item_ids": ["5222576926"], "payment_method_id": "credit_card_8041020"}),
    ("get_order_details", {"order_id": DELIVERED}),
    ("modify_user_address", {"user_id": "sophia_jackson_6355", **ADDRESS_ARGS}),
    ("find_user_id_by_name_zip", {"first_name": "Sophia", "last_name": "Jackson", "zip": "80203"}),
]  # fmt: skip
"""Calls on one environment whose outcomes depend on the earlier ones."""


def _replay(
    retail: Tau2Domain, upstream: Upstream, calls: list[tuple[str, dict[str, Any]]]
) -> tuple[RetailTools, Any, list[tuple[str, bool]]]:
    tools, env = _tools(retail), upstream.env()
    outcomes = []
    for name, args in calls:
        outcome = tools.call(name, args)
        assert outcome == upstream.call(env, name, args), (name, args)
        outcomes.append(outcome)
    return tools, env, outcomes


def test_a_sequence_of_dependent_calls_matches_upstream(
    retail: Tau2Domain, upstream: Upstream
) -> None:
    tools, env, outcomes = _replay(retail, upstream, SEQUENCE)
    assert [error for _, error in outcomes] == [
        False,  # payment -> paypal
        True,  # a second payment change: three payments now
        False,  # items, refund to the gift card
        True,  # items again: no longer "pending"
        False,  # address: "pending (item modified)" still counts as pending
        True,  # cancel needs "pending" exactly
        False,
        False,  # payment from a gift card: refunded to it at once
        False,  # cancel: both payments refunded
        False,
        False,
        True,  # exchanged already
        True,  # no return after an exchange
        False,
        False,
        False,  # found by the new zip
    ]
    assert tools.state() == env.tools.db.model_dump()
    assert tools.db_hash() == env.get_db_hash()


def test_update_db_and_an_error_part_way_match_upstream(
    retail: Tau2Domain, upstream: Upstream
) -> None:
    tools, env = _tools(retail), upstream.env()
    payments = [
        {"transaction_type": "payment", "amount": 100, "payment_method_id": "gift_card_7219486"},
        {"transaction_type": "payment", "amount": 5.5, "payment_method_id": "gift_card_0000000"},
    ]
    update = {
        "orders": {PENDING_GIFT: {"payment_history": payments}},
        "users": {"ethan_lopez_6291": {"payment_methods": {"gift_card_7219486": {"balance": 3}}}},
    }
    tools.update_db(update)
    env.tools.update_db(update)
    assert tools.db_hash() == env.get_db_hash()
    # the first refund reaches the gift card before the unknown second method fails
    args = {"order_id": PENDING_GIFT, "reason": "ordered by mistake"}
    text, error = tools.call("cancel_pending_order", args)
    assert (text, error) == upstream.call(env, "cancel_pending_order", args)
    assert (text, error) == ("Error: Payment method not found", True)
    gift_card = tools.state()["users"]["ethan_lopez_6291"]["payment_methods"]["gift_card_7219486"]
    assert gift_card["balance"] == 103.0
    assert tools.state() == env.tools.db.model_dump()
    # an exchange of nothing stores integer 0; a later update re-validates it to 0.0
    args = _exchange([], [])
    assert tools.call("exchange_delivered_order_items", args) == upstream.call(
        env, "exchange_delivered_order_items", args
    )
    assert tools.db_hash() == env.get_db_hash()
    tools.update_db({})
    env.tools.update_db({})
    assert tools.db_hash() == env.get_db_hash()


def test_episode_never_changes_the_pristine_data(retail: Tau2Domain) -> None:
    before = _tools(retail).db_hash()
    tools = _tools(retail)
    for name, args in SEQUENCE:
        tools.call(name, args)
    tools.update_db({"users": {"yara_martin_9470": {"email": "new@example.com"}}})
    assert tools.db_hash() != before
    assert _tools(retail).db_hash() == before
