"""Random tool-call sequences: copy-on-write episodes behave exactly like private copies.

Each sequence runs twice: on a copy-on-write episode database and on a database whose
every record was copied up front. Observations and hashes must agree at every step, the
fast hash must equal the reference hash, and the shared pristine data must not change.
This catches a tool that writes to a record without taking its private copy.
"""

import json
import os
import random
from pathlib import Path

import pytest

from turnrl.tool_envs.tau import PristineData, TauDomain, reference_data_hash
from turnrl.tool_envs.tau.db import copy_record
from turnrl.tool_envs.tau.synth import generate

TAU_DIR = Path(
    os.environ.get("TURNRL_TAU_BENCH_DIR")
    or Path(__file__).resolve().parents[3] / ".." / "shared" / "tau-bench"
)


def _retail_kwargs(rng, tables, name):
    order = rng.choice(list(tables["orders"].values()))
    user = tables["users"][order["user_id"]]
    items = [i["item_id"] for i in order["items"]]
    old = rng.sample(items, rng.randint(0, len(items)))
    new = []
    for item_id in old:
        item = next(i for i in order["items"] if i["item_id"] == item_id)
        new.append(rng.choice(list(tables["products"][item["product_id"]]["variants"])))
    methods = [*user["payment_methods"], "gift_card_0000000"]
    address = {
        "address1": "1 St",
        "address2": "",
        "city": "C",
        "state": "S",
        "country": "U",
        "zip": "1",
    }
    return {
        "calculate": {"expression": rng.choice(["1+2", "3.5*2", "1/0", "(2"])},
        "cancel_pending_order": {
            "order_id": order["order_id"],
            "reason": rng.choice(["no longer needed", "ordered by mistake", "x"]),
        },
        "exchange_delivered_order_items": {
            "order_id": order["order_id"],
            "item_ids": old,
            "new_item_ids": new,
            "payment_method_id": rng.choice(methods),
        },
        "find_user_id_by_email": {"email": user["email"]},
        "find_user_id_by_name_zip": {**user["name"], "zip": user["address"]["zip"]},
        "get_order_details": {"order_id": order["order_id"]},
        "get_product_details": {"product_id": order["items"][0]["product_id"]},
        "get_user_details": {"user_id": order["user_id"]},
        "list_all_product_types": {},
        "modify_pending_order_address": {"order_id": order["order_id"], **address},
        "modify_pending_order_items": {
            "order_id": order["order_id"],
            "item_ids": old,
            "new_item_ids": new,
            "payment_method_id": rng.choice(methods),
        },
        "modify_pending_order_payment": {
            "order_id": order["order_id"],
            "payment_method_id": rng.choice(methods),
        },
        "modify_user_address": {"user_id": order["user_id"], **address},
        "return_delivered_order_items": {
            "order_id": order["order_id"],
            "item_ids": old,
            "payment_method_id": rng.choice(methods),
        },
        "think": {"thought": "t"},
        "transfer_to_human_agents": {"summary": "s"},
    }[name]


def _airline_kwargs(rng, tables, name):
    reservation = rng.choice(list(tables["reservations"].values()))
    user_id = reservation["user_id"]
    methods = list(tables["users"][user_id]["payment_methods"])
    flights = [
        {"flight_number": f["flight_number"], "date": f["date"]} for f in reservation["flights"]
    ]
    if rng.random() < 0.5:
        flights = [
            {
                "flight_number": rng.choice(list(tables["flights"])),
                "date": f"2024-05-{rng.randint(14, 30)}",
            }
        ]
    cabin = rng.choice(["basic_economy", "economy", "business"])
    pay = [{"payment_id": rng.choice(methods), "amount": rng.choice([0, 100, 500, 1000])}]
    origin, destination = rng.sample(["JFK", "SFO", "LAX", "ORD", "SEA", "ATL"], 2)
    return {
        "book_reservation": {
            "user_id": user_id,
            "origin": origin,
            "destination": destination,
            "flight_type": "one_way",
            "cabin": cabin,
            "flights": flights,
            "passengers": reservation["passengers"],
            "payment_methods": pay,
            "total_baggages": 1,
            "nonfree_baggages": rng.randint(0, 1),
            "insurance": "no",
        },
        "calculate": {"expression": "2*3"},
        "cancel_reservation": {"reservation_id": reservation["reservation_id"]},
        "get_reservation_details": {"reservation_id": reservation["reservation_id"]},
        "get_user_details": {"user_id": user_id},
        "list_all_airports": {},
        "search_direct_flight": {
            "origin": origin,
            "destination": destination,
            "date": "2024-05-20",
        },
        "search_onestop_flight": {
            "origin": origin,
            "destination": destination,
            "date": "2024-05-20",
        },
        "send_certificate": {"user_id": user_id, "amount": rng.choice([100, 150.0])},
        "think": {"thought": "t"},
        "transfer_to_human_agents": {"summary": "s"},
        "update_reservation_baggages": {
            "reservation_id": reservation["reservation_id"],
            "total_baggages": 2,
            "nonfree_baggages": rng.randint(0, 3),
            "payment_id": rng.choice(methods),
        },
        "update_reservation_flights": {
            "reservation_id": reservation["reservation_id"],
            "cabin": cabin,
            "flights": flights,
            "payment_id": rng.choice(methods),
        },
        "update_reservation_passengers": {
            "reservation_id": reservation["reservation_id"],
            "passengers": list(reversed(reservation["passengers"])),
        },
    }[name]


def _run_fuzz(domain, make_kwargs, sequences, steps, seed):
    before = json.dumps(domain.pristine.tables)
    rng = random.Random(seed)
    pristine_hash = domain.new_database().data_hash()
    changed = 0
    for _ in range(sequences):
        cow = domain.new_database()
        private = PristineData(copy_record(domain.pristine.tables)).new_database()
        for table, records in private.tables.items():
            for key in list(records):
                private.mutable(table, key)
        for _ in range(steps):
            name = rng.choice(list(domain.tools))
            kwargs = make_kwargs(rng, cow.tables, name)
            out_cow = domain.invoke(cow, name, copy_record(kwargs))
            out_private = domain.invoke(private, name, copy_record(kwargs))
            assert out_cow == out_private, name
        assert (
            cow.data_hash()
            == reference_data_hash(cow.tables)
            == reference_data_hash(private.tables)
        )
        changed += cow.data_hash() != pristine_hash
    assert json.dumps(domain.pristine.tables) == before
    assert changed > 0  # the sequences did write


def test_synthetic_retail_fuzz():
    _run_fuzz(generate(seed=9).domain(), _retail_kwargs, sequences=25, steps=12, seed=1)


@pytest.mark.skipif(not TAU_DIR.is_dir(), reason="tau-bench data not present")
def test_tau_bench_retail_fuzz():
    _run_fuzz(
        TauDomain.from_dir("retail", TAU_DIR / "retail"),
        _retail_kwargs,
        sequences=4,
        steps=25,
        seed=2,
    )


@pytest.mark.skipif(not TAU_DIR.is_dir(), reason="tau-bench data not present")
def test_tau_bench_airline_fuzz():
    _run_fuzz(
        TauDomain.from_dir("airline", TAU_DIR / "airline"),
        _airline_kwargs,
        sequences=4,
        steps=25,
        seed=3,
    )
