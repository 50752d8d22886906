"""Airline tasks: what a customer wants, its ground-truth tool calls and required answers.

A task is a dict like a retail one: ``task_id``, ``user_id``, ``persona``, ``requests`` (each with
``kind``, ``text``, ``actions``, ``outputs``, ``confirm_keys``, ``answer_keys``), ``actions`` and
``outputs`` (all requests' together) and ``instruction`` (the brief of an LLM-backed customer).
Requests are drawn from the world so that each is solvable (or, for a refusal, forbidden) under the
policy; a refusal's required answer is its ground ("not eligible", "basic economy").
"""

from __future__ import annotations

import random
from functools import lru_cache

from .airline_text import CABIN_WORDS, REASON_PHRASES, describe_payment, plural
from .airline_world import (
    BAG_FEE,
    CABINS,
    COMPENSATION_PER_PASSENGER,
    DATES,
    DAY_BEFORE_NOW,
    INSURANCE_FEE,
    NOW,
    TODAY,
    WorldData,
    nonfree_bags,
)
from .retail_world import FIRST_NAMES, LAST_NAMES
from .task_draw import SPLITS, draw_requests, split_draw  # noqa: F401 (SPLITS: the world's splits)

# (the rarer a request's preconditions in the world, the larger its weight)
KIND_WEIGHTS = {"cancel": 10, "change_flight": 24, "cabin": 8, "bags": 9, "passengers": 7, "book": 5,
                "compensation": 30, "total": 4, "status": 4, "cheapest": 3, "refuse_cancel": 8, "refuse_change": 20,
                "refuse_compensation": 25}


def _call(name: str, **arguments) -> dict:
    return {"name": name, "arguments": arguments}


class _Gen:
    """Draws the requests of one task from the world's plain-Python data."""

    def __init__(self, world: WorldData, rng: random.Random):
        self.w, self.rng = world, rng

    # ---- facts about the world ------------------------------------------------------------------
    def _dep(self, number: str, date: str) -> str:
        return f"{date}T{self.w.flights[number]['departure']}"

    def _status(self, number: str, date: str) -> str:
        return self.w.flight_dates[(number, date)]["status"]

    def _open(self, user: dict, used: set) -> list[dict]:
        """The user's reservations that are not cancelled, have not started and are not used yet."""
        out = []
        for rid in user["reservation_ids"]:
            r = self.w.reservations[rid]
            if rid not in used and r["status"] is None and all(
                    self._dep(f["flight_number"], f["date"]) > NOW for f in r["flights"]):
                out.append(r)
        return out

    def _airline_cancelled(self, res: dict) -> bool:
        return any(self._status(f["flight_number"], f["date"]) == "cancelled" for f in res["flights"])

    def cancel_grounds(self, res: dict) -> list[str]:
        """The reasons under which the policy lets ``res`` be cancelled."""
        if res["created_at"] > DAY_BEFORE_NOW or res["cabin"] == "business":
            return list(REASON_PHRASES)
        out = ["health", "weather"] if res["insurance"] == "yes" else []
        return out + (["airline cancelled flight"] if self._airline_cancelled(res) else [])

    def _payer(self, user: dict, due: int, state: dict, certificate: bool = False) -> dict | None:
        """A payment method of the user that can pay ``due`` (a gift card or certificate once per task)."""
        pms = [self.w.payment_methods[p] for p in user["payment_ids"]]
        cards = [p for p in pms if p["source"] == "credit_card"]
        ok = [p for p in pms if p["source"] == "credit_card" and sum(
            c["brand"] == p["brand"] and c["last_four"] == p["last_four"] for c in cards) == 1]
        ok += [p for p in pms if (p["source"] == "gift_card" or certificate and p["source"] == "certificate")
               and p["amount"] >= max(due, 0) and p["payment_id"] not in state["balances"]]
        if not ok:
            return None
        pm = self.rng.choice(ok)
        if pm["source"] != "credit_card":
            state["balances"].add(pm["payment_id"])
        return pm

    def _alternative(self, res: dict) -> tuple[str, str] | None:
        """Another bookable flight on the route of a one-flight reservation: (number, date)."""
        f = self.w.flights[res["flights"][0]["flight_number"]]
        n = len(res["passengers"])
        options = [(num, d) for num, g in self.w.flights.items() if (g["origin"], g["destination"]) == (
            f["origin"], f["destination"]) for d in DATES if d > TODAY and d != res["flights"][0]["date"]
            and self._status(num, d) == "available" and self.w.flight_dates[(num, d)]["seats"][res["cabin"]] >= n]
        return self.rng.choice(options) if options else None

    # ---- requests -------------------------------------------------------------------------------
    def request(self, kind: str, user: dict, used: set, state: dict) -> dict | None:
        rng, w = self.rng, self.w
        uid = user["user_id"]
        if kind in ("cancel", "refuse_cancel"):
            choices = []
            for r in self._open(user, used):
                grounds = self.cancel_grounds(r)
                reasons = grounds if kind == "cancel" else [x for x in REASON_PHRASES if x not in grounds]
                choices += [(r, x) for x in reasons]
            if not choices:
                return None
            r, reason = rng.choice(choices)
            rid = r["reservation_id"]
            req = {"kind": kind, "reservation_id": rid,
                   "text": f"Please cancel reservation {rid} because {REASON_PHRASES[reason]}."}
            if kind == "cancel":
                return {**req, "actions": [_call("cancel_reservation", reservation_id=rid, reason=reason)],
                        "confirm_keys": [rid]}
            return {**req, "actions": [], "outputs": ["not eligible"], "answer_keys": ["not eligible"]}
        if kind in ("change_flight", "refuse_change"):
            rng.shuffle(candidates := [r for r in self._open(user, used) if len(r["flights"]) == 1
                                       and (r["cabin"] == "basic_economy") == (kind == "refuse_change")])
            for r in candidates:
                alt = self._alternative(r)
                if alt is None:
                    continue
                n, rid = len(r["passengers"]), r["reservation_id"]
                diff = (w.flight_dates[alt]["prices"][r["cabin"]] - r["flights"][0]["price"]) * n
                pm = self._payer(user, diff, state)
                if pm is None:
                    continue
                text = (f"Please move reservation {rid} to flight {alt[0]} on {alt[1]} and pay any difference "
                        f"with my {describe_payment(pm)}.")
                if kind == "refuse_change":
                    return {"kind": kind, "reservation_id": rid, "text": text, "actions": [],
                            "outputs": ["basic economy"], "answer_keys": ["basic economy"]}
                return {"kind": kind, "reservation_id": rid, "text": text, "confirm_keys": [rid, *alt, pm["payment_id"]],
                        "actions": [_call("update_reservation_flights", reservation_id=rid, cabin=r["cabin"],
                                          flights=[{"flight_number": alt[0], "date": alt[1]}],
                                          payment_id=pm["payment_id"])]}
            return None
        if kind == "cabin":
            rng.shuffle(candidates := self._open(user, used))
            for r in candidates:
                cabin = rng.choice([c for c in CABINS if c != r["cabin"]])
                n, rid = len(r["passengers"]), r["reservation_id"]
                legs = [w.flight_dates[(f["flight_number"], f["date"])] for f in r["flights"]]
                if any(g["status"] != "available" or g["seats"][cabin] < n for g in legs):
                    continue
                diff = (sum(g["prices"][cabin] for g in legs) - sum(f["price"] for f in r["flights"])) * n
                pm = self._payer(user, diff, state)
                if pm is None:
                    continue
                return {"kind": kind, "reservation_id": rid, "confirm_keys": [rid, cabin, pm["payment_id"]],
                        "text": f"Please change the cabin of reservation {rid} to {CABIN_WORDS[cabin]} and pay any "
                                f"difference with my {describe_payment(pm)}.",
                        "actions": [_call("update_reservation_flights", reservation_id=rid, cabin=cabin,
                                          flights=[{"flight_number": f["flight_number"], "date": f["date"]}
                                                   for f in r["flights"]], payment_id=pm["payment_id"])]}
            return None
        if kind == "bags":
            rng.shuffle(candidates := self._open(user, used))
            for r in candidates:
                add, n, rid = rng.choice([1, 1, 2, 3]), len(r["passengers"]), r["reservation_id"]
                total = r["total_baggages"] + add
                nonfree = nonfree_bags(user["membership"], r["cabin"], n, total)
                fee = (nonfree - r["nonfree_baggages"]) * BAG_FEE
                pm = self._payer(user, fee, state)
                if pm is None:
                    continue
                return {"kind": kind, "reservation_id": rid, "outputs": [str(fee)], "confirm_keys": [rid, pm["payment_id"]],
                        "text": f"Please add {plural(add, 'checked bag')} to reservation {rid} and pay with my "
                                f"{describe_payment(pm)}. How much will it cost?",
                        "actions": [_call("update_reservation_baggages", reservation_id=rid, total_baggages=total,
                                          nonfree_baggages=nonfree, payment_id=pm["payment_id"])]}
            return None
        if kind == "passengers":
            rng.shuffle(candidates := self._open(user, used))
            for r in candidates:
                names = [(p["first_name"], p["last_name"]) for p in r["passengers"]]
                i = rng.randrange(len(names))
                if names.count(names[i]) > 1:
                    continue
                new = {"first_name": rng.choice(FIRST_NAMES).capitalize(), "last_name": rng.choice(LAST_NAMES).capitalize(),
                       "dob": f"{rng.randint(1950, 2015)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"}
                if (new["first_name"], new["last_name"]) in names:
                    continue
                rid = r["reservation_id"]
                passengers = [dict(p) for p in r["passengers"]]
                passengers[i] = new
                return {"kind": kind, "reservation_id": rid,
                        "confirm_keys": [rid, new["first_name"], new["last_name"], new["dob"]],
                        "text": f"Please change passenger {' '.join(names[i])} on reservation {rid} to "
                                f"{new['first_name']} {new['last_name']}, born {new['dob']}.",
                        "actions": [_call("update_reservation_passengers", reservation_id=rid, passengers=passengers)]}
            return None
        if kind == "book":
            if state["booked"]:
                return None
            number = rng.choice(list(w.flights))
            date, cabin = rng.choice([d for d in DATES if d > TODAY]), rng.choice(CABINS)
            slot, f = w.flight_dates[(number, date)], w.flights[number]
            if slot["status"] != "available" or slot["seats"][cabin] < 1:
                return None
            bags, insurance = rng.choice([0, 0, 1, 2, 3]), rng.choice(["yes", "no"])
            nonfree = nonfree_bags(user["membership"], cabin, 1, bags)
            total = slot["prices"][cabin] + nonfree * BAG_FEE + (INSURANCE_FEE if insurance == "yes" else 0)
            pm = self._payer(user, total, state, certificate=True)
            if pm is None:
                return None
            state["booked"] = True
            me = {"first_name": user["first_name"], "last_name": user["last_name"], "dob": user["dob"]}
            return {"kind": kind, "reservation_id": None, "outputs": [str(total)],
                    "confirm_keys": [number, date, pm["payment_id"], str(total)],
                    "text": f"Please book a one-way {CABIN_WORDS[cabin]} ticket from {f['origin']} to "
                            f"{f['destination']} on {date}, flight {number}, for me, with {plural(bags, 'checked bag')} "
                            f"and {'' if insurance == 'yes' else 'no '}travel insurance, paid with my "
                            f"{describe_payment(pm)}. What is the total?",
                    "actions": [_call("book_reservation", user_id=uid, origin=f["origin"], destination=f["destination"],
                                      flight_type="one_way", cabin=cabin, flights=[{"flight_number": number, "date": date}],
                                      passengers=[me], payment_methods=[{"payment_id": pm["payment_id"], "amount": total}],
                                      total_baggages=bags, nonfree_baggages=nonfree, insurance=insurance)]}
        if kind in ("compensation", "refuse_compensation"):
            if state["certificate"]:
                return None
            choices = []
            for rid in user["reservation_ids"]:
                r = w.reservations[rid]
                eligible = user["membership"] != "regular" or r["insurance"] == "yes" or r["cabin"] == "business"
                if rid not in used and r["status"] is None and eligible == (kind == "compensation"):
                    choices += [(r, f) for f in r["flights"] if self._status(f["flight_number"], f["date"]) == "cancelled"]
            if not choices:
                return None
            r, f = rng.choice(choices)
            rid, amount = r["reservation_id"], COMPENSATION_PER_PASSENGER * len(r["passengers"])
            req = {"kind": kind, "reservation_id": rid,
                   "text": f"The airline cancelled flight {f['flight_number']} on {f['date']} of my reservation {rid}. "
                           "I would like some compensation."}
            if kind == "refuse_compensation":
                return {**req, "actions": [], "outputs": ["not eligible"], "answer_keys": ["not eligible"]}
            state["certificate"] = True
            return {**req, "confirm_keys": [str(amount)],
                    "actions": [_call("send_certificate", user_id=uid, amount=amount)]}
        return self.lookup(kind, user, used)

    def lookup(self, kind: str, user: dict, used: set) -> dict | None:
        """A question with one required answer and no change to the database."""
        rng, w = self.rng, self.w
        mine = [w.reservations[r] for r in user["reservation_ids"] if r not in used]
        if kind == "total":
            mine = [r for r in mine if r["status"] is None]
            if not mine:
                return None
            r = rng.choice(mine)
            paid = sum(p["amount"] if p["kind"] == "payment" else -p["amount"] for p in r["payments"])
            answer, text = str(paid), f"How much have I paid in total for reservation {r['reservation_id']}?"
        elif kind == "status":
            if not mine:
                return None
            f = rng.choice(rng.choice(mine)["flights"])
            answer = self._status(f["flight_number"], f["date"])
            text = f"What is the status of flight {f['flight_number']} on {f['date']}?"
            flight = {"flight_number": f["flight_number"], "date": f["date"]}
        elif kind == "cheapest":
            f = w.flights[rng.choice(list(w.flights))]
            date = rng.choice([d for d in DATES if d > TODAY])
            fares = [w.flight_dates[(n, date)]["prices"]["economy"] for n, g in w.flights.items()
                     if (g["origin"], g["destination"]) == (f["origin"], f["destination"])
                     and self._status(n, date) == "available" and w.flight_dates[(n, date)]["seats"]["economy"] > 0]
            if not fares:
                return None
            answer = str(min(fares))
            text = (f"What is the cheapest economy fare on a direct flight from {f['origin']} to {f['destination']} "
                    f"on {date}?")
        else:
            raise ValueError(kind)
        return {"kind": kind, "reservation_id": None, "text": text, "actions": [], "outputs": [answer],
                "answer_keys": [answer], **(flight if kind == "status" else {})}


def _instruction(persona: dict, requests: list[dict]) -> str:
    asks = " Then: ".join(r["text"] for r in requests)
    return (f"You are {persona['first_name']} {persona['last_name']}; your user id is {persona['user_id']}. Give it "
            f"only when asked. Your requests, one at a time: {asks} Say yes only to a confirmation that matches your "
            "request. When everything is done, end with ###STOP###.")


def generate_tasks(world: WorldData, split: str, n_tasks: int | None = None) -> list[dict]:
    """The split's tasks, deterministic in the world's seed: ``"train"`` (600) and ``"test"`` (120)
    over disjoint users; ``"synthetic"`` (10,000, the oracle's expert data for SFT) a separate draw
    over the training users only."""
    n_tasks, pool, rng = split_draw(world, split, n_tasks, "airline")
    gen = _Gen(world, rng)
    tasks: list[dict] = []
    while len(tasks) < n_tasks:
        user = world.users[rng.choice(pool)]
        state = {"balances": set(), "booked": False, "certificate": False}
        requests = draw_requests(gen, rng, KIND_WEIGHTS, user, state, "reservation_id")
        if not requests:
            continue
        persona = {"user_id": user["user_id"], "first_name": user["first_name"], "last_name": user["last_name"]}
        tasks.append({"task_id": f"{split}-{len(tasks):04d}", "user_id": user["user_id"], "persona": persona,
                      "requests": requests, "actions": [a for r in requests for a in r["actions"]],
                      "outputs": [o for r in requests for o in r["outputs"]],
                      "instruction": _instruction(persona, requests)})
    return tasks


@lru_cache(maxsize=8)
def _tasks_cached(seed: int, split: str) -> tuple:
    from .airline_world import AirlineWorld

    return tuple(generate_tasks(AirlineWorld.get(seed).data, split))


def get_tasks(seed: int, split: str) -> tuple:
    """The (cached) tasks of a world seed and split; treat them as read-only."""
    return _tasks_cached(seed, split)
