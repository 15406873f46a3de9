"""A synthetic mini-retail domain: a small database and solvable tasks, fixed by a seed.

The database has tau-bench's retail layout and record shapes (so the retail tools run on
it unchanged); tasks carry gold actions in tau-bench's schema and need a handful of tool
calls: look up an order's status, cancel a pending order, change a pending order's
address, return or exchange delivered items. Every generated task is checked by
replaying its gold actions: none may fail and every write task must change the data.
The catalogue, names and policy text are turnrl's own.
"""

from __future__ import annotations

import itertools
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from turnrl.tool_envs.tau.db import PristineData
from turnrl.tool_envs.tau.domain import TauDomain
from turnrl.tool_envs.tau.tasks import Action, Task

_CATALOGUE: dict[str, dict[str, list[str]]] = {
    "Desk Lamp": {"color": ["black", "white", "brass"], "bulb": ["LED", "halogen"]},
    "Water Bottle": {"capacity": ["500ml", "750ml", "1L"], "material": ["steel", "glass"]},
    "Backpack": {"color": ["navy", "olive", "grey"], "size": ["small", "large"]},
    "Headphones": {"type": ["over-ear", "in-ear"], "color": ["black", "red", "blue"]},
    "Notebook": {"size": ["A5", "A4"], "paper": ["lined", "dotted", "blank"]},
    "Coffee Mug": {"volume": ["300ml", "450ml"], "color": ["white", "green", "orange"]},
}
_FIRST = [
    "Ada",
    "Bruno",
    "Chloe",
    "Dario",
    "Elena",
    "Farid",
    "Greta",
    "Hugo",
    "Ines",
    "Jonas",
    "Keiko",
    "Liam",
    "Maya",
    "Nils",
    "Olga",
    "Pablo",
    "Rosa",
    "Sami",
    "Tara",
    "Umar",
]
_LAST = [
    "Okafor",
    "Lindqvist",
    "Moreau",
    "Tanaka",
    "Silva",
    "Novak",
    "Haddad",
    "Berg",
    "Costa",
    "Fischer",
    "Ivanova",
    "Kowalski",
    "Mendes",
    "Park",
    "Rossi",
    "Weber",
]
_CITIES = [
    ("Springfield", "IL", "62701"),
    ("Riverton", "WY", "82501"),
    ("Lakeview", "OR", "97630"),
    ("Fairview", "TN", "37062"),
    ("Georgetown", "TX", "78626"),
    ("Madison", "WI", "53703"),
]
_STREETS = ["Oak St", "Maple Ave", "Cedar Ln", "Pine Rd", "Elm Ct", "Birch Way", "Willow Dr"]
_STATUSES = ["pending", "pending", "delivered", "delivered", "processed", "cancelled"]

WIKI = """# Mini-retail agent policy

You are a customer service agent of a small online shop. You can look things up and
change orders with the tools, and you talk to the customer in plain text.

- Before anything else, identify the customer: find their user id by email, or by
  first name, last name and zip code.
- Only act on orders of the identified customer. Get the order details before acting.
- Pending orders can be cancelled (reason "no longer needed" or "ordered by mistake")
  or have their shipping address changed.
- Delivered orders can have items returned (refund to the original payment method or a
  gift card) or exchanged for another variant of the same product (the customer pays or
  receives the price difference with a payment method of their profile).
- Before any change, state what you will do and ask the customer to confirm with "yes".
- Make at most one tool call at a time and never make up ids or information.
- If you cannot help, transfer the customer to a human agent.
"""


@dataclass
class SyntheticRetail:
    """A generated mini-retail domain."""

    tables: dict[str, dict[str, Any]]
    """``orders``, ``products`` and ``users`` in tau-bench's retail shapes."""
    tasks: list[Task]
    """Tasks with gold actions, all replaying without errors."""
    wiki: str
    """The policy text (system prompt)."""

    def domain(self) -> TauDomain:
        """The generated data as a :class:`TauDomain` (built-in tool schemas)."""
        tables = json.loads(json.dumps(self.tables))  # independent of later edits
        return TauDomain("retail", PristineData(tables), self.wiki)


def _digits(rng: random.Random, n: int) -> str:
    return str(rng.randint(10 ** (n - 1), 10**n - 1))


def _products(rng: random.Random) -> dict[str, Any]:
    products = {}
    for name, options in _CATALOGUE.items():
        product_id = _digits(rng, 10)
        variants = {}
        keys = list(options)
        for combo in itertools.product(*(options[k] for k in keys)):
            item_id = _digits(rng, 10)
            variants[item_id] = {
                "item_id": item_id,
                "options": dict(zip(keys, combo, strict=True)),
                "available": rng.random() < 0.8,
                "price": round(rng.uniform(8, 300), 2),
            }
        products[product_id] = {"name": name, "product_id": product_id, "variants": variants}
    return products


def _user(rng: random.Random, first: str, last: str) -> tuple[str, dict[str, Any]]:
    user_id = f"{first.lower()}_{last.lower()}_{_digits(rng, 4)}"
    city, state, zip_code = rng.choice(_CITIES)
    methods: dict[str, Any] = {}
    card = f"credit_card_{_digits(rng, 7)}"
    brand = rng.choice(["visa", "mastercard"])
    methods[card] = {
        "source": "credit_card",
        "brand": brand,
        "last_four": _digits(rng, 4),
        "id": card,
    }
    if rng.random() < 0.5:
        gift = f"gift_card_{_digits(rng, 7)}"
        methods[gift] = {"source": "gift_card", "balance": rng.randint(0, 400), "id": gift}
    if rng.random() < 0.4:
        paypal = f"paypal_{_digits(rng, 7)}"
        methods[paypal] = {"source": "paypal", "id": paypal}
    address = {
        "address1": f"{rng.randint(1, 999)} {rng.choice(_STREETS)}",
        "address2": rng.choice(["", f"Suite {rng.randint(100, 999)}"]),
        "city": city,
        "country": "USA",
        "state": state,
        "zip": zip_code,
    }
    email = f"{first.lower()}.{last.lower()}{_digits(rng, 4)}@example.com"
    return user_id, {
        "name": {"first_name": first, "last_name": last},
        "address": address,
        "email": email,
        "payment_methods": methods,
        "orders": [],
    }


def _order(
    rng: random.Random, user_id: str, user: dict[str, Any], products: dict[str, Any]
) -> dict:
    order_id = f"#W{_digits(rng, 7)}"
    items = []
    for product in rng.sample(list(products.values()), rng.randint(1, 3)):
        variant = rng.choice(list(product["variants"].values()))
        items.append(
            {
                "name": product["name"],
                "product_id": product["product_id"],
                "item_id": variant["item_id"],
                "price": variant["price"],
                "options": dict(variant["options"]),
            }
        )
    status = rng.choice(_STATUSES)
    fulfillments = []
    if status in ("delivered", "processed"):
        fulfillments = [
            {"tracking_id": [_digits(rng, 12)], "item_ids": [i["item_id"] for i in items]}
        ]
    method = rng.choice(list(user["payment_methods"]))
    total = round(sum(i["price"] for i in items), 2)
    history = [{"transaction_type": "payment", "amount": total, "payment_method_id": method}]
    if status == "cancelled":
        history.append({"transaction_type": "refund", "amount": total, "payment_method_id": method})
    return {
        "order_id": order_id,
        "user_id": user_id,
        "address": dict(user["address"]),
        "items": items,
        "fulfillments": fulfillments,
        "status": status,
        "payment_history": history,
    }


def _identify(rng: random.Random, user_id: str, user: dict[str, Any]) -> tuple[str, Action]:
    name = user["name"]
    if rng.random() < 0.5:
        text = f"Your name is {name['first_name']} {name['last_name']} and your email is {user['email']}."
        return text, Action("find_user_id_by_email", {"email": user["email"]})
    zip_code = user["address"]["zip"]
    text = f"Your name is {name['first_name']} {name['last_name']} and your zip code is {zip_code}."
    kwargs = {"first_name": name["first_name"], "last_name": name["last_name"], "zip": zip_code}
    return text, Action("find_user_id_by_name_zip", kwargs)


TASK_KINDS: dict[str, str] = {
    "status": "get_order_details",
    "cancel": "cancel_pending_order",
    "address": "modify_pending_order_address",
    "return": "return_delivered_order_items",
    "exchange": "exchange_delivered_order_items",
}
"""Synthetic task kind -> the name of its last gold action."""


def _task_for(kind: str, rng: random.Random, order: dict, tables: dict) -> Task | None:
    """One task of ``kind`` about ``order``, or ``None`` when the order does not fit."""
    user = tables["users"][order["user_id"]]
    who, find = _identify(rng, order["user_id"], user)
    oid = order["order_id"]
    look = Action("get_order_details", {"order_id": oid})
    status = order["status"]
    if kind == "status":
        text = f"{who} You want to know the current status of your order {oid}. Ask nothing else."
        return Task(order["user_id"], (find, look), text, (status,))
    if kind == "cancel" and status == "pending":
        reason = rng.choice(["no longer needed", "ordered by mistake"])
        why = {
            "no longer needed": "you no longer need it",
            "ordered by mistake": "you ordered it by mistake",
        }
        text = f"{who} You want to cancel order {oid} because {why[reason]}."
        return Task(
            order["user_id"],
            (find, look, Action("cancel_pending_order", {"order_id": oid, "reason": reason})),
            text,
        )
    if kind == "address" and status == "pending":
        new = {
            "address1": f"{rng.randint(1, 999)} {rng.choice(_STREETS)}",
            "address2": "",
            "city": "Fairview",
            "state": "TN",
            "country": "USA",
            "zip": "37062",
        }
        text = (
            f"{who} You moved. Ship order {oid} to {new['address1']}, {new['city']}, "
            f"{new['state']} {new['zip']}, {new['country']} (no second address line)."
        )
        return Task(
            order["user_id"],
            (find, look, Action("modify_pending_order_address", {"order_id": oid, **new})),
            text,
        )
    if kind == "return" and status == "delivered":
        item = rng.choice(order["items"])
        method = order["payment_history"][0]["payment_method_id"]
        kwargs = {"order_id": oid, "item_ids": [item["item_id"]], "payment_method_id": method}
        text = f"{who} You want to return the {item['name']} from order {oid}, refunded to the original payment method."
        return Task(
            order["user_id"], (find, look, Action("return_delivered_order_items", kwargs)), text
        )
    if kind == "exchange" and status == "delivered":
        return _exchange_task(rng, order, tables, who, find, look)
    return None


def _exchange_task(
    rng: random.Random, order: dict, tables: dict, who: str, find: Action, look: Action
) -> Task | None:
    methods = tables["users"][order["user_id"]]["payment_methods"]
    card = next(m for m, v in methods.items() if v["source"] == "credit_card")
    for item in rng.sample(order["items"], len(order["items"])):
        product = tables["products"][item["product_id"]]
        choices = [
            v
            for v in product["variants"].values()
            if v["available"] and v["item_id"] != item["item_id"]
        ]
        if not choices:
            continue
        new = rng.choice(choices)
        wanted = ", ".join(f"{k} {v}" for k, v in new["options"].items())
        text = (
            f"{who} You want to exchange the {item['name']} in order {order['order_id']} for the variant "
            f"with {wanted}. Pay any difference with your credit card."
        )
        kwargs = {
            "order_id": order["order_id"],
            "item_ids": [item["item_id"]],
            "new_item_ids": [new["item_id"]],
            "payment_method_id": card,
        }
        details = Action("get_product_details", {"product_id": product["product_id"]})
        return Task(
            order["user_id"],
            (find, look, details, Action("exchange_delivered_order_items", kwargs)),
            text,
        )
    return None


def generate(seed: int, num_users: int = 12, num_tasks: int = 20) -> SyntheticRetail:
    """Generate a database and ``num_tasks`` tasks, deterministically from ``seed``."""
    if num_users < 1 or num_tasks < 1:
        raise ValueError(f"num_users and num_tasks must be >= 1, got {num_users}, {num_tasks}")
    if num_users > len(_FIRST) * len(_LAST):
        raise ValueError(f"num_users must be <= {len(_FIRST) * len(_LAST)}")
    rng = random.Random(seed)
    products = _products(rng)
    users: dict[str, Any] = {}
    orders: dict[str, Any] = {}
    names = rng.sample(list(itertools.product(_FIRST, _LAST)), num_users)
    for first, last in names:
        user_id, user = _user(rng, first, last)
        users[user_id] = user
        for _ in range(rng.randint(1, 3)):
            order = _order(rng, user_id, user, products)
            orders[order["order_id"]] = order
            user["orders"].append(order["order_id"])
    tables = {"orders": orders, "products": products, "users": users}
    wiki = WIKI
    tasks = _tasks(rng, tables, num_tasks)
    synthetic = SyntheticRetail(tables, tasks, wiki)
    _check_solvable(synthetic)
    return synthetic


def _tasks(rng: random.Random, tables: dict, num_tasks: int) -> list[Task]:
    kinds = ["cancel", "status", "exchange", "address", "return"]
    orders = list(tables["orders"].values())
    tasks: list[Task] = []
    for attempt in range(num_tasks * 50):
        kind = kinds[len(tasks) % len(kinds)] if attempt % 10 < 9 else "status"
        task = _task_for(kind, rng, rng.choice(orders), tables)
        if task is not None:
            tasks.append(task)
            if len(tasks) == num_tasks:
                return tasks
    raise ValueError(f"could not generate {num_tasks} tasks; use more users")


def _check_solvable(synthetic: SyntheticRetail) -> None:
    domain = synthetic.domain()
    pristine_hash = domain.new_database().data_hash()
    for index, task in enumerate(synthetic.tasks):
        replay = domain.replay(task.actions)
        if replay.errors:
            raise AssertionError(f"synthetic task {index} fails on replay: {replay.errors}")
        writes = task.actions[-1].name not in ("get_order_details",)
        if writes and replay.data_hash == pristine_hash:
            raise AssertionError(f"synthetic task {index} changes nothing")


def write(synthetic: SyntheticRetail, out_dir: str | Path) -> Path:
    """Write ``users.json``, ``orders.json``, ``products.json``, ``tasks.jsonl``, ``wiki.md``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, table in synthetic.tables.items():
        (out / f"{name}.json").write_text(json.dumps(table, indent=2) + "\n", encoding="utf-8")
    lines = [json.dumps(task.to_dict()) for task in synthetic.tasks]
    (out / "tasks.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (out / "wiki.md").write_text(synthetic.wiki, encoding="utf-8")
    return out
