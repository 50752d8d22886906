"""The policy-following agent of the airline: it works from the conversation alone (it reads the
customer's requests with :func:`airline_text.parse_request`), looks everything up with tools, checks
the policy's rules itself, confirms before writing and refuses when the policy says no."""

from __future__ import annotations

import json
from collections.abc import Generator

from .airline_text import parse_identity, parse_request
from .airline_world import BAG_FEE, COMPENSATION_PER_PASSENGER, DAY_BEFORE_NOW, INSURANCE_FEE, nonfree_bags
from .customer import CONFIRM_MARK, STOP
from .oracle import ASK_REQUEST, RetailOracle, _call

ASK_IDENTITY = "Sure. Please tell me your user id."


def _find_pm(user: dict, desc: str) -> dict | None:
    for pm in user["payment_methods"]:
        if pm["source"] == "credit_card":
            if desc == f"{pm['brand']} card ending in {pm['last_four']}":
                return pm
        elif desc == f"{pm['source'].replace('_', ' ')} {pm['id']}":
            return pm
    return None


class AirlineOracle(RetailOracle):
    """Policy-following agent for the airline (the coroutine interface of :class:`RetailOracle`)."""

    def _script(self, msg: str) -> Generator[str, str, None]:
        user = None
        tries = 0
        while STOP not in msg:
            req = parse_request(msg)
            if req is None:
                tries += 1
                if tries > 3:
                    return
                msg = yield ASK_REQUEST
                continue
            while user is None:
                uid = parse_identity(msg)
                if uid is None:
                    msg = yield ASK_IDENTITY
                    if STOP in msg:
                        return
                    continue
                out = yield _call("get_user_details", user_id=uid)
                if out.startswith("Error"):
                    msg = yield "Sorry, I could not find that user id. " + ASK_IDENTITY
                    continue
                user = json.loads(out)
            msg = yield from self._handle(req, user)

    def _reservation(self, rid: str, user: dict) -> Generator[str, str, tuple[dict | None, str | None]]:
        out = yield _call("get_reservation_details", reservation_id=rid)
        if out.startswith("Error"):
            return None, (yield f"Sorry, I cannot find reservation {rid}.")
        res = json.loads(out)
        if res["user_id"] != user["user_id"]:
            return None, (yield f"Sorry, reservation {rid} is not in your profile.")
        if res.get("status") == "cancelled":
            return None, (yield f"Sorry, reservation {rid} is already cancelled.")
        return res, None

    def _handle(self, req: dict, user: dict) -> Generator[str, str, str]:
        kind, uid = req["kind"], user["user_id"]
        if kind == "status":
            out = yield _call("get_flight_status", flight_number=req["flight_number"], date=req["date"])
            if out.startswith("Error"):
                return (yield f"Sorry, I cannot find flight {req['flight_number']} on {req['date']}.")
            return (yield f"Flight {req['flight_number']} on {req['date']} is {out}.")
        if kind == "cheapest":
            found = json.loads((yield _call("search_direct_flight", origin=req["origin"],
                                            destination=req["destination"], date=req["date"])))
            fares = [(f["prices"]["economy"], f["flight_number"]) for f in found if f["available_seats"]["economy"] > 0]
            if not fares:
                return (yield "Sorry, there is no direct flight with economy seats then.")
            price, number = min(fares)
            return (yield f"The cheapest economy fare is {price} dollars (flight {number}).")
        if kind == "book":
            return (yield from self._book(req, user))
        res, reply = yield from self._reservation(req["reservation_id"], user)
        if res is None:
            return reply
        rid, n = res["reservation_id"], len(res["passengers"])
        if kind == "total":
            paid = sum(p["amount"] if p["type"] == "payment" else -p["amount"] for p in res["payment_history"])
            return (yield f"You have paid {paid} dollars in total for reservation {rid}.")
        if kind == "cancel":
            return (yield from self._cancel(req, res))
        if kind == "compensation":
            if not any(f["flight_number"] == req["flight_number"] and f["date"] == req["date"] for f in res["flights"]):
                return (yield f"Sorry, flight {req['flight_number']} on {req['date']} is not in reservation {rid}.")
            status = yield _call("get_flight_status", flight_number=req["flight_number"], date=req["date"])
            if status != "cancelled":
                return (yield "Sorry, the airline did not cancel that flight, so no compensation applies.")
            if user["membership"] == "regular" and res["insurance"] != "yes" and res["cabin"] != "business":
                return (yield "Sorry, you are not eligible for compensation.")
            amount = COMPENSATION_PER_PASSENGER * n
            reply = yield f"I will send you a travel certificate of {amount} dollars. Proceed? {CONFIRM_MARK}"
            return (yield from self._execute(reply, "send_certificate", dict(user_id=uid, amount=amount)))
        if kind == "passengers":
            passengers = [{k: p[k] for k in ("first_name", "last_name", "dob")} for p in res["passengers"]]
            match = [i for i, p in enumerate(passengers) if (p["first_name"], p["last_name"]) == (
                req["old_first"], req["old_last"])]
            if not match:
                return (yield f"Sorry, there is no passenger {req['old_first']} {req['old_last']} on reservation {rid}.")
            passengers[match[0]] = {"first_name": req["first_name"], "last_name": req["last_name"], "dob": req["dob"]}
            reply = yield (f"I will change passenger {req['old_first']} {req['old_last']} on reservation {rid} to "
                           f"{req['first_name']} {req['last_name']}, born {req['dob']}. Proceed? {CONFIRM_MARK}")
            return (yield from self._execute(reply, "update_reservation_passengers",
                                             dict(reservation_id=rid, passengers=passengers)))
        pm = _find_pm(user, req["payment"])
        if pm is None or pm["source"] == "certificate":
            return (yield "Sorry, I need a credit card or gift card from your profile for that.")
        if kind == "bags":
            total = res["total_baggages"] + req["add"]
            nonfree = nonfree_bags(user["membership"], res["cabin"], n, total)
            fee = (nonfree - res["nonfree_baggages"]) * BAG_FEE
            if pm["source"] == "gift_card" and pm["amount"] < fee:
                return (yield "Sorry, your gift card balance is too low.")
            reply = yield (f"I will set reservation {rid} to {total} checked bags ({nonfree} not free); the fee is "
                           f"{fee} dollars, paid with {pm['id']}. Proceed? {CONFIRM_MARK}")
            return (yield from self._execute(reply, "update_reservation_baggages", dict(
                reservation_id=rid, total_baggages=total, nonfree_baggages=nonfree, payment_id=pm["id"])))
        # change_flight, cabin: price the new itinerary from the search results
        if kind == "change_flight":
            if res["cabin"] == "basic_economy":
                return (yield f"Sorry, reservation {rid} is basic economy, so its flights cannot be changed.")
            if len(res["flights"]) != 1:
                return (yield "Sorry, I can only move a reservation with one flight this way.")
            cabin = res["cabin"]
            legs = [(res["flights"][0]["origin"], res["flights"][0]["destination"], req["flight_number"], req["date"])]
        else:
            cabin = req["cabin"]
            legs = [(f["origin"], f["destination"], f["flight_number"], f["date"]) for f in res["flights"]]
        prices = []
        for origin, dest, number, date in legs:
            found = json.loads((yield _call("search_direct_flight", origin=origin, destination=dest, date=date)))
            hit = [f for f in found if f["flight_number"] == number]
            if not hit or hit[0]["available_seats"][cabin] < n:
                return (yield f"Sorry, flight {number} on {date} has no {cabin} seats available.")
            prices.append(hit[0]["prices"][cabin])
        diff = (sum(prices) - sum(f["price"] for f in res["flights"])) * n
        if pm["source"] == "gift_card" and pm["amount"] < diff:
            return (yield "Sorry, your gift card balance is too low.")
        flights = [{"flight_number": number, "date": date} for _, _, number, date in legs]
        what = (f"move reservation {rid} to flight {req['flight_number']} on {req['date']}" if kind == "change_flight"
                else f"change the cabin of reservation {rid} to {cabin}")
        reply = yield (f"I will {what}; the fare difference is {diff} dollars, "
                       f"{'paid with' if diff >= 0 else 'refunded to'} {pm['id']}. Proceed? {CONFIRM_MARK}")
        return (yield from self._execute(reply, "update_reservation_flights", dict(
            reservation_id=rid, cabin=cabin, flights=flights, payment_id=pm["id"])))

    def _cancel(self, req: dict, res: dict) -> Generator[str, str, str]:
        rid, reason = res["reservation_id"], req["reason"]
        for f in res["flights"]:
            status = yield _call("get_flight_status", flight_number=f["flight_number"], date=f["date"])
            if status in ("flying", "landed"):
                return (yield f"Sorry, reservation {rid} has a flight that has departed, so it is not eligible.")
            f["status"] = status
        ok = (res["created_at"] > DAY_BEFORE_NOW or res["cabin"] == "business"
              or (res["insurance"] == "yes" and reason in ("health", "weather"))
              or (reason == "airline cancelled flight" and any(f["status"] == "cancelled" for f in res["flights"])))
        if not ok:
            return (yield f"Sorry, reservation {rid} is not eligible for cancellation under our policy.")
        reply = yield (f"I will cancel reservation {rid} (reason: {reason}); every payment is refunded to its method. "
                       f"Proceed? {CONFIRM_MARK}")
        return (yield from self._execute(reply, "cancel_reservation", dict(reservation_id=rid, reason=reason)))

    def _book(self, req: dict, user: dict) -> Generator[str, str, str]:
        cabin, number, date = req["cabin"], req["flight_number"], req["date"]
        found = json.loads((yield _call("search_direct_flight", origin=req["origin"], destination=req["destination"],
                                        date=date)))
        hit = [f for f in found if f["flight_number"] == number]
        if not hit or hit[0]["available_seats"][cabin] < 1:
            return (yield f"Sorry, flight {number} on {date} has no {cabin} seats available.")
        nonfree = nonfree_bags(user["membership"], cabin, 1, req["bags"])
        total = hit[0]["prices"][cabin] + nonfree * BAG_FEE + (INSURANCE_FEE if req["insurance"] == "yes" else 0)
        pm = _find_pm(user, req["payment"])
        if pm is None:
            return (yield "Sorry, I cannot find that payment method in your profile.")
        if pm["source"] != "credit_card" and pm["amount"] < total:
            return (yield f"Sorry, {pm['id']} does not cover the total of {total} dollars.")
        name = user["name"]
        me = {"first_name": name["first_name"], "last_name": name["last_name"], "dob": user["dob"]}
        reply = yield (f"I will book flight {number} on {date} from {req['origin']} to {req['destination']} in {cabin} "
                       f"for {me['first_name']} {me['last_name']}, with {req['bags']} checked bags ({nonfree} not free) "
                       f"and {'with' if req['insurance'] == 'yes' else 'without'} insurance; the total is {total} "
                       f"dollars, paid with {pm['id']}. Proceed? {CONFIRM_MARK}")
        return (yield from self._execute(reply, "book_reservation", dict(
            user_id=user["user_id"], origin=req["origin"], destination=req["destination"], flight_type="one_way",
            cabin=cabin, flights=[{"flight_number": number, "date": date}], passengers=[me],
            payment_methods=[{"payment_id": pm["id"], "amount": total}], total_baggages=req["bags"],
            nonfree_baggages=nonfree, insurance=req["insurance"])))
