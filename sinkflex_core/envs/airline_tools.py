"""The airline's tools: SQL transactions over one episode's database.

Every tool returns a string (compact JSON for records, a sentence for writes, ``Error: ...`` for a
refusal or a bad call). Each write checks everything first and then writes in one transaction, so
a refused call leaves the database exactly as it was. The rules the data can decide are enforced
here as well as written in the policy: basic economy flights cannot be changed, a cancellation needs
one of the policy's grounds, bags cannot be removed, payments must add up and come from the user.
"""

from __future__ import annotations

import hashlib
import json
import math

from .airline_schemas import check_arguments
from .airline_world import (
    BAG_FEE,
    CABINS,
    DAY_BEFORE_NOW,
    INSURANCE_FEE,
    NOW,
    free_bags,
    nonfree_bags,
)
from .retail_tools import SQLTools, ToolError, safe_calculate

MAX_GIFT_CARDS, MAX_CERTIFICATES, MAX_CREDIT_CARDS = 3, 1, 1


def _dump(obj) -> str:
    return json.dumps(obj, separators=(",", ":"))


class AirlineTools(SQLTools):
    """The airline's tools over one episode's SQLite connection (:class:`SQLTools`)."""

    check_arguments = staticmethod(check_arguments)

    # ---- lookups shared by the tools --------------------------------------------------------
    def _one(self, sql: str, args: tuple, missing: str) -> tuple:
        row = self.conn.execute(sql, args).fetchone()
        if row is None:
            raise ToolError(missing)
        return row

    def _user(self, user_id: str) -> tuple:
        return self._one("SELECT user_id, first_name, last_name, dob, email, membership FROM users WHERE user_id = ?",
                         (user_id,), "user not found")

    def _reservation(self, reservation_id: str) -> dict:
        row = self._one("SELECT * FROM reservations WHERE reservation_id = ?", (reservation_id,),
                        "reservation not found")
        cols = ("reservation_id", "user_id", "origin", "destination", "flight_type", "cabin", "created_at",
                "total_baggages", "nonfree_baggages", "insurance", "status")
        res = dict(zip(cols, row))
        res["flights"] = [{"flight_number": n, "date": d, "price": p} for n, d, p in self.conn.execute(
            "SELECT flight_number, date, price FROM reservation_flights WHERE reservation_id = ? ORDER BY pos",
            (reservation_id,))]
        res["passengers"] = [{"first_name": f, "last_name": la, "dob": d} for f, la, d in self.conn.execute(
            "SELECT first_name, last_name, dob FROM passengers WHERE reservation_id = ? ORDER BY pos",
            (reservation_id,))]
        return res

    def _flight_date(self, number: str, date: str) -> tuple:
        """(origin, destination, departure, arrival, status, seats by cabin, prices by cabin)."""
        row = self._one("SELECT f.origin, f.destination, f.departure, f.arrival, d.status, d.seats_basic_economy, "
                        "d.seats_economy, d.seats_business, d.price_basic_economy, d.price_economy, "
                        "d.price_business FROM flights f JOIN flight_dates d USING (flight_number) "
                        "WHERE f.flight_number = ? AND d.date = ?", (number, date),
                        f"flight {number[:20]} on {date[:20]} not found")
        return row[:5] + (dict(zip(CABINS, row[5:8])), dict(zip(CABINS, row[8:11])))

    def _payment_method(self, user_id: str, payment_id: str) -> tuple:
        return self._one("SELECT payment_id, source, amount FROM payment_methods WHERE payment_id = ? AND "
                         "user_id = ?", (payment_id, user_id), f"payment method {payment_id[:40]} not found")

    def _add_payment(self, reservation_id: str, kind: str, payment_id: str, amount: int) -> None:
        pos = self.conn.execute("SELECT COALESCE(MAX(pos) + 1, 0) FROM payments WHERE reservation_id = ?",
                                (reservation_id,)).fetchone()[0]
        self.conn.execute("INSERT INTO payments VALUES (?,?,?,?,?)", (reservation_id, pos, kind, payment_id, amount))

    def _change_balance(self, payment_id: str, delta: int) -> None:
        self.conn.execute("UPDATE payment_methods SET amount = amount + ? WHERE payment_id = ? "
                          "AND source != 'credit_card'", (delta, payment_id))

    def _check_itinerary(self, origin: str, destination: str, flight_type: str, flights: list[dict]) -> list[tuple]:
        """The flights' rows, after checking that they chain from ``origin`` to ``destination`` (and back)."""
        if not flights:
            raise ToolError("flights is empty")
        rows = [self._flight_date(f["flight_number"], f["date"]) for f in flights]
        for a, b, fa, fb in zip(rows, rows[1:], flights, flights[1:]):
            if a[1] != b[0] or (fa["date"], a[3]) > (fb["date"], b[2]):
                raise ToolError("the flights do not connect")
        stops = [r[1] for r in rows]
        if rows[0][0] != origin:
            raise ToolError("the first flight does not leave from the origin")
        if flight_type == "one_way" and stops[-1] != destination:
            raise ToolError("the last flight does not arrive at the destination")
        if flight_type == "round_trip" and (stops[-1] != origin or destination not in stops[:-1]):
            raise ToolError("a round trip must reach the destination and come back to the origin")
        return rows

    def _check_payment_for_change(self, user_id: str, payment_id: str, due: int) -> tuple:
        pm = self._payment_method(user_id, payment_id)
        if pm[1] == "certificate":
            raise ToolError("a change is paid or refunded with a credit card or a gift card, not a certificate")
        if pm[1] == "gift_card" and due > pm[2]:
            raise ToolError("the gift card balance is too low")
        return pm

    # ---- reads ------------------------------------------------------------------------------
    def search_direct_flight(self, origin: str, destination: str, date: str) -> str:
        out = []
        for row in self.conn.execute(
                "SELECT f.flight_number, f.departure, f.arrival, d.seats_basic_economy, d.seats_economy, "
                "d.seats_business, d.price_basic_economy, d.price_economy, d.price_business FROM flights f "
                "JOIN flight_dates d USING (flight_number) WHERE f.origin = ? AND f.destination = ? AND d.date = ? "
                "AND d.status = 'available' ORDER BY f.departure, f.flight_number", (origin, destination, date)):
            out.append({"flight_number": row[0], "origin": origin, "destination": destination, "date": date,
                        "departure": row[1], "arrival": row[2], "available_seats": dict(zip(CABINS, row[3:6])),
                        "prices": dict(zip(CABINS, row[6:9]))})
        return _dump(out)

    def search_onestop_flight(self, origin: str, destination: str, date: str) -> str:
        pairs = []
        for first in json.loads(self._search_from(origin, date)):
            if first["destination"] == destination:
                continue
            for second in json.loads(self.search_direct_flight(first["destination"], destination, date)):
                if second["departure"] >= first["arrival"]:
                    pairs.append([first, second])
        return _dump(pairs[:30])

    def _search_from(self, origin: str, date: str) -> str:
        dests = [r[0] for r in self.conn.execute("SELECT DISTINCT destination FROM flights WHERE origin = ? "
                                                 "ORDER BY destination", (origin,))]
        return _dump([f for d in dests for f in json.loads(self.search_direct_flight(origin, d, date))])

    def get_flight_status(self, flight_number: str, date: str) -> str:
        return self._flight_date(flight_number, date)[4]

    def get_user_details(self, user_id: str) -> str:
        uid, first, last, dob, email, membership = self._user(user_id)
        methods = []
        for pid, source, brand, last_four, amount in self.conn.execute(
                "SELECT payment_id, source, brand, last_four, amount FROM payment_methods WHERE user_id = ? "
                "ORDER BY rowid", (uid,)):
            pm = {"id": pid, "source": source}
            pm.update({"brand": brand, "last_four": last_four} if source == "credit_card" else {"amount": amount})
            methods.append(pm)
        reservations = [r[0] for r in self.conn.execute(
            "SELECT reservation_id FROM reservations WHERE user_id = ? ORDER BY rowid", (uid,))]
        return _dump({"user_id": uid, "name": {"first_name": first, "last_name": last}, "dob": dob, "email": email,
                      "membership": membership, "payment_methods": methods, "reservations": reservations})

    def get_reservation_details(self, reservation_id: str) -> str:
        res = self._reservation(reservation_id)
        for f in res["flights"]:
            f["origin"], f["destination"] = self._flight_date(f["flight_number"], f["date"])[:2]
        res["payment_history"] = [{"type": k, "payment_id": p, "amount": a} for k, p, a in self.conn.execute(
            "SELECT kind, payment_id, amount FROM payments WHERE reservation_id = ? ORDER BY pos", (reservation_id,))]
        if res["status"] is None:
            del res["status"]
        return _dump(res)

    def list_all_airports(self) -> str:
        return _dump({code: city for code, city in self.conn.execute("SELECT code, city FROM airports ORDER BY code")})

    # ---- writes -----------------------------------------------------------------------------
    def book_reservation(self, user_id: str, origin: str, destination: str, flight_type: str, cabin: str,
                         flights: list[dict], passengers: list[dict], payment_methods: list[dict],
                         total_baggages: int, nonfree_baggages: int, insurance: str) -> str:
        user = self._user(user_id)
        if not passengers:
            raise ToolError("passengers is empty")
        rows = self._check_itinerary(origin, destination, flight_type, flights)
        n = len(passengers)
        for f, row in zip(flights, rows):
            if row[4] != "available":
                raise ToolError(f"flight {f['flight_number']} on {f['date']} is {row[4]}, not available for booking")
            if row[5][cabin] < n:
                raise ToolError(f"flight {f['flight_number']} on {f['date']} has not enough {cabin} seats")
        if len({(f["flight_number"], f["date"]) for f in flights}) != len(flights):
            raise ToolError("a flight appears twice")
        if nonfree_baggages != nonfree_bags(user[5], cabin, n, total_baggages):
            raise ToolError(f"nonfree_baggages should be {nonfree_bags(user[5], cabin, n, total_baggages)} "
                            f"({free_bags(user[5], cabin, n)} free bags for this reservation)")
        total = sum(r[6][cabin] for r in rows) * n + nonfree_baggages * BAG_FEE \
            + (INSURANCE_FEE * n if insurance == "yes" else 0)
        methods = [self._payment_method(user_id, p["payment_id"]) for p in payment_methods]
        if len({m[0] for m in methods}) != len(methods):
            raise ToolError("a payment method appears twice")
        count = {s: sum(m[1] == s for m in methods) for s in ("credit_card", "gift_card", "certificate")}
        if count["credit_card"] > MAX_CREDIT_CARDS or count["certificate"] > MAX_CERTIFICATES \
                or count["gift_card"] > MAX_GIFT_CARDS:
            raise ToolError("at most one credit card, one certificate and three gift cards per booking")
        for m, p in zip(methods, payment_methods):
            if m[1] != "credit_card" and p["amount"] > m[2]:
                raise ToolError(f"{m[0]} has only {m[2]} dollars")
        paid = sum(p["amount"] for p in payment_methods)
        if paid != total:
            raise ToolError(f"the payments add up to {paid} dollars, but the price is {total} dollars")
        count_res = self.conn.execute("SELECT COUNT(*) FROM reservations").fetchone()[0]
        rid = self._new_id(f"{count_res}|{user_id}")
        with self.conn:
            self.conn.execute("INSERT INTO reservations VALUES (?,?,?,?,?,?,?,?,?,?,?)", (
                rid, user_id, origin, destination, flight_type, cabin, NOW, total_baggages, nonfree_baggages,
                insurance, None))
            for i, (f, row) in enumerate(zip(flights, rows)):
                self.conn.execute("INSERT INTO reservation_flights VALUES (?,?,?,?,?)",
                                  (rid, i, f["flight_number"], f["date"], row[6][cabin]))
                self.conn.execute(f"UPDATE flight_dates SET seats_{cabin} = seats_{cabin} - ? "
                                  "WHERE flight_number = ? AND date = ?", (n, f["flight_number"], f["date"]))
            for i, p in enumerate(passengers):
                self.conn.execute("INSERT INTO passengers VALUES (?,?,?,?,?)",
                                  (rid, i, p["first_name"], p["last_name"], p["dob"]))
            for m, p in zip(methods, payment_methods):
                self._add_payment(rid, "payment", m[0], p["amount"])
                if m[1] == "certificate":  # a certificate is used once; what is left of it is not refunded
                    self.conn.execute("UPDATE payment_methods SET amount = 0 WHERE payment_id = ?", (m[0],))
                else:
                    self._change_balance(m[0], -p["amount"])
        return f"reservation {rid} booked; total {total} dollars"

    def _new_id(self, key: str) -> str:
        """A reservation id that depends only on the database's state (so ground truth replays equal)."""
        letters = "ABCDEFGHJKLMNPQRSTUVWXYZ23456789"
        for salt in range(100):
            digest = hashlib.sha256(f"{key}|{salt}".encode()).digest()
            rid = "".join(letters[b % len(letters)] for b in digest[:6])
            if self.conn.execute("SELECT 1 FROM reservations WHERE reservation_id = ?", (rid,)).fetchone() is None:
                return rid
        raise ToolError("could not allocate a reservation id")

    def _check_not_flown(self, res: dict) -> None:
        if res["status"] == "cancelled":
            raise ToolError("the reservation is cancelled")
        for f in res["flights"]:
            row = self._flight_date(f["flight_number"], f["date"])
            if f"{f['date']}T{row[2]}" <= NOW:
                raise ToolError(f"flight {f['flight_number']} on {f['date']} has already departed")

    def cancel_reservation(self, reservation_id: str, reason: str) -> str:
        res = self._reservation(reservation_id)
        self._check_not_flown(res)
        airline_cancelled = any(self._flight_date(f["flight_number"], f["date"])[4] == "cancelled"
                                for f in res["flights"])
        if not (res["created_at"] > DAY_BEFORE_NOW or res["cabin"] == "business"
                or (res["insurance"] == "yes" and reason in ("health", "weather"))
                or (reason == "airline cancelled flight" and airline_cancelled)):
            raise ToolError("the reservation is not eligible for cancellation: booked more than 24 hours ago, "
                            "not business class, no flight cancelled by the airline, no insurance covering the reason")
        net: dict[str, int] = {}
        for kind, pid, amount in self.conn.execute("SELECT kind, payment_id, amount FROM payments WHERE "
                                                   "reservation_id = ? ORDER BY pos", (reservation_id,)):
            net[pid] = net.get(pid, 0) + (amount if kind == "payment" else -amount)
        with self.conn:
            for pid, amount in net.items():
                if amount > 0:
                    self._add_payment(reservation_id, "refund", pid, amount)
                    self._change_balance(pid, amount)
            self.conn.execute("UPDATE reservations SET status = 'cancelled' WHERE reservation_id = ?",
                              (reservation_id,))
        return f"reservation {reservation_id} cancelled; refund {sum(a for a in net.values() if a > 0)} dollars"

    def update_reservation_flights(self, reservation_id: str, cabin: str, flights: list[dict], payment_id: str) -> str:
        res = self._reservation(reservation_id)
        self._check_not_flown(res)
        old = {(f["flight_number"], f["date"]): f["price"] for f in res["flights"]}
        new_keys = [(f["flight_number"], f["date"]) for f in flights]
        if len(set(new_keys)) != len(new_keys):
            raise ToolError("a flight appears twice")
        if res["cabin"] == "basic_economy" and set(new_keys) != set(old):
            raise ToolError("the flights of a basic economy reservation cannot be changed")
        rows = self._check_itinerary(res["origin"], res["destination"], res["flight_type"], flights)
        n = len(res["passengers"])
        prices = []
        for key, row in zip(new_keys, rows):
            if key in old and cabin == res["cabin"]:
                prices.append(old[key])  # a kept flight keeps the fare it was bought at
                continue
            if f"{key[1]}T{row[2]}" <= NOW or row[4] != "available":
                raise ToolError(f"flight {key[0]} on {key[1]} is not available")
            if row[5][cabin] < n:
                raise ToolError(f"flight {key[0]} on {key[1]} has not enough {cabin} seats")
            prices.append(row[6][cabin])
        diff = (sum(prices) - sum(old.values())) * n
        pm = self._check_payment_for_change(res["user_id"], payment_id, diff)
        with self.conn:
            self.conn.execute("DELETE FROM reservation_flights WHERE reservation_id = ?", (reservation_id,))
            for i, (key, price) in enumerate(zip(new_keys, prices)):
                self.conn.execute("INSERT INTO reservation_flights VALUES (?,?,?,?,?)", (reservation_id, i, *key, price))
            self.conn.execute("UPDATE reservations SET cabin = ? WHERE reservation_id = ?", (cabin, reservation_id))
            if diff:
                self._add_payment(reservation_id, "payment" if diff > 0 else "refund", pm[0], abs(diff))
                self._change_balance(pm[0], -diff)
        return f"flights of reservation {reservation_id} updated; fare difference {diff} dollars"

    def update_reservation_baggages(self, reservation_id: str, total_baggages: int, nonfree_baggages: int,
                                    payment_id: str) -> str:
        res = self._reservation(reservation_id)
        self._check_not_flown(res)
        if total_baggages < res["total_baggages"]:
            raise ToolError("checked bags cannot be removed")
        membership = self._user(res["user_id"])[5]
        n = len(res["passengers"])
        want = nonfree_bags(membership, res["cabin"], n, total_baggages)
        if nonfree_baggages != want:
            raise ToolError(f"nonfree_baggages should be {want} ({free_bags(membership, res['cabin'], n)} free bags "
                            "for this reservation)")
        fee = max(0, nonfree_baggages - res["nonfree_baggages"]) * BAG_FEE
        pm = self._check_payment_for_change(res["user_id"], payment_id, fee)
        with self.conn:
            self.conn.execute("UPDATE reservations SET total_baggages = ?, nonfree_baggages = ? WHERE "
                              "reservation_id = ?", (total_baggages, nonfree_baggages, reservation_id))
            if fee:
                self._add_payment(reservation_id, "payment", pm[0], fee)
                self._change_balance(pm[0], -fee)
        return f"baggage of reservation {reservation_id} updated; fee {fee} dollars"

    def update_reservation_passengers(self, reservation_id: str, passengers: list[dict]) -> str:
        res = self._reservation(reservation_id)
        self._check_not_flown(res)
        if len(passengers) != len(res["passengers"]):
            raise ToolError("the number of passengers cannot change")
        with self.conn:
            for i, p in enumerate(passengers):
                self.conn.execute("UPDATE passengers SET first_name = ?, last_name = ?, dob = ? WHERE "
                                  "reservation_id = ? AND pos = ?",
                                  (p["first_name"], p["last_name"], p["dob"], reservation_id, i))
        return f"passengers of reservation {reservation_id} updated"

    def send_certificate(self, user_id: str, amount: int) -> str:
        self._user(user_id)
        n = self.conn.execute("SELECT COUNT(*) FROM payment_methods").fetchone()[0]
        pid = "certificate_" + str(int(hashlib.sha256(f"{n}|{user_id}".encode()).hexdigest(), 16) % 9_000_000
                                   + 1_000_000)
        if self.conn.execute("SELECT 1 FROM payment_methods WHERE payment_id = ?", (pid,)).fetchone():
            raise ToolError("could not allocate a certificate id")
        with self.conn:
            self.conn.execute("INSERT INTO payment_methods VALUES (?,?,?,?,?,?)",
                              (pid, user_id, "certificate", None, None, amount))
        return f"certificate {pid} of {amount} dollars added to user {user_id}"

    # ---- other --------------------------------------------------------------------------------
    def calculate(self, expression: str) -> str:
        value = safe_calculate(expression)
        if not math.isfinite(value):  # "1e309" parses as infinity, which has no whole-number form
            raise ToolError("number too large")
        return str(int(value)) if value == int(value) else f"{value:.2f}"

    def think(self, thought: str) -> str:
        return "ok"

    def transfer_to_human_agents(self, summary: str) -> str:
        return "Transfer successful"
