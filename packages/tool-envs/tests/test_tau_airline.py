"""Airline tools on tau-bench's airline data: return strings, changes and hash parity.

Every write is checked against the reference (slow) hash of the same state, and the
pristine data must stay untouched. Skipped when the tau-bench data is absent.
"""

import json
import os
from pathlib import Path

import pytest

from turnrl.tool_envs.tau import TauDomain, reference_data_hash

TAU_DIR = Path(
    os.environ.get("TURNRL_TAU_BENCH_DIR")
    or Path(__file__).resolve().parents[3] / ".." / "shared" / "tau-bench"
)
pytestmark = pytest.mark.skipif(not TAU_DIR.is_dir(), reason="tau-bench data not present")
USER = "mei_hernandez_8984"
PASSENGER = {"first_name": "Mei", "last_name": "Hernandez", "dob": "1981-01-11"}


@pytest.fixture(scope="module")
def airline():
    return TauDomain.from_dir("airline", TAU_DIR / "airline")


def _book(airline, db, payments, cabin="economy", nonfree=0, insurance="no"):
    kwargs = {
        "user_id": USER,
        "origin": "JFK",
        "destination": "MIA",
        "flight_type": "one_way",
        "cabin": cabin,
        "flights": [{"flight_number": "HAT014", "date": "2024-05-20"}],
        "passengers": [dict(PASSENGER)],
        "payment_methods": payments,
        "total_baggages": nonfree,
        "nonfree_baggages": nonfree,
        "insurance": insurance,
    }
    return airline.invoke(db, "book_reservation", kwargs)


def test_booking_prices_flights_charges_gift_card_and_uses_fixed_ids(airline):
    db = airline.new_database()
    total = 143 + 30 + 50  # economy price, insurance, one paid bag
    out = _book(
        airline,
        db,
        [
            {"payment_id": "gift_card_5309492", "amount": 98},
            {"payment_id": "credit_card_2140654", "amount": total - 98},
        ],
        nonfree=1,
        insurance="yes",
    )
    reservation = json.loads(out)
    assert reservation["reservation_id"] == "HATHAT"
    assert reservation["flights"] == [
        {
            "flight_number": "HAT014",
            "date": "2024-05-20",
            "price": 143,
            "origin": "JFK",
            "destination": "MIA",
        }
    ]
    assert "status" not in reservation and reservation["created_at"] == "2024-05-15T15:00:00"
    user = db.tables["users"][USER]
    assert user["payment_methods"]["gift_card_5309492"]["amount"] == 0
    assert user["reservations"][-1] == "HATHAT"
    assert (
        json.loads(_book(airline, db, [{"payment_id": "credit_card_2140654", "amount": 143}]))[
            "reservation_id"
        ]
        == "HATHAU"
    )
    assert db.data_hash() == reference_data_hash(db.tables)
    pristine = airline.new_database()
    assert "HATHAT" not in pristine.tables["reservations"]
    assert (
        pristine.data_hash() == "4587e6b48ad2b2c4f3e1fecb40aabec7bb2286513273b8f8cec3f5865222f290"
    )


def test_booking_errors(airline):
    db = airline.new_database()
    assert _book(airline, db, [{"payment_id": "credit_card_2140654", "amount": 100}]) == (
        "Error: payment amount does not add up, total price is 143, but paid 100"
    )
    assert _book(airline, db, [{"payment_id": "gift_card_5309492", "amount": 143}]) == (
        "Error: not enough balance in payment method gift_card_5309492"
    )
    assert _book(airline, db, [{"payment_id": "nope", "amount": 143}]) == (
        "Error: payment method nope not found"
    )
    assert _book(airline, db, [], cabin="first") == "Error: 'first'"
    assert db.data_hash() == airline.new_database().data_hash()


def test_certificate_is_consumed_and_listed_twice_fails_after_deleting(airline):
    db = airline.new_database()
    cert = {"payment_id": "certificate_7502997", "amount": 300}  # it holds 250
    out = _book(airline, db, [cert])
    assert out == "Error: not enough balance in payment method certificate_7502997"
    out = _book(
        airline,
        db,
        [
            {"payment_id": "certificate_7502997", "amount": 100},
            {"payment_id": "credit_card_2140654", "amount": 43},
        ],
    )
    assert json.loads(out)["reservation_id"] == "HATHAT"
    assert "certificate_7502997" not in db.tables["users"][USER]["payment_methods"]
    twice = [
        {"payment_id": "certificate_3321326", "amount": 100},
        {"payment_id": "certificate_3321326", "amount": 43},
    ]
    assert _book(airline, db, twice) == "Error: 'certificate_3321326'"
    assert "HATHAU" not in db.tables["reservations"]
    assert db.data_hash() == reference_data_hash(db.tables)


def test_cancel_update_and_certificates(airline):
    db = airline.new_database()
    out = json.loads(airline.invoke(db, "cancel_reservation", {"reservation_id": "R9QDGB"}))
    assert out["payment_history"][-1] == {"payment_id": "credit_card_6082923", "amount": -1911}
    assert list(out)[-1] == "status" and out["status"] == "cancelled"
    bags = {
        "reservation_id": "R9QDGB",
        "total_baggages": 2,
        "nonfree_baggages": 2,
        "payment_id": "credit_card_2140654",
    }
    out = json.loads(airline.invoke(db, "update_reservation_baggages", bags))
    assert out["payment_history"][-1] == {"payment_id": "credit_card_2140654", "amount": 100}
    assert (out["total_baggages"], out["nonfree_baggages"]) == (2, 2)
    bags.update(nonfree_baggages=3, payment_id="gift_card_5309492")
    out = json.loads(airline.invoke(db, "update_reservation_baggages", bags))
    assert out["payment_history"][-1] == {"payment_id": "gift_card_5309492", "amount": 50}
    assert db.tables["users"][USER]["payment_methods"]["gift_card_5309492"]["amount"] == 48
    for expected in ("certificate_3221322", "certificate_3221323", "certificate_3221324"):
        text = airline.invoke(db, "send_certificate", {"user_id": USER, "amount": 150})
        assert text == f"Certificate {expected} added to user {USER} with amount 150."
    assert airline.invoke(db, "send_certificate", {"user_id": USER, "amount": 1}).startswith(
        "Error:"
    )
    assert airline.invoke(db, "get_reservation_details", {"reservation_id": "NOPE"}) == (
        "Error: user not found"
    )
    assert db.data_hash() == reference_data_hash(db.tables)


def test_gift_card_shortfall_for_baggage_is_refused(airline):
    db = airline.new_database()
    bags = {
        "reservation_id": "R9QDGB",
        "total_baggages": 3,
        "nonfree_baggages": 3,
        "payment_id": "gift_card_5309492",
    }
    assert airline.invoke(db, "update_reservation_baggages", bags) == (
        "Error: gift card balance is not enough"
    )
    bags["payment_id"] = "certificate_7502997"
    assert airline.invoke(db, "update_reservation_baggages", bags) == (
        "Error: certificate cannot be used to update reservation"
    )


def test_update_flights_reuses_prices_and_keeps_cabin(airline):
    db = airline.new_database()
    original = airline.pristine.tables["reservations"]["R9QDGB"]
    flights = [
        {"flight_number": f["flight_number"], "date": f["date"]} for f in original["flights"]
    ]
    kwargs = {
        "reservation_id": "R9QDGB",
        "cabin": "economy",
        "flights": flights,
        "payment_id": "credit_card_6082923",
    }
    out = json.loads(airline.invoke(db, "update_reservation_flights", kwargs))
    assert [f["price"] for f in out["flights"]] == [f["price"] for f in original["flights"]]
    assert out["payment_history"] == original["payment_history"]  # no difference, no entry
    kwargs["cabin"] = "business"
    out = json.loads(airline.invoke(db, "update_reservation_flights", kwargs))
    assert out["cabin"] == "economy"
    assert out["payment_history"][-1]["amount"] > 0
    passengers = {"reservation_id": "R9QDGB", "passengers": [PASSENGER]}
    assert airline.invoke(db, "update_reservation_passengers", passengers) == (
        "Error: number of passengers does not match"
    )
    assert db.data_hash() == reference_data_hash(db.tables)


def test_searches(airline):
    db = airline.new_database()
    direct = json.loads(
        airline.invoke(
            db,
            "search_direct_flight",
            {"origin": "JFK", "destination": "MIA", "date": "2024-05-20"},
        )
    )
    assert direct and all(f["status"] == "available" and "dates" not in f for f in direct)
    assert list(direct[0])[:5] == [
        "flight_number",
        "origin",
        "destination",
        "scheduled_departure_time_est",
        "scheduled_arrival_time_est",
    ]
    onestop = json.loads(
        airline.invoke(
            db,
            "search_onestop_flight",
            {"origin": "JFK", "destination": "SEA", "date": "2024-05-20"},
        )
    )
    assert onestop
    for first, second in onestop:
        assert first["destination"] == second["origin"] and first["date"] == "2024-05-20"
        assert first["scheduled_arrival_time_est"] <= second["scheduled_departure_time_est"]
    airports = json.loads(airline.invoke(db, "list_all_airports", {}))
    assert list(airports)[:2] == ["SFO", "JFK"] and len(airports) == 20
