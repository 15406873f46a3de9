"""Retail tools: tau-bench's return strings, database changes and gold-replay hashes."""

import json
import os
from pathlib import Path

import pytest

from turnrl.tool_envs.tau import TauDomain, load_tasks, reference_data_hash
from turnrl.tool_envs.tau.synth import generate

TAU_DIR = Path(
    os.environ.get("TURNRL_TAU_BENCH_DIR")
    or Path(__file__).resolve().parents[3] / ".." / "shared" / "tau-bench"
)
needs_tau = pytest.mark.skipif(not TAU_DIR.is_dir(), reason="tau-bench data not present")


@pytest.fixture(scope="module")
def retail():
    return TauDomain.from_dir("retail", TAU_DIR / "retail")


@pytest.fixture(scope="module")
def synthetic():
    return generate(seed=5).domain()


@needs_tau
def test_gold_replay_of_all_training_tasks_reproduces_ground_truth_hashes(retail):
    tasks = load_tasks(TAU_DIR / "retail" / "tasks_train.jsonl")
    recorded = json.loads((TAU_DIR / "retail" / "gt_data_hashes_train.json").read_text())
    assert len(tasks) == len(recorded["tasks"]) == 500
    assert retail.new_database().data_hash() == recorded["initial_data_hash"]
    mismatches, error_counts = [], {}
    for index, (task, expected) in enumerate(zip(tasks, recorded["tasks"], strict=True)):
        replay = retail.replay(task.actions)
        if replay.data_hash != expected["gt_data_hash"]:
            mismatches.append(index)
        error_counts[index] = len(replay.errors)
        assert bool(replay.errors) == bool(expected["replay_errors"]), index
    assert mismatches == []
    # SPEC §11.1: these training tasks contain failing gold calls.
    failing = {
        24,
        27,
        148,
        253,
        369,
        427,
        431,
        469,
        81,
        161,
        229,
        314,
        349,
        376,
        441,
        214,
        252,
        288,
        351,
    }
    assert {i for i, n in error_counts.items() if n} == failing
    # Replaying never touched the shared pristine data.
    assert reference_data_hash(retail.pristine.tables) == recorded["initial_data_hash"]


@needs_tau
def test_list_all_product_types_is_sorted_by_name(retail):
    out = retail.invoke(retail.new_database(), "list_all_product_types", {})
    assert out.startswith('{"Action Camera": "3377618313", "Air Purifier": "3821016478", ')
    assert out.endswith('"Yoga Mat": "4635925001"}')
    assert len(json.loads(out)) == 50


@needs_tau
def test_cancel_refunds_gift_card_and_turns_int_balance_into_float(retail):
    db = retail.new_database()
    out = retail.invoke(
        db, "cancel_pending_order", {"order_id": "#W6779827", "reason": "ordered by mistake"}
    )
    order = json.loads(out)
    assert order["status"] == "cancelled"
    assert list(order)[-1] == "cancel_reason"
    assert order["payment_history"][-1] == {
        "transaction_type": "refund",
        "amount": 4079.45,
        "payment_method_id": "gift_card_7219486",
    }
    balance = db.tables["users"]["ethan_lopez_6291"]["payment_methods"]["gift_card_7219486"][
        "balance"
    ]
    assert balance == round(49 + 4079.45, 2) and isinstance(balance, float)
    assert db.data_hash() == reference_data_hash(db.tables)
    again = retail.invoke(
        db, "cancel_pending_order", {"order_id": "#W6779827", "reason": "ordered by mistake"}
    )
    assert again == "Error: non-pending order cannot be cancelled"


@needs_tau
def test_return_checks_payment_before_items(retail):
    db = retail.new_database()
    kwargs = {"order_id": "#W4817420", "item_ids": ["0000000000"], "payment_method_id": "nope"}
    assert (
        retail.invoke(db, "return_delivered_order_items", kwargs)
        == "Error: payment method not found"
    )
    kwargs["payment_method_id"] = "gift_card_8168843"
    assert retail.invoke(db, "return_delivered_order_items", kwargs) == "Error: some item not found"
    kwargs["item_ids"] = ["9624127908", "6777246137"]
    order = json.loads(retail.invoke(db, "return_delivered_order_items", kwargs))
    assert order["status"] == "return requested"
    assert order["return_items"] == ["6777246137", "9624127908"]


def _order_with(domain, status):
    return next(o for o in domain.pristine.tables["orders"].values() if o["status"] == status)


def test_modify_address_uses_spec_key_order(synthetic):
    db = synthetic.new_database()
    order = _order_with(synthetic, "pending")
    kwargs = {
        "order_id": order["order_id"],
        "address1": "1 A St",
        "address2": "",
        "city": "X",
        "state": "CA",
        "country": "USA",
        "zip": "90001",
    }
    out = json.loads(synthetic.invoke(db, "modify_pending_order_address", kwargs))
    assert list(out["address"]) == ["address1", "address2", "city", "state", "country", "zip"]
    delivered = _order_with(synthetic, "delivered")
    kwargs["order_id"] = delivered["order_id"]
    assert synthetic.invoke(db, "modify_pending_order_address", kwargs) == (
        "Error: non-pending order cannot be modified"
    )


def test_modify_items_records_unrounded_difference_and_blocks_further_changes(synthetic):
    db = synthetic.new_database()
    products = synthetic.pristine.tables["products"]
    for order in synthetic.pristine.tables["orders"].values():
        if order["status"] != "pending":
            continue
        item = order["items"][0]
        others = [
            v
            for v in products[item["product_id"]]["variants"].values()
            if v["available"] and v["item_id"] != item["item_id"]
        ]
        if others:
            break
    card = next(
        m
        for m, v in db.tables["users"][order["user_id"]]["payment_methods"].items()
        if v["source"] == "credit_card"
    )
    kwargs = {
        "order_id": order["order_id"],
        "item_ids": [item["item_id"]],
        "new_item_ids": [others[0]["item_id"]],
        "payment_method_id": card,
    }
    out = json.loads(synthetic.invoke(db, "modify_pending_order_items", kwargs))
    diff = others[0]["price"] - item["price"]
    assert out["payment_history"][-1]["amount"] == abs(diff)
    assert out["payment_history"][-1]["transaction_type"] == ("payment" if diff > 0 else "refund")
    assert out["status"] == "pending (item modified)"
    assert out["items"][0]["item_id"] == others[0]["item_id"]
    again = synthetic.invoke(
        db, "cancel_pending_order", {"order_id": order["order_id"], "reason": "no longer needed"}
    )
    assert again == "Error: non-pending order cannot be cancelled"


def test_argument_binding_errors_use_upstream_texts(synthetic):
    db = synthetic.new_database()
    call = synthetic.invoke
    assert call(db, "cancel_pending_order", {"order_id": "#W1"}) == (
        "Error: CancelPendingOrder.invoke() missing 1 required positional argument: 'reason'"
    )
    assert call(db, "cancel_pending_order", {}) == (
        "Error: CancelPendingOrder.invoke() missing 2 required positional arguments: 'order_id' and 'reason'"
    )
    assert call(db, "modify_user_address", {"user_id": "u"}) == (
        "Error: ModifyUserAddress.invoke() missing 6 required positional arguments: 'address1', "
        "'address2', 'city', 'state', 'country', and 'zip'"
    )
    assert call(db, "get_user_details", {"user_id": "u", "x": 1, "y": 2}) == (
        "Error: GetUserDetails.invoke() got an unexpected keyword argument 'x'"
    )
    assert call(db, "get_user_details", {"data": 1, "zzz": 2}) == (
        "Error: tau_bench.envs.retail.tools.get_user_details.GetUserDetails.invoke() got multiple "
        "values for keyword argument 'data'"
    )
    assert call(db, "fly_to_moon", {}) == "Unknown action fly_to_moon"


def test_exceptions_inside_tools_become_error_texts(synthetic):
    db = synthetic.new_database()
    assert synthetic.invoke(db, "get_order_details", {"order_id": ["#W1"]}) == (
        "Error: unhashable type: 'list'"
    )
    assert synthetic.invoke(db, "find_user_id_by_email", {"email": 7}) == (
        "Error: 'int' object has no attribute 'lower'"
    )


def test_lookups_and_read_only_tools(synthetic):
    db = synthetic.new_database()
    user_id, user = next(iter(synthetic.pristine.tables["users"].items()))
    assert (
        synthetic.invoke(db, "find_user_id_by_email", {"email": user["email"].upper()}) == user_id
    )
    name = user["name"]
    kwargs = {
        "first_name": name["first_name"].lower(),
        "last_name": name["last_name"],
        "zip": user["address"]["zip"],
    }
    assert synthetic.invoke(db, "find_user_id_by_name_zip", kwargs) == user_id
    assert synthetic.invoke(db, "get_user_details", {"user_id": user_id}) == json.dumps(user)
    assert synthetic.invoke(db, "get_user_details", {"user_id": "x"}) == "Error: user not found"
    assert synthetic.invoke(db, "think", {"thought": "hm"}) == ""
    assert (
        synthetic.invoke(db, "transfer_to_human_agents", {"summary": "s"}) == "Transfer successful"
    )
    assert synthetic.invoke(db, "calculate", {"expression": "1 + 2"}) == "3.0"
    assert db.data_hash() == synthetic.new_database().data_hash()


def test_toolset_runs_tools_on_the_episode_database(synthetic):
    import asyncio

    from turnrl.tool_envs.tool_calls import ToolCall

    db = synthetic.new_database()
    tools = synthetic.toolset(db)
    assert tools.names == list(synthetic.tools)
    order = _order_with(synthetic, "pending")
    result = asyncio.run(
        tools.call(
            ToolCall(
                "cancel_pending_order",
                {"order_id": order["order_id"], "reason": "no longer needed"},
            )
        )
    )
    assert result.ok and json.loads(result.content)["status"] == "cancelled"
    assert db.tables["orders"][order["order_id"]]["status"] == "cancelled"
