"""Benchmark of the tau-bench retail environment: reset, tool step, final hash + reward.

Prints one JSON object. Every turnrl number is compared with a naive baseline measured
in the same run, done the way tau-bench does it: reset re-reads the JSON files (and, as
a second baseline, deep-copies a parsed database), the hash is SHA-256 of
``repr(to_hashable(db))`` (and, as another, of ``json.dumps(db, sort_keys=True)``), the
reward re-reads the data, replays the gold actions and hashes both databases. The
script also checks that turnrl's hashes equal the reference hashes of the same states.

    uv run --package turnrl-tool-envs python benchmarks/env_step.py [--data-dir DIR]

DIR defaults to ``$TURNRL_TAU_BENCH_DIR/retail`` or ``../shared/tau-bench/retail``
next to the repository.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from turnrl.tool_envs.tau import TauDomain, load_tasks, reference_data_hash, tau_reward
from turnrl.tool_envs.tau.db import DOMAIN_TABLES, Database, PristineData

ROOT = Path(__file__).resolve().parents[1]


def _default_dir() -> Path:
    base = os.environ.get("TURNRL_TAU_BENCH_DIR") or ROOT / ".." / "shared" / "tau-bench"
    return Path(base) / "retail"


def _median_us(func: Callable[[], Any], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        func()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def _reload(data_dir: Path) -> dict[str, Any]:
    return {t: json.loads((data_dir / f"{t}.json").read_text()) for t in DOMAIN_TABLES["retail"]}


def _tool_calls(domain: TauDomain) -> list[tuple[str, dict[str, Any]]]:
    """One valid call per retail tool, built from the data."""
    tables = domain.pristine.tables
    orders = list(tables["orders"].values())

    def fits(order: dict[str, Any]) -> bool:
        methods = tables["users"][order["user_id"]]["payment_methods"]
        current = order["payment_history"][0]["payment_method_id"]
        return len(order["payment_history"]) == 1 and any(
            m != current and r["source"] != "gift_card" for m, r in methods.items()
        )

    pending = next(o for o in orders if o["status"] == "pending" and fits(o))
    delivered = next(o for o in orders if o["status"] == "delivered")
    user = tables["users"][pending["user_id"]]
    current_pm = pending["payment_history"][0]["payment_method_id"]
    other_pm = next(
        m
        for m, r in user["payment_methods"].items()
        if m != current_pm and r["source"] != "gift_card"
    )
    item = pending["items"][0]
    variants = tables["products"][item["product_id"]]["variants"]
    new_item = next(v for v, r in variants.items() if r["available"] and v != item["item_id"])
    d_item = delivered["items"][0]
    d_variants = tables["products"][d_item["product_id"]]["variants"]
    d_new = next(v for v, r in d_variants.items() if r["available"] and v != d_item["item_id"])
    d_pm = delivered["payment_history"][0]["payment_method_id"]
    address = {
        "address1": "1 Main St",
        "address2": "",
        "city": "Austin",
        "state": "TX",
        "country": "USA",
        "zip": "78701",
    }
    return [
        ("calculate", {"expression": "(1234.5 + 99.99) * 2 / 3"}),
        ("cancel_pending_order", {"order_id": pending["order_id"], "reason": "no longer needed"}),
        (
            "exchange_delivered_order_items",
            {
                "order_id": delivered["order_id"],
                "item_ids": [d_item["item_id"]],
                "new_item_ids": [d_new],
                "payment_method_id": d_pm,
            },
        ),
        ("find_user_id_by_email", {"email": user["email"]}),
        (
            "find_user_id_by_name_zip",
            {
                "first_name": user["name"]["first_name"],
                "last_name": user["name"]["last_name"],
                "zip": user["address"]["zip"],
            },
        ),
        ("get_order_details", {"order_id": pending["order_id"]}),
        ("get_product_details", {"product_id": item["product_id"]}),
        ("get_user_details", {"user_id": pending["user_id"]}),
        ("list_all_product_types", {}),
        ("modify_pending_order_address", {"order_id": pending["order_id"], **address}),
        (
            "modify_pending_order_items",
            {
                "order_id": pending["order_id"],
                "item_ids": [item["item_id"]],
                "new_item_ids": [new_item],
                "payment_method_id": other_pm,
            },
        ),
        (
            "modify_pending_order_payment",
            {"order_id": pending["order_id"], "payment_method_id": other_pm},
        ),
        ("modify_user_address", {"user_id": pending["user_id"], **address}),
        (
            "return_delivered_order_items",
            {
                "order_id": delivered["order_id"],
                "item_ids": [d_item["item_id"]],
                "payment_method_id": d_pm,
            },
        ),
        ("think", {"thought": "checking"}),
        ("transfer_to_human_agents", {"summary": "customer asks for a manager"}),
    ]


def _step_us(domain: TauDomain, name: str, kwargs: dict[str, Any], repeat: int) -> float:
    """Median time of one call on a fresh episode database (database creation not timed)."""
    times = []
    for _ in range(repeat):
        db = domain.new_database()
        start = time.perf_counter()
        out = domain.invoke(db, name, kwargs)
        times.append(time.perf_counter() - start)
    assert not out.startswith("Error:"), (name, out)
    return statistics.median(times) * 1e6


def _final(domain: TauDomain, agent_db: Database, task: Any) -> dict[str, Any]:
    inputs = (agent_db.data_hash(), domain.gt_hash(task), task.outputs, list(task.outputs))
    return tau_reward(*inputs)


def _baseline_reward(
    data_dir: Path, agent_tables: dict[str, Any], domain: TauDomain, task: Any
) -> float:
    """tau-bench's way: hash the agent's data, re-read the files, replay gold, hash again."""
    h_agent = reference_data_hash(agent_tables)
    db = PristineData(_reload(data_dir)).new_database()
    for action in task.actions:
        domain.invoke(db, action.name, copy.deepcopy(action.kwargs))
    return 1.0 if reference_data_hash(db.tables) == h_agent else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data-dir", type=Path, default=_default_dir())
    parser.add_argument("--repeat", type=int, default=200)
    parser.add_argument("--tasks", type=int, default=20, help="tasks for hash/reward timing")
    args = parser.parse_args()
    data_dir: Path = args.data_dir
    domain = TauDomain.from_dir("retail", data_dir)
    domain.pristine.warm()
    tasks = load_tasks(data_dir / "tasks_train.jsonl")[: args.tasks]
    parsed = _reload(data_dir)

    reset = {
        "turnrl_us": _median_us(domain.new_database, args.repeat * 10),
        "baseline_json_reload_us": _median_us(lambda: _reload(data_dir), 20),
        "baseline_deepcopy_us": _median_us(lambda: copy.deepcopy(parsed), 20),
    }
    steps = {name: _step_us(domain, name, kw, args.repeat) for name, kw in _tool_calls(domain)}

    hash_t, hash_ref_t, hash_json_t, reward_cold_t, reward_warm_t, base_reward_t = (
        [],
        [],
        [],
        [],
        [],
        [],
    )
    identical = True
    for task in tasks:
        agent = domain.replay(task.actions).database
        start = time.perf_counter()
        fast = agent.data_hash()
        hash_t.append(time.perf_counter() - start)
        start = time.perf_counter()
        reference = reference_data_hash(agent.tables)
        hash_ref_t.append(time.perf_counter() - start)
        start = time.perf_counter()
        hashlib.sha256(json.dumps(agent.tables, sort_keys=True).encode()).hexdigest()
        hash_json_t.append(time.perf_counter() - start)
        identical &= fast == reference
        for times in (reward_cold_t, reward_warm_t):  # first call replays gold, second is cached
            start = time.perf_counter()
            result = _final(domain, agent, task)
            times.append(time.perf_counter() - start)
            identical &= result["reward"] == 1.0
        start = time.perf_counter()
        identical &= _baseline_reward(data_dir, agent.tables, domain, task) == 1.0
        base_reward_t.append(time.perf_counter() - start)

    def ms(values: list[float]) -> float:
        return round(statistics.median(values) * 1e3, 3)

    step_median = statistics.median(steps.values())
    report = {
        "data_dir_tables": {t: len(v) for t, v in domain.pristine.tables.items()},
        "reset": {k: round(v, 2) for k, v in reset.items()},
        "reset_speedup_vs_reload": round(reset["baseline_json_reload_us"] / reset["turnrl_us"], 1),
        "tool_step_us": {k: round(v, 2) for k, v in steps.items()},
        "tool_step_median_us": round(step_median, 2),
        "hash_ms": {
            "turnrl": ms(hash_t),
            "baseline_repr_to_hashable": ms(hash_ref_t),
            "baseline_json_sorted": ms(hash_json_t),
        },
        "hash_plus_reward_ms": {
            "turnrl_cold_gt": ms(reward_cold_t),
            "turnrl_cached_gt": ms(reward_warm_t),
            "baseline_tau_bench_way": ms(base_reward_t),
        },
        "hashes_identical_to_reference": bool(identical),
        "targets_met": {
            "reset_le_1ms": reset["turnrl_us"] <= 1000,
            "tool_step_median_le_100us": step_median <= 100,
            "hash_plus_reward_le_30ms": ms(reward_cold_t) <= 30,
        },
        "tasks_timed": len(tasks),
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
