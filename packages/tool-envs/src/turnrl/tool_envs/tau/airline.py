"""The 14 tau-bench airline tools, behaving as ``SPEC.md`` §9 specifies.

Same conventions as :mod:`turnrl.tool_envs.tau.retail`: checks in the specified order
with the exact error strings, writes only through ``db.mutable``/``db.put``, records
returned as default ``json.dumps``. Airline arithmetic is never rounded; seat counts are
never decremented (upstream behaviour).
"""

from __future__ import annotations

import json
from typing import Any

from turnrl.tool_envs.tau.calculate import calculate as _calculate
from turnrl.tool_envs.tau.db import Database, copy_record
from turnrl.tool_envs.tau.toolkit import collect_tools, tool

BOOKING_IDS = ("HATHAT", "HATHAU", "HATHAV")
CERTIFICATE_IDS = ("certificate_3221322", "certificate_3221323", "certificate_3221324")
CREATED_AT = "2024-05-15T15:00:00"
AIRPORTS = {
    "SFO": "San Francisco",
    "JFK": "New York",
    "LAX": "Los Angeles",
    "ORD": "Chicago",
    "DFW": "Dallas",
    "DEN": "Denver",
    "SEA": "Seattle",
    "ATL": "Atlanta",
    "MIA": "Miami",
    "BOS": "Boston",
    "PHX": "Phoenix",
    "IAH": "Houston",
    "LAS": "Las Vegas",
    "MCO": "Orlando",
    "EWR": "Newark",
    "CLT": "Charlotte",
    "MSP": "Minneapolis",
    "DTW": "Detroit",
    "PHL": "Philadelphia",
    "LGA": "LaGuardia",
}


def _price_flight(
    db: Database, entry: dict[str, Any], cabin: Any, n: int
) -> tuple[str | None, Any]:
    """Availability checks a-d for one flight entry; on success price it in place.

    Returns ``(error, None)`` or ``(None, price * n)``.
    """
    number, date = entry["flight_number"], entry["date"]
    flights = db.tables["flights"]
    if number not in flights:
        return f"Error: flight {number} not found", None
    flight = flights[number]
    if date not in flight["dates"]:
        return f"Error: flight {number} not found on date {date}", None
    day = flight["dates"][date]
    if day["status"] != "available":
        return f"Error: flight {number} not available on date {date}", None
    if day["available_seats"][cabin] < n:
        return f"Error: not enough seats on flight {number}", None
    entry["price"] = day["prices"][cabin]
    entry["origin"] = flight["origin"]
    entry["destination"] = flight["destination"]
    return None, entry["price"] * n


def _left_sum(values: Any) -> Any:
    """Python 3.11 ``sum``: int 0 plus each value, left to right (no compensation)."""
    total: Any = 0
    for value in values:
        total = total + value
    return total


@tool("BookReservation")
def book_reservation(
    db: Database,
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
) -> str:
    users, reservations = db.tables["users"], db.tables["reservations"]
    if user_id not in users:
        return "Error: user not found"
    rid = next((r for r in BOOKING_IDS[:2] if r not in reservations), BOOKING_IDS[2])
    reservation = {
        "reservation_id": rid,
        "user_id": user_id,
        "origin": origin,
        "destination": destination,
        "flight_type": flight_type,
        "cabin": cabin,
        "flights": copy_record(flights),
        "passengers": passengers,
        "payment_history": payment_methods,
        "created_at": CREATED_AT,
        "total_baggages": total_baggages,
        "nonfree_baggages": nonfree_baggages,
        "insurance": insurance,
    }
    n = len(passengers)
    total: Any = 0
    for entry in reservation["flights"]:
        error, cost = _price_flight(db, entry, cabin, n)
        if error is not None:
            return error
        total = total + cost
    if insurance == "yes":
        total = total + 30 * n
    total = total + 50 * nonfree_baggages
    methods = users[user_id]["payment_methods"]
    for payment in payment_methods:
        pid, amount = payment["payment_id"], payment["amount"]
        if pid not in methods:
            return f"Error: payment method {pid} not found"
        if (
            methods[pid]["source"] in ("gift_card", "certificate")
            and methods[pid]["amount"] < amount
        ):
            return f"Error: not enough balance in payment method {pid}"
    paid = _left_sum(payment["amount"] for payment in payment_methods)
    if paid != total:
        return f"Error: payment amount does not add up, total price is {total}, but paid {paid}"
    user = db.mutable("users", user_id)
    for payment in payment_methods:
        pid = payment["payment_id"]
        method = user["payment_methods"][pid]
        if method["source"] == "gift_card":
            method["amount"] = method["amount"] - payment["amount"]
        elif method["source"] == "certificate":
            del user["payment_methods"][pid]
    db.put("reservations", rid, reservation)
    user["reservations"].append(rid)
    return json.dumps(reservation)


@tool("Calculate")
def calculate(db: Database, expression: Any) -> str:
    return _calculate(expression)


@tool("CancelReservation")
def cancel_reservation(db: Database, reservation_id: Any) -> str:
    if reservation_id not in db.tables["reservations"]:
        return "Error: reservation not found"
    reservation = db.mutable("reservations", reservation_id)
    history = reservation["payment_history"]
    refunds = [{"payment_id": p["payment_id"], "amount": -p["amount"]} for p in history]
    history.extend(refunds)
    reservation["status"] = "cancelled"
    return json.dumps(reservation)


@tool("GetReservationDetails")
def get_reservation_details(db: Database, reservation_id: Any) -> str:
    reservations = db.tables["reservations"]
    if reservation_id in reservations:
        return json.dumps(reservations[reservation_id])
    return "Error: user not found"


@tool("GetUserDetails")
def get_user_details(db: Database, user_id: Any) -> str:
    users = db.tables["users"]
    return json.dumps(users[user_id]) if user_id in users else "Error: user not found"


@tool("ListAllAirports")
def list_all_airports(db: Database) -> str:
    return json.dumps(AIRPORTS)


def _flight_on(flight: dict[str, Any], day: dict[str, Any]) -> dict[str, Any]:
    record = {key: value for key, value in flight.items() if key != "dates"}
    record.update(day)
    return record


@tool("SearchDirectFlight")
def search_direct_flight(db: Database, origin: Any, destination: Any, date: Any) -> str:
    found = []
    for flight in db.tables["flights"].values():
        if (
            flight["origin"] == origin
            and flight["destination"] == destination
            and date in flight["dates"]
            and flight["dates"][date]["status"] == "available"
        ):
            found.append(_flight_on(flight, flight["dates"][date]))
    return json.dumps(found)


@tool("SearchOnestopFlight")
def search_onestop_flight(db: Database, origin: Any, destination: Any, date: Any) -> str:
    flights = db.tables["flights"]
    found = []
    for first in flights.values():
        if first["origin"] != origin:
            continue
        arrival = first["scheduled_arrival_time_est"]
        for second in flights.values():
            if second["destination"] != destination or first["destination"] != second["origin"]:
                continue
            date2 = f"2024-05-{int(date[-2:]) + 1}" if "+1" in arrival else date
            if arrival > second["scheduled_departure_time_est"]:
                continue
            if (
                date in first["dates"]
                and date2 in second["dates"]
                and first["dates"][date]["status"] == "available"
                and second["dates"][date2]["status"] == "available"
            ):
                leg1 = _flight_on(first, first["dates"][date])
                leg1["date"] = date
                leg2 = _flight_on(second, second["dates"][date])  # upstream: first leg's date
                leg2["date"] = date2
                found.append([leg1, leg2])
    return json.dumps(found)


@tool("SendCertificate")
def send_certificate(db: Database, user_id: Any, amount: Any) -> str | None:
    users = db.tables["users"]
    if user_id not in users:
        return "Error: user not found"
    for pid in CERTIFICATE_IDS:
        if pid not in users[user_id]["payment_methods"]:
            user = db.mutable("users", user_id)
            user["payment_methods"][pid] = {"source": "certificate", "amount": amount, "id": pid}
            return f"Certificate {pid} added to user {user_id} with amount {amount}."
    return None


@tool("Think")
def think(db: Database, thought: Any) -> str:
    return ""


@tool("TransferToHumanAgents")
def transfer_to_human_agents(db: Database, summary: Any) -> str:
    return "Transfer successful"


def _payment_error(db: Database, user_id: str, payment_id: Any, cost: Any) -> str | None:
    methods = db.tables["users"][user_id]["payment_methods"]
    if payment_id not in methods:
        return "Error: payment method not found"
    method = methods[payment_id]
    if method["source"] == "certificate":
        return "Error: certificate cannot be used to update reservation"
    if method["source"] == "gift_card" and method["amount"] < cost:
        return "Error: gift card balance is not enough"
    return None


def _charge_gift_card(db: Database, user_id: str, payment_id: Any, cost: Any) -> None:
    if db.tables["users"][user_id]["payment_methods"][payment_id]["source"] == "gift_card":
        method = db.mutable("users", user_id)["payment_methods"][payment_id]
        method["amount"] = method["amount"] - cost


@tool("UpdateReservationBaggages")
def update_reservation_baggages(
    db: Database, reservation_id: Any, total_baggages: Any, nonfree_baggages: Any, payment_id: Any
) -> str:
    if reservation_id not in db.tables["reservations"]:
        return "Error: reservation not found"
    reservation = db.tables["reservations"][reservation_id]
    price = 50 * max(0, nonfree_baggages - reservation["nonfree_baggages"])
    error = _payment_error(db, reservation["user_id"], payment_id, price)
    if error is not None:
        return error
    reservation = db.mutable("reservations", reservation_id)
    reservation["total_baggages"] = total_baggages
    reservation["nonfree_baggages"] = nonfree_baggages
    _charge_gift_card(db, reservation["user_id"], payment_id, price)
    if price != 0:
        reservation["payment_history"].append({"payment_id": payment_id, "amount": price})
    return json.dumps(reservation)


@tool("UpdateReservationFlights")
def update_reservation_flights(
    db: Database, reservation_id: Any, cabin: Any, flights: Any, payment_id: Any
) -> str:
    if reservation_id not in db.tables["reservations"]:
        return "Error: reservation not found"
    reservation = db.tables["reservations"][reservation_id]
    n = len(reservation["passengers"])
    total: Any = 0
    new_flights = copy_record(flights)
    for entry in new_flights:
        same = [
            old
            for old in reservation["flights"]
            if cabin == reservation["cabin"]
            and old["flight_number"] == entry["flight_number"]
            and old["date"] == entry["date"]
        ]
        if same:
            old = same[0]
            total = total + old["price"] * n
            entry["price"], entry["origin"], entry["destination"] = (
                old["price"],
                old["origin"],
                old["destination"],
            )
            continue
        error, cost = _price_flight(db, entry, cabin, n)
        if error is not None:
            return error
        total = total + cost
    total = total - _left_sum(old["price"] for old in reservation["flights"]) * n
    error = _payment_error(db, reservation["user_id"], payment_id, total)
    if error is not None:
        return error
    _charge_gift_card(db, reservation["user_id"], payment_id, total)
    reservation = db.mutable("reservations", reservation_id)
    reservation["flights"] = new_flights
    if total != 0:
        reservation["payment_history"].append({"payment_id": payment_id, "amount": total})
    return json.dumps(reservation)


@tool("UpdateReservationPassengers")
def update_reservation_passengers(db: Database, reservation_id: Any, passengers: Any) -> str:
    reservations = db.tables["reservations"]
    if reservation_id not in reservations:
        return "Error: reservation not found"
    if len(passengers) != len(reservations[reservation_id]["passengers"]):
        return "Error: number of passengers does not match"
    reservation = db.mutable("reservations", reservation_id)
    reservation["passengers"] = passengers
    return json.dumps(reservation)


AIRLINE_TOOLS = collect_tools(
    [
        book_reservation,
        calculate,
        cancel_reservation,
        get_reservation_details,
        get_user_details,
        list_all_airports,
        search_direct_flight,
        search_onestop_flight,
        send_certificate,
        think,
        transfer_to_human_agents,
        update_reservation_baggages,
        update_reservation_flights,
        update_reservation_passengers,
    ]
)
"""Airline tools by name, in tau-bench's ``tools.json`` order."""
