"""Database loading (with clear errors), copy-on-write episodes and the fast data hash."""

import hashlib
import json
import os
import random
from pathlib import Path

import pytest

from turnrl.tool_envs.tau import DataError, PristineData, TauDomain, reference_data_hash
from turnrl.tool_envs.tau.db import DOMAIN_TABLES, load_table
from turnrl.tool_envs.tau.synth import generate, write

TAU_DIR = Path(
    os.environ.get("TURNRL_TAU_BENCH_DIR")
    or Path(__file__).resolve().parents[3] / ".." / "shared" / "tau-bench"
)
needs_tau = pytest.mark.skipif(not TAU_DIR.is_dir(), reason="tau-bench data not present")

# Test vectors of SPEC.md §5: canonical text and its sha256, computed by the reference.
VECTORS = [
    (
        {"b": [1, 2.5, True, None, "it's"], "a": {}},
        "(('a', ()), ('b', (1, 2.5, True, None, \"it's\")))",
        "5a9d616f5dc36626897134fe2e3921b106803d2cf255e9fcc0262ec7d4faa2b1",
    ),
    ({"x": []}, "(('x', ()),)", "13f1178f20e7e705cc890579408c94298bd940002b29f774fd774d374a28c6a3"),
    (
        {"k": [{"z": 1e16, "y": 0.0001, "w": 1e-05, "v": -0.0, "u": 100.0}]},
        "(('k', ((('u', 100.0), ('v', -0.0), ('w', 1e-05), ('y', 0.0001), ('z', 1e+16)),)),)",
        "f8ea3baecd5d8a5166e10c00370ca7351130a400aa0db5827acedbecedddba33",
    ),
]


@pytest.mark.parametrize(("value", "text", "digest"), VECTORS)
def test_reference_hash_matches_spec_vectors(value, text, digest):
    assert hashlib.sha256(text.encode()).hexdigest() == digest
    assert reference_data_hash(value) == digest


TABLE_VECTORS = [
    (
        {"t": {"b": {"x": [1, 2.5, True, None, "it's"]}, "a": {}}},
        "(('t', (('a', ()), ('b', (('x', (1, 2.5, True, None, \"it's\")),)))),)",
    ),
    (
        {"u": {}, "k": {"r": {"z": 1e16, "v": -0.0, "w": [1e-05, 100.0]}}},
        "(('k', (('r', (('v', -0.0), ('w', (1e-05, 100.0)), ('z', 1e+16))),)), ('u', ()))",
    ),
]


@pytest.mark.parametrize(("tables", "text"), TABLE_VECTORS)
def test_fast_hash_matches_hand_written_canonical_text(tables, text):
    digest = hashlib.sha256(text.encode()).hexdigest()
    assert reference_data_hash(tables) == digest
    assert PristineData(tables).new_database().data_hash() == digest


@pytest.fixture(scope="module")
def synthetic_dir(tmp_path_factory):
    return write(generate(seed=11), tmp_path_factory.mktemp("synth"))


def test_loads_a_folder_in_tau_layout(synthetic_dir):
    domain = TauDomain.from_dir("retail", synthetic_dir)
    assert list(domain.pristine.tables) == list(DOMAIN_TABLES["retail"])
    assert domain.wiki.startswith("# Mini-retail")
    assert [s["function"]["name"] for s in domain.schemas] == list(domain.tools)


def test_missing_folder_is_a_clear_error(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        TauDomain.from_dir("retail", tmp_path / "nope")


def test_missing_file_is_a_clear_error(synthetic_dir, tmp_path):
    for name in ("orders.json", "products.json", "wiki.md"):
        (tmp_path / name).write_text((synthetic_dir / name).read_text())
    with pytest.raises(DataError, match=r"missing data file .*users\.json"):
        TauDomain.from_dir("retail", tmp_path)


def test_missing_wiki_is_a_clear_error(synthetic_dir, tmp_path):
    for name in ("orders.json", "products.json", "users.json"):
        (tmp_path / name).write_text((synthetic_dir / name).read_text())
    with pytest.raises(DataError, match=r"wiki\.md"):
        TauDomain.from_dir("retail", tmp_path)


def test_corrupt_json_is_a_clear_error(tmp_path):
    (tmp_path / "orders.json").write_text('{"#W1": {"order_id": ')
    with pytest.raises(DataError, match=r"orders\.json is not valid JSON"):
        load_table(tmp_path / "orders.json")


def test_table_that_is_not_an_object_is_rejected(tmp_path):
    (tmp_path / "users.json").write_text("[1, 2]")
    with pytest.raises(DataError, match="must hold a JSON object"):
        load_table(tmp_path / "users.json")


def test_record_that_is_not_an_object_is_rejected(tmp_path):
    (tmp_path / "users.json").write_text('{"u1": 3}')
    with pytest.raises(DataError, match="record 'u1' must be an object"):
        load_table(tmp_path / "users.json")


def test_bad_tools_json_is_rejected(synthetic_dir, tmp_path):
    for name in ("orders.json", "products.json", "users.json", "wiki.md"):
        (tmp_path / name).write_text((synthetic_dir / name).read_text())
    (tmp_path / "tools.json").write_text('{"not": "a list"}')
    with pytest.raises(DataError, match=r"tools\.json must be a list"):
        TauDomain.from_dir("retail", tmp_path)


def test_unknown_domain_is_rejected(synthetic_dir):
    with pytest.raises(ValueError, match="unknown tau domain"):
        TauDomain.from_dir("hotel", synthetic_dir)


def test_copy_on_write_keeps_pristine_data_untouched(synthetic_dir):
    domain = TauDomain.from_dir("retail", synthetic_dir)
    before = json.dumps(domain.pristine.tables)
    db = domain.new_database()
    user_id = next(iter(db.tables["users"]))
    record = db.mutable("users", user_id)
    record["email"] = "changed@example.com"
    record["orders"].append("#W0000000")
    assert json.dumps(domain.pristine.tables) == before
    assert domain.new_database().tables["users"][user_id]["email"] != "changed@example.com"
    with pytest.raises(KeyError):
        db.mutable("users", "no_such_user")


def _random_edit(rng, db):
    table = rng.choice(list(db.tables))
    key = rng.choice(list(db.tables[table]))
    record = db.mutable(table, key)
    choice = rng.randrange(4)
    if choice == 0:
        record["extra"] = rng.choice([1, 1.0, -0.0, "x'y", None, True, [], {}])
    elif choice == 1:
        record.pop(rng.choice(list(record)))
    elif choice == 2:
        db.put(table, f"new_{rng.randrange(1000)}", {"z": [rng.random()], "a": "é\n"})
    else:
        record[rng.choice(list(record))] = {"nested": [1, {"b": 2.5}]}


def test_fast_hash_equals_reference_after_random_edits(synthetic_dir):
    domain = TauDomain.from_dir("retail", synthetic_dir)
    rng = random.Random(0)
    for _ in range(30):
        db = domain.new_database()
        for _ in range(rng.randrange(1, 6)):
            _random_edit(rng, db)
        assert db.data_hash() == reference_data_hash(db.tables)
    assert domain.new_database().data_hash() == reference_data_hash(domain.pristine.tables)


@needs_tau
@pytest.mark.parametrize(
    ("domain", "digest"),
    [
        ("retail", "5a4b2cb59f4d12dea7e4adff24a7f8fada510ead49372ea4a729a82bbb5f49b5"),
        ("airline", "4587e6b48ad2b2c4f3e1fecb40aabec7bb2286513273b8f8cec3f5865222f290"),
    ],
)
def test_pristine_tau_bench_hashes(domain, digest):
    loaded = TauDomain.from_dir(domain, TAU_DIR / domain)
    assert loaded.new_database().data_hash() == digest
    assert reference_data_hash(loaded.pristine.tables) == digest
