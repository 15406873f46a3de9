"""tau2-bench's airline domain: 14 agent tools on flights, reservations and users.

The tools follow tau2's airline toolkit step by step, so that results, error texts and
the database after every call (including what an error leaves half done) are the ones
upstream gives. Upstream keeps the database as pydantic models; here every record is a
plain dict in the shape of that model's ``model_dump`` (fields in model order, optional
fields present as ``None``, balances as floats), held in a copy-on-write
:class:`~turnrl.tool_envs.tau.db.Database`: an episode copies only the records it writes.

Where upstream builds a pydantic model from the model's arguments (``FlightInfo``,
``Passenger``, ``Payment``, ``Reservation``, ``Certificate``), the same checks run here
and fail with pydantic's message layout (see :class:`_Check`); where upstream assigns a
raw argument to a model without checking it, the raw value is stored here as well.

Fixed rules of upstream: new reservations take the first free id of ``HATHAT``,
``HATHAU``, ``HATHAV``; new certificates the first free id of ``certificate_3221322`` ..
``certificate_3221324``; "now" is always ``2024-05-15T15:00:00``. Booking takes the seats
off the flights; changing flights and cancelling give no seats back (as upstream).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from turnrl.tool_envs.tau.calculate import calculate as _calculate
from turnrl.tool_envs.tau.db import Database, DataError, PristineData, copy_record, load_table
from turnrl.tool_envs.tau.tau2.domain import Tau2Domain
from turnrl.tool_envs.tau.tau2.toolkit import Model, ToolKind, Toolkit, deep_merge, tool

TABLES = ("flights", "users", "reservations")
"""The database's tables, in upstream's ``FlightDB`` field order."""
RESERVATION_IDS = ("HATHAT", "HATHAU", "HATHAV")
"""Ids given to new reservations, first free one first (so at most three per episode)."""
CERTIFICATE_IDS = ("certificate_3221322", "certificate_3221323", "certificate_3221324")
"""Ids given to certificates sent to a user, first free one first."""
NOW = "2024-05-15T15:00:00"
"""The airline's fixed current time (a new reservation's ``created_at``)."""
CABINS = ("business", "economy", "basic_economy")
FLIGHT_TYPES = ("round_trip", "one_way")
INSURANCE = ("yes", "no")
AIRPORTS = (
    ("SFO", "San Francisco"),
    ("JFK", "New York"),
    ("LAX", "Los Angeles"),
    ("ORD", "Chicago"),
    ("DFW", "Dallas"),
    ("DEN", "Denver"),
    ("SEA", "Seattle"),
    ("ATL", "Atlanta"),
    ("MIA", "Miami"),
    ("BOS", "Boston"),
    ("PHX", "Phoenix"),
    ("IAH", "Houston"),
    ("LAS", "Las Vegas"),
    ("MCO", "Orlando"),
    ("EWR", "Newark"),
    ("CLT", "Charlotte"),
    ("MSP", "Minneapolis"),
    ("DTW", "Detroit"),
    ("PHL", "Philadelphia"),
    ("LGA", "LaGuardia"),
)
"""The airports ``list_all_airports`` names, as ``(IATA code, city)`` in upstream's order."""
_CALC_CHARS = "0123456789+-*/(). "
PYDANTIC_DOCS = "2.14"
"""The pydantic version named in the help links of validation errors (upstream's env has 2.14)."""


# --- pydantic-style argument checks ---------------------------------------------------------


class _Check:
    """Collects the problems of one model construction and raises them as pydantic does.

    Upstream builds pydantic models from the arguments; their ``ValidationError`` text is
    ``"<n> validation error(s) for <Model>"`` followed by, per problem, the field path, the
    message with its type and input, and a help link. Values are coerced as pydantic's lax
    mode does (``"2"`` or ``2.0`` for an integer, an integer for a float).
    """

    def __init__(self) -> None:
        self.errors: list[tuple[tuple[Any, ...], str, str, Any]] = []

    def fail(self, loc: tuple[Any, ...], kind: str, message: str, value: Any) -> None:
        self.errors.append((loc, kind, message, value))

    def raise_if_failed(self, title: str) -> None:
        if not self.errors:
            return
        count = len(self.errors)
        lines = [f"{count} validation error{'s' if count > 1 else ''} for {title}"]
        for loc, kind, message, value in self.errors:
            lines.append(".".join(str(part) for part in loc))
            lines.append(
                f"  {message} [type={kind}, input_value={_short_repr(value)}, "
                f"input_type={type(value).__name__}]"
            )
            lines.append(
                f"    For further information visit https://errors.pydantic.dev/{PYDANTIC_DOCS}/v/{kind}"
            )
        raise ValueError("\n".join(lines))


def _short_repr(value: Any) -> str:
    """``repr`` cut in the middle past 50 characters, as pydantic shows an input."""
    text = repr(value)
    return text if len(text) <= 50 else f"{text[:25]}...{text[-24:]}"


def _str(check: _Check, loc: tuple[Any, ...], value: Any) -> Any:
    if not isinstance(value, str):
        check.fail(loc, "string_type", "Input should be a valid string", value)
    return value


def _int(check: _Check, loc: tuple[Any, ...], value: Any) -> Any:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            check.fail(loc, "finite_number", "Input should be a finite number", value)
        elif value.is_integer():
            return int(value)
        else:
            message = "Input should be a valid integer, got a number with a fractional part"
            check.fail(loc, "int_from_float", message, value)
        return value
    if isinstance(value, str):
        text = value.strip()
        try:
            return int(text)
        except ValueError:
            head, dot, tail = text.partition(".")
            if dot and tail.strip("0") == "" and head.lstrip("+-").isdigit():
                return int(head)
        message = "Input should be a valid integer, unable to parse string as an integer"
        check.fail(loc, "int_parsing", message, value)
        return value
    check.fail(loc, "int_type", "Input should be a valid integer", value)
    return value


def _float(check: _Check, loc: tuple[Any, ...], value: Any) -> Any:
    if isinstance(value, bool | int | float):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            message = "Input should be a valid number, unable to parse string as a number"
            check.fail(loc, "float_parsing", message, value)
            return value
    check.fail(loc, "float_type", "Input should be a valid number", value)
    return value


def _literal(options: Sequence[str]) -> Callable[[_Check, tuple[Any, ...], Any], Any]:
    quoted = [f"'{option}'" for option in options]
    expected = ", ".join(quoted[:-1]) + f" or {quoted[-1]}"

    def check_literal(check: _Check, loc: tuple[Any, ...], value: Any) -> Any:
        if not (isinstance(value, str) and value in options):
            check.fail(loc, "literal_error", f"Input should be {expected}", value)
        return value

    return check_literal


_FieldCheck = Callable[[_Check, tuple[Any, ...], Any], Any]
_FLIGHT_INFO: tuple[str, dict[str, _FieldCheck]] = (
    "FlightInfo",
    {"flight_number": _str, "date": _str},
)
_PASSENGER: tuple[str, dict[str, _FieldCheck]] = (
    "Passenger",
    {"first_name": _str, "last_name": _str, "dob": _str},
)
_PAYMENT: tuple[str, dict[str, _FieldCheck]] = ("Payment", {"payment_id": _str, "amount": _int})


def _fields(
    check: _Check,
    loc: tuple[Any, ...],
    model: tuple[str, dict[str, _FieldCheck]],
    data: dict[str, Any],
) -> dict[str, Any]:
    """Check ``data`` against a flat model; the result keeps only its fields, in its order."""
    out = {}
    for name, field_check in model[1].items():
        if name not in data:
            check.fail((*loc, name), "missing", "Field required", data)
        else:
            out[name] = field_check(check, (*loc, name), data[name])
    return out


def _build(model: tuple[str, dict[str, _FieldCheck]], data: dict[str, Any]) -> dict[str, Any]:
    """Upstream's ``Model(**data)``: the model's record, or a validation error."""
    check = _Check()
    record = _fields(check, (), model, data)
    check.raise_if_failed(model[0])
    return record


def _nested_list(
    check: _Check, loc: tuple[Any, ...], model: tuple[str, dict[str, _FieldCheck]], value: Any
) -> Any:
    """A list-of-model field of an enclosing model (dict items are checked field by field)."""
    if not isinstance(value, list):
        check.fail(loc, "list_type", "Input should be a valid list", value)
        return value
    out = []
    for index, item in enumerate(value):
        if isinstance(item, dict):
            out.append(_fields(check, (*loc, index), model, item))
        else:
            message = f"Input should be a valid dictionary or instance of {model[0]}"
            check.fail((*loc, index), "model_type", message, item)
    return out


class _Raw:
    """A list argument upstream leaves unconverted because not all of its items are objects."""

    def __init__(self, value: Any) -> None:
        self.value = value


def _convert(items: Any, model: tuple[str, dict[str, _FieldCheck]]) -> list[dict[str, Any]] | _Raw:
    """Upstream's ``if all(isinstance(x, dict) for x in items): items = [Model(**x) ...]``."""
    if all(isinstance(item, dict) for item in items):
        return [_build(model, item) for item in items]
    return _Raw(items)


def _attribute_error(raw: _Raw, name: str) -> AttributeError:
    """What upstream raises reading ``.name`` of the first item of an unconverted list."""
    first = next(iter(raw.value))
    return AttributeError(f"'{type(first).__name__}' object has no attribute '{name}'")


# --- record shapes (upstream's model_dump) --------------------------------------------------

_REQUIRED = object()
_Shape = tuple[tuple[str, Any, Callable[[Any], Any] | None], ...]


def _shaped(record: dict[str, Any], shape: _Shape, where: str) -> dict[str, Any]:
    """``record`` with the fields of ``shape`` in its order, defaults filled, values converted."""
    out = {}
    for name, default, convert in shape:
        if name in record:
            value = record[name]
            out[name] = convert(value) if convert is not None else value
        elif default is _REQUIRED:
            raise DataError(f"{where}: field {name!r} is missing")
        else:
            out[name] = default
    return out


def _each(shape: _Shape, where: str) -> Callable[[Any], Any]:
    return lambda items: [_shaped(item, shape, where) for item in items]


_NAME: _Shape = (("first_name", _REQUIRED, None), ("last_name", _REQUIRED, None))
_ADDRESS: _Shape = (
    ("address1", _REQUIRED, None),
    ("address2", None, None),
    ("city", _REQUIRED, None),
    ("country", _REQUIRED, None),
    ("state", _REQUIRED, None),
    ("zip", _REQUIRED, None),
)
_PERSON: _Shape = (
    ("first_name", _REQUIRED, None),
    ("last_name", _REQUIRED, None),
    ("dob", _REQUIRED, None),
)
_PAID: _Shape = (("payment_id", _REQUIRED, None), ("amount", _REQUIRED, None))
_LEG: _Shape = (
    ("flight_number", _REQUIRED, None),
    ("origin", _REQUIRED, None),
    ("destination", _REQUIRED, None),
    ("date", _REQUIRED, None),
    ("price", _REQUIRED, None),
)
_METHODS: dict[str, _Shape] = {
    "credit_card": (
        ("source", _REQUIRED, None),
        ("id", _REQUIRED, None),
        ("brand", _REQUIRED, None),
        ("last_four", _REQUIRED, None),
    ),
    "gift_card": (
        ("source", _REQUIRED, None),
        ("id", _REQUIRED, None),
        ("amount", _REQUIRED, float),
    ),
    "certificate": (
        ("source", _REQUIRED, None),
        ("id", _REQUIRED, None),
        ("amount", _REQUIRED, float),
    ),
}
_DAYS: dict[str, tuple[str, ...]] = {
    "available": ("status", "available_seats", "prices"),
    "on time": ("status", "estimated_departure_time_est", "estimated_arrival_time_est"),
    "flying": ("status", "actual_departure_time_est", "estimated_arrival_time_est"),
    "landed": ("status", "actual_departure_time_est", "actual_arrival_time_est"),
    "cancelled": ("status",),
    "delayed": ("status", "estimated_departure_time_est", "estimated_arrival_time_est"),
}


def _methods(methods: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for key, method in methods.items():
        shape = _METHODS.get(method.get("source"))
        if shape is None:
            raise DataError(f"payment method {key!r}: unknown source {method.get('source')!r}")
        out[key] = _shaped(method, shape, f"payment method {key!r}")
    return out


def _days(days: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for day, status in days.items():
        fields = _DAYS.get(status.get("status"))
        if fields is None:
            raise DataError(f"flight date {day!r}: unknown status {status.get('status')!r}")
        out[day] = _shaped(
            status, tuple((name, _REQUIRED, None) for name in fields), f"flight date {day!r}"
        )
    return out


_SHAPES: dict[str, _Shape] = {
    "flights": (
        ("flight_number", _REQUIRED, None),
        ("origin", _REQUIRED, None),
        ("destination", _REQUIRED, None),
        ("scheduled_departure_time_est", _REQUIRED, None),
        ("scheduled_arrival_time_est", _REQUIRED, None),
        ("dates", _REQUIRED, _days),
    ),
    "users": (
        ("user_id", _REQUIRED, None),
        ("name", _REQUIRED, lambda name: _shaped(name, _NAME, "name")),
        ("address", _REQUIRED, lambda address: _shaped(address, _ADDRESS, "address")),
        ("email", _REQUIRED, None),
        ("dob", _REQUIRED, None),
        ("payment_methods", _REQUIRED, _methods),
        ("saved_passengers", _REQUIRED, _each(_PERSON, "saved passenger")),
        ("membership", _REQUIRED, None),
        ("reservations", _REQUIRED, None),
    ),
    "reservations": (
        ("reservation_id", _REQUIRED, None),
        ("user_id", _REQUIRED, None),
        ("origin", _REQUIRED, None),
        ("destination", _REQUIRED, None),
        ("flight_type", _REQUIRED, None),
        ("cabin", _REQUIRED, None),
        ("flights", _REQUIRED, _each(_LEG, "reservation flight")),
        ("passengers", _REQUIRED, _each(_PERSON, "passenger")),
        ("payment_history", _REQUIRED, _each(_PAID, "payment")),
        ("created_at", _REQUIRED, None),
        ("total_baggages", _REQUIRED, None),
        ("nonfree_baggages", _REQUIRED, None),
        ("insurance", _REQUIRED, None),
        ("status", None, None),
    ),
}


def normalize_record(table: str, key: str, record: Any) -> dict[str, Any]:
    """One record of ``table`` in upstream's ``model_dump`` form (a new dict)."""
    if not isinstance(record, dict):
        raise DataError(f"{table}[{key!r}] must be an object, got {type(record).__name__}")
    try:
        return _shaped(record, _SHAPES[table], f"{table}[{key!r}]")
    except (AttributeError, TypeError) as exc:
        raise DataError(f"{table}[{key!r}] is malformed: {exc}") from exc


def load_pristine(db_file: Path) -> PristineData:
    """Parse ``db.json`` (one object holding the three tables) into normalised pristine data."""
    raw = load_table(db_file)
    tables: dict[str, dict[str, Any]] = {}
    for name in TABLES:
        if name not in raw:
            raise DataError(f"{db_file} has no table {name!r}")
        tables[name] = {key: normalize_record(name, key, rec) for key, rec in raw[name].items()}
    extra = sorted(set(raw) - set(TABLES))
    if extra:
        raise DataError(f"{db_file} has unknown tables {extra}")
    return PristineData(tables)


# --- tool descriptions ----------------------------------------------------------------------


def _obj(properties: dict[str, Any], required: Sequence[str] | None = None) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(required or properties)}


def _text(description: str) -> dict[str, Any]:
    return {"type": "string", "description": description}


_RESERVATION_ID = _text("Reservation id, e.g. 'ZFA04Y'.")
_PAYMENT_ID = _text(
    "Id of a payment method saved in the user's profile, e.g. 'credit_card_7815826', "
    "'gift_card_7815826' or 'certificate_7815826'."
)
_CABIN = {"type": "string", "enum": list(CABINS), "description": "Cabin class."}
_FLIGHT_ITEM = _obj(
    {
        "flight_number": _text("Flight number, e.g. 'HAT001'."),
        "date": _text("Date of the flight as 'YYYY-MM-DD', e.g. '2024-05-01'."),
    }
)
_PASSENGER_ITEM = _obj(
    {
        "first_name": _text("First name."),
        "last_name": _text("Last name."),
        "dob": _text("Date of birth as 'YYYY-MM-DD'."),
    }
)
_PAYMENT_ITEM = _obj(
    {
        "payment_id": _text("Id of a payment method saved in the user's profile."),
        "amount": {"type": "integer", "description": "Amount in dollars charged to it."},
    }
)
_ROUTE = {
    "origin": _text("Origin airport, three-letter IATA code such as 'JFK'."),
    "destination": _text("Destination airport, three-letter IATA code such as 'LAX'."),
    "date": _text("Travel date as 'YYYY-MM-DD', e.g. '2024-05-01'."),
}


# --- the toolkit ----------------------------------------------------------------------------


class AirlineTools(Toolkit):
    """The airline agent's tools on one episode's database."""

    side = "assistant"

    def __init__(self, db: Database) -> None:
        """Act on ``db``, a copy-on-write database of the tables in :data:`TABLES`."""
        self.db = db

    def state(self) -> dict[str, dict[str, Any]]:
        """The tables (``flights``, ``users``, ``reservations``) as upstream's ``model_dump``."""
        return self.db.tables

    def db_hash(self) -> str:
        """tau2's hash of the tables, rendering only the records this episode wrote."""
        return self.db.json_hash()

    def update_db(self, data: dict[str, Any]) -> None:
        """Deep-merge ``data`` into the tables; only the records it touches are copied."""
        unknown = sorted(set(data) - set(TABLES))
        if unknown:
            raise ValueError(f"unknown airline tables {unknown}")
        for table, records in data.items():
            for key, value in records.items():
                existing = self.db.tables[table].get(key)
                if isinstance(existing, dict) and isinstance(value, dict):
                    record = self.db.mutable(table, key)
                    deep_merge(record, copy_record(value))
                    merged = normalize_record(table, key, record)
                    record.clear()
                    record.update(merged)
                else:
                    self.db.put(table, key, normalize_record(table, key, copy_record(value)))

    # --- lookups (upstream's error texts) ---

    def _user(self, user_id: Any) -> dict[str, Any]:
        users = self.db.tables["users"]
        if user_id not in users:
            raise ValueError(f"User {user_id} not found")
        return users[user_id]

    def _reservation(self, reservation_id: Any) -> dict[str, Any]:
        reservations = self.db.tables["reservations"]
        if reservation_id not in reservations:
            raise ValueError(f"Reservation {reservation_id} not found")
        return reservations[reservation_id]

    def _flight(self, flight_number: Any) -> dict[str, Any]:
        flights = self.db.tables["flights"]
        if flight_number not in flights:
            raise ValueError(f"Flight {flight_number} not found")
        return flights[flight_number]

    def _flight_day(self, flight_number: Any, date: Any) -> dict[str, Any]:
        flight = self._flight(flight_number)
        if date not in flight["dates"]:
            raise ValueError(f"Flight {flight_number} not found on date {date}")
        day: dict[str, Any] = flight["dates"][date]
        return day

    def _direct_flights(
        self, date: Any, origin: Any = None, destination: Any = None, leave_after: Any = None
    ) -> list[dict[str, Any]]:
        """Flights available on ``date``, optionally from/to an airport and leaving after a time."""
        found = []
        for flight in self.db.tables["flights"].values():
            if (
                (origin is None or flight["origin"] == origin)
                and (destination is None or flight["destination"] == destination)
                and date in flight["dates"]
                and flight["dates"][date]["status"] == "available"
                and (leave_after is None or flight["scheduled_departure_time_est"] >= leave_after)
            ):
                day = flight["dates"][date]
                found.append(
                    {
                        "flight_number": flight["flight_number"],
                        "origin": flight["origin"],
                        "destination": flight["destination"],
                        "status": "available",
                        "scheduled_departure_time_est": flight["scheduled_departure_time_est"],
                        "scheduled_arrival_time_est": flight["scheduled_arrival_time_est"],
                        "date": None,
                        "available_seats": dict(day["available_seats"]),
                        "prices": dict(day["prices"]),
                    }
                )
        return found

    def _charge_for_update(
        self, user_id: str, payment_id: Any, total_price: Any
    ) -> dict[str, Any] | None:
        """Check and charge ``payment_id`` for a change; the payment record, or ``None`` if free."""
        methods = self.db.tables["users"][user_id]["payment_methods"]
        if payment_id not in methods:
            raise ValueError("Payment method not found")
        method = methods[payment_id]
        if method["source"] == "certificate":
            raise ValueError("Certificate cannot be used to update reservation")
        if method["source"] == "gift_card" and method["amount"] < total_price:
            raise ValueError("Gift card balance is not enough")
        if method["source"] == "gift_card":
            user = self.db.mutable("users", user_id)
            user["payment_methods"][payment_id]["amount"] -= total_price
        if total_price == 0:
            return None
        return _build(_PAYMENT, {"payment_id": payment_id, "amount": total_price})

    # --- tools ---

    @tool(
        ToolKind.WRITE,
        "Book a new reservation for a user: the flights, passengers and payment split are "
        "given in full; the payments must add up to the total price (flight prices per "
        "passenger, insurance and paid bags).",
        _obj(
            {
                "user_id": _text("Id of the user making the booking, e.g. 'sara_doe_496'."),
                "origin": _text("IATA code of the trip's origin city, e.g. 'SFO'."),
                "destination": _text("IATA code of the trip's destination city, e.g. 'JFK'."),
                "flight_type": {
                    "type": "string",
                    "enum": list(FLIGHT_TYPES),
                    "description": "Trip type.",
                },
                "cabin": _CABIN,
                "flights": {
                    "type": "array",
                    "items": _FLIGHT_ITEM,
                    "description": "Every flight segment to book.",
                },
                "passengers": {
                    "type": "array",
                    "items": _PASSENGER_ITEM,
                    "description": "Every passenger travelling.",
                },
                "payment_methods": {
                    "type": "array",
                    "items": _PAYMENT_ITEM,
                    "description": "How the total is paid: payment methods and the amount each pays.",
                },
                "total_baggages": {
                    "type": "integer",
                    "description": "Total number of checked bags.",
                },
                "nonfree_baggages": {
                    "type": "integer",
                    "description": "How many of those bags are paid.",
                },
                "insurance": {
                    "type": "string",
                    "enum": list(INSURANCE),
                    "description": "Whether travel insurance is bought.",
                },
            }
        ),
    )
    def book_reservation(
        self,
        user_id: Any,
        origin: Any,
        destination: Any,
        flight_type: Any,
        cabin: Any,
        flights: Any,
        passengers: Any,
        payment_methods: Any,
        total_baggages: Any,
        nonfree_baggages: Any,
        insurance: Any,
    ) -> Model:
        """Book a reservation; returns it."""
        legs = _convert(flights, _FLIGHT_INFO)
        people = _convert(passengers, _PASSENGER)
        payments = _convert(payment_methods, _PAYMENT)
        user = self._user(user_id)
        reservations = self.db.tables["reservations"]
        reservation_id = next((rid for rid in RESERVATION_IDS if rid not in reservations), None)
        if reservation_id is None:
            raise ValueError("Too many reservations")
        reservation = self._new_reservation(
            reservation_id,
            user_id,
            origin,
            destination,
            flight_type,
            cabin,
            people,
            payments,
            total_baggages,
            nonfree_baggages,
            insurance,
        )
        if isinstance(legs, _Raw):
            raise _attribute_error(legs, "flight_number")
        count = len(people.value) if isinstance(people, _Raw) else len(people)
        total_price: Any = 0
        booked: list[tuple[str, str]] = []
        for leg in legs:
            number = leg["flight_number"]
            flight = self._flight(number)
            day = self._flight_day(number, leg["date"])
            if day["status"] != "available":
                raise ValueError(f"Flight {number} not available on date {leg['date']}")
            if day["available_seats"][cabin] < count:
                raise ValueError(f"Not enough seats on flight {number}")
            price = day["prices"][cabin]
            reservation["flights"].append(
                {
                    "flight_number": number,
                    "origin": flight["origin"],
                    "destination": flight["destination"],
                    "date": leg["date"],
                    "price": price,
                }
            )
            booked.append((number, leg["date"]))
            total_price += price * count
        if insurance == "yes":
            total_price += 30 * count
        total_price += 50 * nonfree_baggages
        paid = reservation["payment_history"]
        methods = user["payment_methods"]
        for payment in paid:
            payment_id, amount = payment["payment_id"], payment["amount"]
            if payment_id not in methods:
                raise ValueError(f"Payment method {payment_id} not found")
            method = methods[payment_id]
            if method["source"] in {"gift_card", "certificate"} and method["amount"] < amount:
                raise ValueError(f"Not enough balance in payment method {payment_id}")
        total_payment = sum(payment["amount"] for payment in paid)
        if total_payment != total_price:
            raise ValueError(
                f"Payment amount does not add up, total price is {total_price}, but paid {total_payment}"
            )
        for payment in paid:
            user = self.db.mutable("users", user_id)
            method = user["payment_methods"][payment["payment_id"]]
            if method["source"] == "gift_card":
                method["amount"] -= payment["amount"]
            elif method["source"] == "certificate":
                user["payment_methods"].pop(payment["payment_id"])
        for number, date in booked:
            seats = self.db.mutable("flights", number)["dates"][date]["available_seats"]
            seats[cabin] -= count
        self.db.put("reservations", reservation_id, reservation)
        self.db.mutable("users", user_id)["reservations"].append(reservation_id)
        return Model(copy_record(reservation))

    @staticmethod
    def _new_reservation(
        reservation_id: str,
        user_id: Any,
        origin: Any,
        destination: Any,
        flight_type: Any,
        cabin: Any,
        people: list[dict[str, Any]] | _Raw,
        payments: list[dict[str, Any]] | _Raw,
        total_baggages: Any,
        nonfree_baggages: Any,
        insurance: Any,
    ) -> dict[str, Any]:
        """Upstream's ``Reservation(...)`` of a booking, before its flights are added."""
        check = _Check()
        passengers = people.value if isinstance(people, _Raw) else people
        history = payments.value if isinstance(payments, _Raw) else payments
        record = {
            "reservation_id": reservation_id,
            "user_id": _str(check, ("user_id",), user_id),
            "origin": _str(check, ("origin",), origin),
            "destination": _str(check, ("destination",), destination),
            "flight_type": _literal(FLIGHT_TYPES)(check, ("flight_type",), flight_type),
            "cabin": _literal(CABINS)(check, ("cabin",), cabin),
            "flights": [],
            "passengers": _nested_list(check, ("passengers",), _PASSENGER, copy_record(passengers)),
            "payment_history": _nested_list(
                check, ("payment_history",), _PAYMENT, copy_record(history)
            ),
            "created_at": NOW,
            "total_baggages": _int(check, ("total_baggages",), total_baggages),
            "nonfree_baggages": _int(check, ("nonfree_baggages",), nonfree_baggages),
            "insurance": _literal(INSURANCE)(check, ("insurance",), insurance),
            "status": None,
        }
        check.raise_if_failed("Reservation")
        return record

    @tool(
        ToolKind.GENERIC,
        "Evaluate an arithmetic expression made of numbers, + - * /, parentheses and spaces, "
        "e.g. '2 + 2'; the result is rounded to two decimals.",
        _obj({"expression": _text("The expression to evaluate, e.g. '(120 + 80) * 2'.")}),
    )
    def calculate(self, expression: Any) -> str:
        """The value of ``expression`` rounded to two decimals, as text."""
        if not isinstance(expression, str):  # upstream checks each item, then eval refuses it
            if not all(char in _CALC_CHARS for char in expression):
                raise ValueError("Invalid characters in expression")
            raise TypeError("eval() arg 1 must be a string, bytes or code object")
        result = _calculate(expression)
        if result.startswith("Error: "):
            reason = result[len("Error: ") :]
            if reason == "invalid characters in expression":
                reason = "Invalid characters in expression"
            raise ValueError(reason)
        return result

    @tool(
        ToolKind.WRITE,
        "Cancel a whole reservation: every payment made for it is refunded to the method "
        "that paid it.",
        _obj({"reservation_id": _RESERVATION_ID}),
    )
    def cancel_reservation(self, reservation_id: Any) -> Model:
        """Cancel a reservation and refund its payments; returns it."""
        self._reservation(reservation_id)
        reservation = self.db.mutable("reservations", reservation_id)
        history = reservation["payment_history"]
        refunds = [
            {"payment_id": paid["payment_id"], "amount": -paid["amount"]} for paid in history
        ]
        history.extend(refunds)
        reservation["status"] = "cancelled"
        return Model(copy_record(reservation))

    @tool(
        ToolKind.READ,
        "Look up a reservation: its flights, passengers, payments, bags, insurance and status.",
        _obj({"reservation_id": _text("Reservation id, e.g. '8JX2WO'.")}),
    )
    def get_reservation_details(self, reservation_id: Any) -> Model:
        """The reservation's record."""
        return Model(copy_record(self._reservation(reservation_id)))

    @tool(
        ToolKind.READ,
        "Look up a user's profile: name, address, contact, membership, saved payment methods "
        "and passengers, and the ids of their reservations.",
        _obj({"user_id": _text("User id, e.g. 'sara_doe_496'.")}),
    )
    def get_user_details(self, user_id: Any) -> Model:
        """The user's record."""
        return Model(copy_record(self._user(user_id)))

    @tool(ToolKind.READ, "List every airport served, with its IATA code and city.")
    def list_all_airports(self) -> list[Model]:
        """The served airports as ``{"iata", "city"}`` objects."""
        return [Model(iata=code, city=city) for code, city in AIRPORTS]

    @tool(
        ToolKind.READ,
        "Find the direct flights from one airport to another that can be booked on a date, "
        "with their schedule, free seats and prices per cabin.",
        _obj(_ROUTE),
    )
    def search_direct_flight(self, origin: Any, destination: Any, date: Any) -> list[Model]:
        """Bookable direct flights of the route on ``date``."""
        return [Model(found) for found in self._direct_flights(date, origin, destination)]

    @tool(
        ToolKind.READ,
        "Find connections with one stop from one airport to another starting on a date: "
        "pairs of bookable flights where the second leaves after the first arrives.",
        _obj(_ROUTE),
    )
    def search_onestop_flight(self, origin: Any, destination: Any, date: Any) -> list[list[Model]]:
        """Pairs ``[first leg, second leg]``, each leg with its ``date`` set."""
        pairs = []
        for first in self._direct_flights(date, origin, None):
            first["date"] = date
            arrival = first["scheduled_arrival_time_est"]
            # upstream's rule for an arrival on the next day (the day is not zero-padded)
            next_date = f"2024-05-{int(date[-2:]) + 1}" if "+1" in arrival else date
            for second in self._direct_flights(
                next_date, first["destination"], destination, arrival
            ):
                second["date"] = next_date
                pairs.append([Model(first), Model(second)])
        return pairs

    @tool(
        ToolKind.WRITE,
        "Give a user a travel certificate worth the given amount (added to their payment "
        "methods). Use with care.",
        _obj(
            {
                "user_id": _text("Id of the user receiving it, e.g. 'sara_doe_496'."),
                "amount": {
                    "type": "integer",
                    "description": "Value of the certificate in dollars.",
                },
            }
        ),
    )
    def send_certificate(self, user_id: Any, amount: Any) -> str:
        """Add a certificate to the user's payment methods; returns a confirmation."""
        methods = self._user(user_id)["payment_methods"]
        for payment_id in CERTIFICATE_IDS:
            if payment_id not in methods:
                check = _Check()
                value = _float(check, ("amount",), amount)
                check.raise_if_failed("Certificate")
                user = self.db.mutable("users", user_id)
                user["payment_methods"][payment_id] = {
                    "source": "certificate",
                    "id": payment_id,
                    "amount": value,
                }
                return f"Certificate {payment_id} added to user {user_id} with amount {amount}."
        raise ValueError("Too many certificates")

    @tool(
        ToolKind.GENERIC,
        "Hand the conversation over to a human agent, with a summary of the user's issue. "
        "Only when the user asks for a human, or when the policy and tools cannot resolve it.",
        _obj({"summary": _text("Summary of the user's issue.")}),
    )
    def transfer_to_human_agents(self, summary: Any) -> str:
        """Confirm the hand-over (changes nothing)."""
        return "Transfer successful"

    @tool(
        ToolKind.WRITE,
        "Change the number of checked bags of a reservation; newly added paid bags are "
        "charged to a saved payment method (not a certificate).",
        _obj(
            {
                "reservation_id": _RESERVATION_ID,
                "total_baggages": {
                    "type": "integer",
                    "description": "New total number of checked bags.",
                },
                "nonfree_baggages": {"type": "integer", "description": "New number of paid bags."},
                "payment_id": _PAYMENT_ID,
            }
        ),
    )
    def update_reservation_baggages(
        self, reservation_id: Any, total_baggages: Any, nonfree_baggages: Any, payment_id: Any
    ) -> Model:
        """Set the bag counts, charging for added paid bags; returns the reservation."""
        reservation = self._reservation(reservation_id)
        user_id = reservation["user_id"]
        self._user(user_id)
        total_price = 50 * max(0, nonfree_baggages - reservation["nonfree_baggages"])
        payment = self._charge_for_update(user_id, payment_id, total_price)
        reservation = self.db.mutable("reservations", reservation_id)
        if payment is not None:
            reservation["payment_history"].append(payment)
        reservation["total_baggages"] = total_baggages
        reservation["nonfree_baggages"] = nonfree_baggages
        return Model(copy_record(reservation))

    @tool(
        ToolKind.WRITE,
        "Replace the flights (and cabin) of a reservation. List every segment of the whole "
        "new itinerary, unchanged ones too; the price difference is charged to (or refunded "
        "on) a saved payment method (not a certificate).",
        _obj(
            {
                "reservation_id": _RESERVATION_ID,
                "cabin": _CABIN,
                "flights": {
                    "type": "array",
                    "items": _FLIGHT_ITEM,
                    "description": "Every flight segment of the new itinerary, including unchanged ones.",
                },
                "payment_id": _PAYMENT_ID,
            }
        ),
    )
    def update_reservation_flights(
        self, reservation_id: Any, cabin: Any, flights: Any, payment_id: Any
    ) -> Model:
        """Replace the reservation's flights and cabin, settling the price; returns it."""
        legs = _convert(flights, _FLIGHT_INFO)
        reservation = self._reservation(reservation_id)
        user_id = reservation["user_id"]
        self._user(user_id)
        if isinstance(legs, _Raw):
            raise _attribute_error(legs, "flight_number")
        count = len(reservation["passengers"])
        total_price: Any = 0
        new_flights = []
        for leg in legs:
            kept = next(
                (
                    old
                    for old in reservation["flights"]
                    if old["flight_number"] == leg["flight_number"]
                    and old["date"] == leg["date"]
                    and cabin == reservation["cabin"]
                ),
                None,
            )
            if kept is not None:
                total_price += kept["price"] * count
                new_flights.append(copy_record(kept))
                continue
            flight = self._flight(leg["flight_number"])
            day = self._flight_day(leg["flight_number"], leg["date"])
            if day["status"] != "available":
                raise ValueError(
                    f"Flight {leg['flight_number']} not available on date {leg['date']}"
                )
            if day["available_seats"][cabin] < count:
                raise ValueError(f"Not enough seats on flight {leg['flight_number']}")
            new_leg = {
                "flight_number": leg["flight_number"],
                "origin": flight["origin"],
                "destination": flight["destination"],
                "date": leg["date"],
                "price": day["prices"][cabin],
            }
            total_price += new_leg["price"] * count
            new_flights.append(new_leg)
        total_price -= sum(old["price"] for old in reservation["flights"]) * count
        payment = self._charge_for_update(user_id, payment_id, total_price)
        reservation = self.db.mutable("reservations", reservation_id)
        if payment is not None:
            reservation["payment_history"].append(payment)
        reservation["flights"] = new_flights
        reservation["cabin"] = cabin
        return Model(copy_record(reservation))

    @tool(
        ToolKind.WRITE,
        "Replace the passenger details of a reservation; the number of passengers cannot change.",
        _obj(
            {
                "reservation_id": _RESERVATION_ID,
                "passengers": {
                    "type": "array",
                    "items": _PASSENGER_ITEM,
                    "description": "Every passenger of the reservation, with the new details.",
                },
            }
        ),
    )
    def update_reservation_passengers(self, reservation_id: Any, passengers: Any) -> Model:
        """Replace the passengers (same count); returns the reservation."""
        people = _convert(passengers, _PASSENGER)
        new_people = people.value if isinstance(people, _Raw) else people
        reservation = self._reservation(reservation_id)
        if len(new_people) != len(reservation["passengers"]):
            raise ValueError("Number of passengers does not match")
        reservation = self.db.mutable("reservations", reservation_id)
        reservation["passengers"] = copy_record(new_people)
        return Model(copy_record(reservation))

    @tool(
        ToolKind.READ,
        "The status of a flight on a date (available, on time, delayed, flying, landed or cancelled).",
        _obj(
            {
                "flight_number": _text("Flight number, e.g. 'HAT001'."),
                "date": _text("Date as 'YYYY-MM-DD'."),
            }
        ),
    )
    def get_flight_status(self, flight_number: Any, date: Any) -> Any:
        """The flight's status word on ``date``."""
        return self._flight_day(flight_number, date)["status"]


def load(data_dir: Path) -> Tau2Domain:
    """The airline domain of ``data_dir`` (``db.json``, ``policy.md``); the data is parsed once."""
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise DataError(f"data folder {data_dir} does not exist")
    policy_file = data_dir / "policy.md"
    if not policy_file.is_file():
        raise DataError(f"missing policy file {policy_file}")
    policy = policy_file.read_text(encoding="utf-8")
    pristine = load_pristine(data_dir / "db.json")
    return Tau2Domain(
        name="airline", policy=policy, new_tools=lambda: AirlineTools(pristine.new_database())
    )
