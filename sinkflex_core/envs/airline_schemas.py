"""The airline tools' JSON schemas, and the check of a call's arguments against them (the checker
every world shares, :func:`.retail_tools.check_arguments`)."""

from __future__ import annotations

from .retail_tools import check_arguments as _check

CABIN_ENUM = ["basic_economy", "economy", "business"]
CANCEL_REASONS = ("change of plan", "airline cancelled flight", "health", "weather", "other")

_S = {"type": "string"}
_DATE = {"type": "string", "description": "YYYY-MM-DD"}
_FLIGHTS = {"type": "array", "maxItems": 6, "description": "every flight of the reservation, in order",
            "items": {"type": "object", "properties": {"flight_number": _S, "date": _DATE},
                      "required": ["flight_number", "date"]}}
_PASSENGERS = {"type": "array", "maxItems": 5,
               "items": {"type": "object", "properties": {"first_name": _S, "last_name": _S, "dob": _DATE},
                         "required": ["first_name", "last_name", "dob"]}}
_BAGS = {"type": "integer", "minimum": 0, "maximum": 50}


def _fn(name: str, description: str, props: dict, required: list[str] | None = None) -> dict:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": props,
                       "required": list(props) if required is None else required}}}


TOOL_SCHEMAS = [
    _fn("search_direct_flight", "Direct flights between two airports on a date that can be booked, with free "
        "seats and prices per cabin.", {"origin": _S, "destination": _S, "date": _DATE}),
    _fn("search_onestop_flight", "Pairs of flights with one stop between two airports, both legs on the date.",
        {"origin": _S, "destination": _S, "date": _DATE}),
    _fn("get_flight_status", "The status of a flight on a date.", {"flight_number": _S, "date": _DATE}),
    _fn("get_user_details", "A user's profile, membership, payment methods and reservation ids.", {"user_id": _S}),
    _fn("get_reservation_details", "A reservation's flights, passengers, baggage, insurance and payments.",
        {"reservation_id": _S}),
    _fn("list_all_airports", "Every airport code with its city.", {}),
    _fn("book_reservation", "Book flights for passengers; the payments must add up to the price (fares, $30 "
        "insurance per passenger if taken, $50 per non-free checked bag).", {
            "user_id": _S, "origin": _S, "destination": _S,
            "flight_type": {"type": "string", "enum": ["one_way", "round_trip"]},
            "cabin": {"type": "string", "enum": CABIN_ENUM}, "flights": _FLIGHTS, "passengers": _PASSENGERS,
            "payment_methods": {"type": "array", "maxItems": 5, "items": {
                "type": "object", "properties": {"payment_id": _S, "amount": {"type": "integer", "minimum": 0,
                                                                              "maximum": 100_000}},
                "required": ["payment_id", "amount"]}},
            "total_baggages": _BAGS, "nonfree_baggages": _BAGS,
            "insurance": {"type": "string", "enum": ["yes", "no"]}}),
    _fn("cancel_reservation", "Cancel a whole reservation and refund every payment to its method.",
        {"reservation_id": _S, "reason": {"type": "string", "enum": list(CANCEL_REASONS)}}),
    _fn("update_reservation_flights", "Change the flights and/or cabin of a reservation (same origin, "
        "destination and trip type); the fare difference is paid or refunded with the payment method.",
        {"reservation_id": _S, "cabin": {"type": "string", "enum": CABIN_ENUM}, "flights": _FLIGHTS,
         "payment_id": _S}),
    _fn("update_reservation_baggages", "Set the number of checked bags (bags can be added, not removed); "
        "the fee of the new non-free bags is paid with the payment method.",
        {"reservation_id": _S, "total_baggages": _BAGS, "nonfree_baggages": _BAGS, "payment_id": _S}),
    _fn("update_reservation_passengers", "Replace the passengers' details (the number of passengers stays).",
        {"reservation_id": _S, "passengers": _PASSENGERS}),
    _fn("send_certificate", "Give a user a travel certificate worth an amount in dollars.",
        {"user_id": _S, "amount": {"type": "integer", "minimum": 1, "maximum": 1000}}),
    _fn("calculate", "Evaluate an arithmetic expression (numbers, + - * / and parentheses).", {"expression": _S}),
    _fn("think", "Think out loud; changes nothing.", {"thought": _S}),
    _fn("transfer_to_human_agents", "Hand the customer to a human agent; ends the conversation.", {"summary": _S}),
]
TOOL_NAMES = [t["function"]["name"] for t in TOOL_SCHEMAS]
WRITE_TOOLS = ("book_reservation", "cancel_reservation", "update_reservation_flights",
               "update_reservation_baggages", "update_reservation_passengers", "send_certificate")
SCHEMA_BY_NAME = {t["function"]["name"]: t["function"]["parameters"] for t in TOOL_SCHEMAS}


def check_arguments(name: str, arguments: dict) -> None:
    """Raise :class:`ToolError` unless ``name`` is an airline tool and ``arguments`` fit its schema."""
    _check(name, arguments, SCHEMA_BY_NAME, call=f"the {name} call")
