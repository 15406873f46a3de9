"""tau-bench databases: loading, copy-on-write episodes and the fast data hash.

A domain's database is an ordered object of tables (retail: ``orders``, ``products``,
``users``; airline: ``flights``, ``reservations``, ``users``), each mapping an id to a
JSON record. :class:`PristineData` parses the files once. Every episode gets a
:class:`Database`: new table dicts that *share* the pristine records until a tool asks
for a record to write (:meth:`Database.mutable`), which then becomes a private copy. A
reset is therefore a few dict copies (tens of microseconds) instead of a JSON re-parse.

The data hash is tau-bench's: SHA-256 of ``repr(to_hashable(db))`` (objects become
tuples of ``(key, value)`` pairs sorted by key, lists become tuples). Because the
records are independent entries of sorted tables, the canonical text of every pristine
record is computed once and cached; a hash only re-renders the records an episode wrote.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DOMAIN_TABLES: dict[str, tuple[str, ...]] = {
    "retail": ("orders", "products", "users"),
    "airline": ("flights", "reservations", "users"),
}
"""The tables of each domain, in database order; each is read from ``<table>.json``."""


class DataError(ValueError):
    """A data folder is missing a file or holds a file that is not a valid table."""


def to_hashable(value: Any) -> Any:
    """tau-bench's canonical form: objects -> key-sorted pair tuples, lists -> tuples."""
    if isinstance(value, dict):
        return tuple(sorted((k, to_hashable(v)) for k, v in value.items()))
    if isinstance(value, list):
        return tuple(to_hashable(v) for v in value)
    if isinstance(value, set):
        return tuple(sorted(to_hashable(v) for v in value))
    return value


def reference_data_hash(data: Mapping[str, Any]) -> str:
    """The data hash computed the straightforward (slow) way; the ground truth for tests."""
    return hashlib.sha256(repr(to_hashable(dict(data))).encode("utf-8")).hexdigest()


def copy_record(value: Any) -> Any:
    """Deep copy of a JSON-like value (dicts, lists, scalars), keeping key order and types."""
    if isinstance(value, dict):
        return {k: copy_record(v) for k, v in value.items()}
    if isinstance(value, list):
        return [copy_record(v) for v in value]
    return value


def _entry_text(key: str, record: Any) -> bytes:
    """Canonical text of one ``(key, record)`` pair of a table, UTF-8 encoded."""
    return f"({key!r}, {to_hashable(record)!r})".encode()


def _json_text(record: Any) -> str:
    return json.dumps(record, sort_keys=True, default=str)


def load_table(path: Path) -> dict[str, Any]:
    """Read one table file: a JSON object mapping ids to records."""
    if not path.is_file():
        raise DataError(f"missing data file {path} (expected a JSON object of records)")
    try:
        table = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DataError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(table, dict):
        raise DataError(
            f"{path} must hold a JSON object mapping ids to records, got {type(table).__name__}"
        )
    for key, record in table.items():
        if not isinstance(record, dict):
            raise DataError(
                f"{path}: record {key!r} must be an object, got {type(record).__name__}"
            )
    return table


@dataclass
class _TableCache:
    """Sorted ids and per-record canonical texts of one pristine table (filled lazily)."""

    sorted_keys: list[str]
    texts: dict[str, bytes]


class PristineData:
    """A database parsed once; the shared, never-mutated source of every episode's data."""

    def __init__(self, tables: dict[str, dict[str, Any]]) -> None:
        """Wrap already-parsed tables (table name -> id -> record), in database order."""
        self.tables = tables
        self._cache: dict[str, _TableCache] = {}
        self._json_cache: dict[str, _TableCache] = {}

    @classmethod
    def from_dir(cls, data_dir: str | Path, table_names: Iterable[str]) -> PristineData:
        """Load ``<data_dir>/<table>.json`` for each table name."""
        root = Path(data_dir)
        if not root.is_dir():
            raise DataError(f"data folder {root} does not exist")
        return cls({name: load_table(root / f"{name}.json") for name in table_names})

    def table_cache(self, name: str) -> _TableCache:
        """The cached canonical texts of one table (computed on first use, ~tens of ms)."""
        cache = self._cache.get(name)
        if cache is None:
            table = self.tables[name]
            texts = {key: _entry_text(key, rec) for key, rec in table.items()}
            cache = _TableCache(sorted(table), texts)
            self._cache[name] = cache
        return cache

    def json_texts(self, name: str) -> _TableCache:
        """Sorted ids and each record's ``json.dumps(sort_keys=True, default=str)`` text."""
        cache = self._json_cache.get(name)
        if cache is None:
            table = self.tables[name]
            texts = {key: _json_text(rec).encode() for key, rec in table.items()}
            cache = _TableCache(sorted(table), texts)
            self._json_cache[name] = cache
        return cache

    def warm(self) -> None:
        """Fill every table's hash cache now (so the first episode's hash is fast too)."""
        for name in self.tables:
            self.table_cache(name)

    def new_database(self) -> Database:
        """A fresh episode database sharing the pristine records (copy on write)."""
        return Database(self)


class Database:
    """One episode's data: pristine records shared until written, then privately copied.

    Tools read ``db.tables[name][id]`` freely but must call :meth:`mutable` (or
    :meth:`put`) before changing a record, so the pristine data stays untouched.
    """

    def __init__(self, pristine: PristineData) -> None:
        """Start from ``pristine`` with no private records."""
        self.pristine = pristine
        self.tables: dict[str, dict[str, Any]] = {n: dict(t) for n, t in pristine.tables.items()}
        self._dirty: dict[str, set[str]] = {n: set() for n in pristine.tables}

    def mutable(self, table: str, key: Any) -> dict[str, Any]:
        """The record ``table[key]`` as a private copy that may be changed in place.

        Raises ``KeyError`` (like a dict lookup) when there is no such record.
        """
        records = self.tables[table]
        record = records[key]
        dirty = self._dirty[table]
        if key not in dirty:
            record = copy_record(record)
            records[key] = record
            dirty.add(key)
        return record

    def put(self, table: str, key: str, record: dict[str, Any]) -> None:
        """Store a new record or replace one (kept in place when the key exists)."""
        self.tables[table][key] = record
        self._dirty[table].add(key)

    def to_dict(self) -> dict[str, Any]:
        """A deep, independent copy of the whole database as plain dicts."""
        return {name: copy_record(table) for name, table in self.tables.items()}

    def data_hash(self) -> str:
        """tau-bench's data hash of the current state (equal to :func:`reference_data_hash`).

        The canonical text is fed to SHA-256 piece by piece (never concatenated whole);
        only records this episode wrote are rendered, the rest come from the cache.
        """
        hasher = hashlib.sha256(b"(")
        names = sorted(self.tables)
        for index, name in enumerate(names):
            hasher.update(f"{', ' if index else ''}({name!r}, ".encode())
            self._feed_table(hasher, name)
            hasher.update(b")")
        hasher.update(b",)" if len(names) == 1 else b")")
        return hasher.hexdigest()

    def json_hash(self) -> str:
        """SHA-256 of ``json.dumps(self.tables, sort_keys=True, default=str)`` (tau2's hash),
        fed piece by piece; only the records this episode wrote are rendered."""
        hasher = hashlib.sha256(b"{")
        for index, name in enumerate(sorted(self.tables)):
            hasher.update(f"{', ' if index else ''}{json.dumps(name)}: {{".encode())
            table, dirty = self.tables[name], self._dirty[name]
            cache = self.pristine.json_texts(name)
            same_keys = len(table) == len(cache.sorted_keys) and all(
                k in cache.texts for k in dirty
            )
            keys = cache.sorted_keys if same_keys else sorted(table)
            hasher.update(
                b", ".join(
                    json.dumps(k).encode()
                    + b": "
                    + (_json_text(table[k]).encode() if k in dirty else cache.texts[k])
                    for k in keys
                )
            )
            hasher.update(b"}")
        hasher.update(b"}")
        return hasher.hexdigest()

    def _feed_table(self, hasher: Any, name: str) -> None:
        table = self.tables[name]
        cache = self.pristine.table_cache(name)
        dirty = self._dirty[name]
        if not dirty:
            keys = cache.sorted_keys
        elif len(table) == len(cache.sorted_keys) and all(k in cache.texts for k in dirty):
            keys = cache.sorted_keys  # only existing records changed: the key order holds
        else:
            keys = sorted(table)
        texts = cache.texts
        parts = [_entry_text(k, table[k]) if k in dirty else texts[k] for k in keys]
        if len(parts) == 1:  # Python writes a 1-tuple with a trailing comma
            hasher.update(b"(" + parts[0] + b",)")
        else:
            hasher.update(b"(")
            hasher.update(b", ".join(parts))
            hasher.update(b")")
