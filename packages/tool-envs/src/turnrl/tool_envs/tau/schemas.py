"""OpenAI function schemas for the retail and airline tools, written for turnrl.

A data folder's ``tools.json`` (tau-bench's own schemas) is preferred when present;
these are the fallback for folders without one, such as the synthetic mini-retail
domain. Parameter names and their order match the tool implementations (the order is
what argument-binding errors list).
"""

from __future__ import annotations

from typing import Any

_STR: dict[str, Any] = {"type": "string"}
_STR_LIST: dict[str, Any] = {"type": "array", "items": {"type": "string"}}
_INT: dict[str, Any] = {"type": "integer"}
_ADDRESS = [
    ("address1", _STR, "Street address, first line."),
    ("address2", _STR, "Street address, second line (may be empty)."),
    ("city", _STR, "City."),
    ("state", _STR, "State or province code, e.g. 'CA'."),
    ("country", _STR, "Country, e.g. 'USA'."),
    ("zip", _STR, "Postal code."),
]
_ORDER_ID = ("order_id", _STR, "Order id including the leading '#', e.g. '#W0000001'.")
_PAYMENT = ("payment_method_id", _STR, "Payment method id from the user's profile.")
_CABIN = {"type": "string", "enum": ["basic_economy", "economy", "business"]}
_FLIGHT = {
    "type": "object",
    "properties": {"flight_number": _STR, "date": _STR},
    "required": ["flight_number", "date"],
}
_PASSENGER = {
    "type": "object",
    "properties": {"first_name": _STR, "last_name": _STR, "dob": _STR},
    "required": ["first_name", "last_name", "dob"],
}
_PAYMENT_SPLIT = {
    "type": "object",
    "properties": {"payment_id": _STR, "amount": {"type": "number"}},
    "required": ["payment_id", "amount"],
}

Param = tuple[str, dict[str, Any], str]

_RETAIL: list[tuple[str, str, list[Param]]] = [
    (
        "calculate",
        "Evaluate an arithmetic expression (numbers, + - * /, parentheses).",
        [("expression", _STR, "The expression, e.g. '12.5 * 3 + 4'.")],
    ),
    (
        "cancel_pending_order",
        "Cancel a pending order; payments are refunded. Ask the user to confirm first.",
        [
            _ORDER_ID,
            (
                "reason",
                {"type": "string", "enum": ["no longer needed", "ordered by mistake"]},
                "Why the user cancels.",
            ),
        ],
    ),
    (
        "exchange_delivered_order_items",
        "Request an exchange of delivered items for other variants of the same products. Confirm first.",
        [
            _ORDER_ID,
            ("item_ids", _STR_LIST, "Item ids to exchange (duplicates allowed)."),
            ("new_item_ids", _STR_LIST, "Replacement item ids, position by position."),
            _PAYMENT,
        ],
    ),
    (
        "find_user_id_by_email",
        "Look up a user id by email address.",
        [("email", _STR, "The user's email.")],
    ),
    (
        "find_user_id_by_name_zip",
        "Look up a user id by first name, last name and zip code.",
        [
            ("first_name", _STR, "First name."),
            ("last_name", _STR, "Last name."),
            ("zip", _STR, "Zip code."),
        ],
    ),
    ("get_order_details", "Show an order's status, items, address and payments.", [_ORDER_ID]),
    (
        "get_product_details",
        "Show a product and all its variants (item ids, options, prices).",
        [("product_id", _STR, "Product id (not an item id).")],
    ),
    (
        "get_user_details",
        "Show a user's profile, payment methods and orders.",
        [("user_id", _STR, "User id, e.g. 'jane_doe_1234'.")],
    ),
    ("list_all_product_types", "List every product name with its product id.", []),
    (
        "modify_pending_order_address",
        "Change the shipping address of a pending order. Confirm first.",
        [_ORDER_ID, *_ADDRESS],
    ),
    (
        "modify_pending_order_items",
        "Swap items of a pending order for other variants of the same products (once per order). "
        "Confirm first.",
        [
            _ORDER_ID,
            ("item_ids", _STR_LIST, "Item ids to change."),
            ("new_item_ids", _STR_LIST, "New item ids, position by position."),
            _PAYMENT,
        ],
    ),
    (
        "modify_pending_order_payment",
        "Pay a pending order with another payment method. Confirm first.",
        [_ORDER_ID, _PAYMENT],
    ),
    (
        "modify_user_address",
        "Change a user's default address. Confirm first.",
        [("user_id", _STR, "User id."), *_ADDRESS],
    ),
    (
        "return_delivered_order_items",
        "Request a return of delivered items. Confirm first.",
        [_ORDER_ID, ("item_ids", _STR_LIST, "Item ids to return."), _PAYMENT],
    ),
    ("think", "Write down reasoning; changes nothing.", [("thought", _STR, "The thought.")]),
    (
        "transfer_to_human_agents",
        "Hand the conversation to a human agent (ends the episode).",
        [("summary", _STR, "Summary of the user's issue.")],
    ),
]

_AIRLINE: list[tuple[str, str, list[Param]]] = [
    (
        "book_reservation",
        "Book a reservation. Confirm the details with the user first.",
        [
            ("user_id", _STR, "User id."),
            ("origin", _STR, "Origin airport code."),
            ("destination", _STR, "Destination airport code."),
            ("flight_type", {"type": "string", "enum": ["one_way", "round_trip"]}, "Trip type."),
            ("cabin", _CABIN, "Cabin class."),
            ("flights", {"type": "array", "items": _FLIGHT}, "Flights with number and date."),
            ("passengers", {"type": "array", "items": _PASSENGER}, "Passengers."),
            (
                "payment_methods",
                {"type": "array", "items": _PAYMENT_SPLIT},
                "Payments that sum to the total.",
            ),
            ("total_baggages", _INT, "Checked bags in total."),
            ("nonfree_baggages", _INT, "Checked bags that are paid for."),
            ("insurance", {"type": "string", "enum": ["yes", "no"]}, "Travel insurance."),
        ],
    ),
    (
        "calculate",
        "Evaluate an arithmetic expression (numbers, + - * /, parentheses).",
        [("expression", _STR, "The expression, e.g. '12.5 * 3 + 4'.")],
    ),
    (
        "cancel_reservation",
        "Cancel a reservation; payments are refunded.",
        [("reservation_id", _STR, "Reservation id.")],
    ),
    (
        "get_reservation_details",
        "Show a reservation.",
        [("reservation_id", _STR, "Reservation id.")],
    ),
    (
        "get_user_details",
        "Show a user's profile and reservations.",
        [("user_id", _STR, "User id.")],
    ),
    ("list_all_airports", "List airport codes and cities.", []),
    (
        "search_direct_flight",
        "Find direct flights on a date.",
        [
            ("origin", _STR, "Origin airport code."),
            ("destination", _STR, "Destination airport code."),
            ("date", _STR, "Date as YYYY-MM-DD."),
        ],
    ),
    (
        "search_onestop_flight",
        "Find one-stop connections on a date.",
        [
            ("origin", _STR, "Origin airport code."),
            ("destination", _STR, "Destination airport code."),
            ("date", _STR, "Date as YYYY-MM-DD."),
        ],
    ),
    (
        "send_certificate",
        "Give a user a travel certificate as compensation.",
        [("user_id", _STR, "User id."), ("amount", {"type": "number"}, "Certificate value.")],
    ),
    ("think", "Write down reasoning; changes nothing.", [("thought", _STR, "The thought.")]),
    (
        "transfer_to_human_agents",
        "Hand the conversation to a human agent (ends the episode).",
        [("summary", _STR, "Summary of the user's issue.")],
    ),
    (
        "update_reservation_baggages",
        "Change a reservation's checked bags.",
        [
            ("reservation_id", _STR, "Reservation id."),
            ("total_baggages", _INT, "Bags in total."),
            ("nonfree_baggages", _INT, "Paid bags."),
            ("payment_id", _STR, "Payment method id."),
        ],
    ),
    (
        "update_reservation_flights",
        "Change a reservation's flights or cabin.",
        [
            ("reservation_id", _STR, "Reservation id."),
            ("cabin", _CABIN, "Cabin class."),
            ("flights", {"type": "array", "items": _FLIGHT}, "All flights of the new itinerary."),
            ("payment_id", _STR, "Payment method id."),
        ],
    ),
    (
        "update_reservation_passengers",
        "Change a reservation's passenger details.",
        [
            ("reservation_id", _STR, "Reservation id."),
            ("passengers", {"type": "array", "items": _PASSENGER}, "Passengers (same count)."),
        ],
    ),
]


def _schema(name: str, description: str, params: list[Param]) -> dict[str, Any]:
    properties = {p: {**kind, "description": text} for p, kind, text in params}
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": properties,
                "required": list(properties),
            },
        },
    }


def builtin_schemas(domain: str) -> list[dict[str, Any]]:
    """turnrl's schemas for ``domain`` (``retail`` or ``airline``), in tau-bench's tool order."""
    table = {"retail": _RETAIL, "airline": _AIRLINE}.get(domain)
    if table is None:
        raise ValueError(f"unknown tau domain {domain!r}; expected 'retail' or 'airline'")
    return [_schema(*entry) for entry in table]
