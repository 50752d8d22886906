"""The airline's data: generated from a seed, stored in SQLite.

:func:`generate_world` draws airports, about 300 flight numbers flown every day of one month (with
a status, free seats and a price per cabin on each date), about 500 users (membership level,
credit cards, gift cards, travel certificates) and about 2,000 reservations (passengers, flights,
baggage, insurance, payments). :class:`AirlineWorld` writes them once into an in-memory SQLite
master and hands each episode a private copy through SQLite's backup API. Money is in whole
dollars (every fare, fee and balance is whole), stored as integers so that hashes are exact.

The world has a clock: it is :data:`NOW`. Flights before it have flown (``landed``, or ``flying``
right now); flights after it are ``available`` for booking unless the airline has ``cancelled`` or
``delayed`` them.
"""

from __future__ import annotations

import random
import sqlite3
from dataclasses import dataclass, field

from .retail_world import FIRST_NAMES, LAST_NAMES
from .sqlite_world import SQLiteWorld, hash_tables

N_USERS = 500
N_FLIGHTS = 300
N_RESERVATIONS = 2000
DATES = [f"2024-06-{d:02d}" for d in range(1, 31)]
TODAY = "2024-06-15"
NOW = "2024-06-15T15:00:00"
DAY_BEFORE_NOW = "2024-06-14T15:00:00"  # bookings made after this can be cancelled for any reason
CABINS = ("basic_economy", "economy", "business")
MEMBERSHIPS = ("regular", "silver", "gold")
# free checked bags per passenger, by the booking user's membership and the cabin
FREE_BAGS = {"regular": {"basic_economy": 0, "economy": 1, "business": 2},
             "silver": {"basic_economy": 1, "economy": 2, "business": 3},
             "gold": {"basic_economy": 2, "economy": 3, "business": 4}}
BAG_FEE = 50
INSURANCE_FEE = 30
COMPENSATION_PER_PASSENGER = 100
CARD_BRANDS = ["visa", "mastercard", "amex", "discover"]
AIRPORTS = [("ATL", "Atlanta"), ("BOS", "Boston"), ("CLT", "Charlotte"), ("DEN", "Denver"), ("DFW", "Dallas"),
            ("DTW", "Detroit"), ("EWR", "Newark"), ("IAH", "Houston"), ("JFK", "New York"), ("LAS", "Las Vegas"),
            ("LAX", "Los Angeles"), ("MCO", "Orlando"), ("MIA", "Miami"), ("MSP", "Minneapolis"),
            ("ORD", "Chicago"), ("PHL", "Philadelphia"), ("PHX", "Phoenix"), ("SEA", "Seattle"),
            ("SFO", "San Francisco"), ("SLC", "Salt Lake City")]


def free_bags(membership: str, cabin: str, passengers: int) -> int:
    """Checked bags that cost nothing on a reservation."""
    return FREE_BAGS[membership][cabin] * passengers


def nonfree_bags(membership: str, cabin: str, passengers: int, total: int) -> int:
    return max(0, total - free_bags(membership, cabin, passengers))


@dataclass
class WorldData:
    """Everything the generator drew, as plain Python (the tasks are generated from it)."""

    seed: int
    flights: dict[str, dict] = field(default_factory=dict)  # flight number -> route and times
    flight_dates: dict[tuple[str, str], dict] = field(default_factory=dict)  # (number, date) -> status...
    users: dict[str, dict] = field(default_factory=dict)
    payment_methods: dict[str, dict] = field(default_factory=dict)
    reservations: dict[str, dict] = field(default_factory=dict)


def _unique(rng: random.Random, used: set, make) -> str:
    while True:
        value = make(rng)
        if value not in used:
            used.add(value)
            return value


def _hhmm(minutes: int) -> str:
    return f"{minutes // 60:02d}:{minutes % 60:02d}:00"


def flown(flight: dict, date: str) -> bool:
    """Whether a flight on ``date`` has left already (at the world's clock)."""
    return f"{date}T{flight['departure']}" <= NOW


def _status(rng: random.Random, flight: dict, date: str) -> str:
    if date < TODAY:
        return "cancelled" if rng.random() < 0.04 else "landed"
    if date == TODAY:
        if flown(flight, date):
            return "landed" if f"{date}T{flight['arrival']}" <= NOW else "flying"
        return rng.choices(["on time", "delayed", "cancelled"], [80, 12, 8])[0]
    if date <= "2024-06-18":
        return rng.choices(["available", "delayed", "cancelled"], [84, 6, 10])[0]
    return "available"


def _draw_flights(rng: random.Random, world: WorldData, used: set) -> None:
    codes = [a for a, _ in AIRPORTS]
    for _ in range(N_FLIGHTS):
        number = _unique(rng, used, lambda r: f"SF{r.randint(100, 999)}")
        origin, dest = rng.sample(codes, 2)
        dep = rng.randrange(5 * 60, 18 * 60, 15)
        arr = dep + rng.randrange(60, 5 * 60, 15)
        base = rng.randint(110, 460)
        flight = {"flight_number": number, "origin": origin, "destination": dest, "departure": _hhmm(dep),
                  "arrival": _hhmm(arr)}
        world.flights[number] = flight
        for date in DATES:
            economy = int(base * rng.uniform(0.8, 1.25))
            world.flight_dates[(number, date)] = {
                "status": _status(rng, flight, date),
                "seats": {"basic_economy": rng.randint(0, 20), "economy": rng.randint(0, 30),
                          "business": rng.randint(0, 12)},
                "prices": {"basic_economy": int(economy * rng.uniform(0.5, 0.7)), "economy": economy,
                           "business": int(economy * rng.uniform(2.2, 3.4))}}


def _draw_users(rng: random.Random, world: WorldData, used: set) -> None:
    for _ in range(N_USERS):
        first, last = rng.choice(FIRST_NAMES), rng.choice(LAST_NAMES)
        uid = _unique(rng, used, lambda r, f=first, la=last: f"{f}_{la}_{r.randint(1000, 9999)}")
        dob = f"{rng.randint(1950, 2004)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
        methods = []
        kinds = ["credit_card"] * rng.choice([1, 1, 2]) + ["gift_card"] * rng.choice([0, 1, 1, 2]) \
            + ["certificate"] * rng.choice([0, 0, 1, 2])
        for kind in kinds:
            pid = _unique(rng, used, lambda r, k=kind: f"{k}_{r.randint(10**6, 10**7 - 1)}")
            pm = {"payment_id": pid, "user_id": uid, "source": kind, "brand": None, "last_four": None, "amount": None}
            if kind == "credit_card":
                pm["brand"], pm["last_four"] = rng.choice(CARD_BRANDS), f"{rng.randint(0, 9999):04d}"
            elif kind == "gift_card":
                pm["amount"] = rng.randint(0, 400)
            else:
                pm["amount"] = rng.choice([100, 150, 250, 500])
            world.payment_methods[pid] = pm
            methods.append(pid)
        world.users[uid] = {"user_id": uid, "first_name": first.capitalize(), "last_name": last.capitalize(),
                            "dob": dob, "email": f"{first}.{last}{uid[-4:]}@example.com",
                            "membership": rng.choices(MEMBERSHIPS, [50, 30, 20])[0],
                            "payment_ids": methods, "reservation_ids": []}


def _connections(world: WorldData) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for f in world.flights.values():
        out.setdefault(f["origin"], []).append(f["flight_number"])
    return out


def _itinerary(rng: random.Random, world: WorldData, by_origin: dict, origin: str, dest: str | None,
               date: str) -> list[str] | None:
    """Flight numbers from ``origin`` (to ``dest`` when given): direct, or one stop on the same day."""
    firsts = by_origin.get(origin, [])
    direct = [f for f in firsts if dest is None or world.flights[f]["destination"] == dest]
    if direct and (dest is not None or rng.random() < 0.7):
        return [rng.choice(direct)]
    legs = []
    for f in firsts:
        a = world.flights[f]
        for g in by_origin.get(a["destination"], []):
            b = world.flights[g]
            if b["destination"] != origin and (dest is None or b["destination"] == dest) \
                    and b["departure"] >= _hhmm(int(a["arrival"][:2]) * 60 + int(a["arrival"][3:5]) + 60):
                legs.append([f, g])
    return rng.choice(legs) if legs else None


def _draw_reservations(rng: random.Random, world: WorldData, used: set) -> None:
    by_origin = _connections(world)
    owners = list(world.users) + [rng.choice(list(world.users)) for _ in range(N_RESERVATIONS - N_USERS)]
    rng.shuffle(owners)
    letters = "ABCDEFGHJKLMNPQRSTUVWXYZ23456789"
    for uid in owners:
        user = world.users[uid]
        origin = rng.choice([a for a, _ in AIRPORTS])
        day = rng.randrange(len(DATES) - 1)
        out = _itinerary(rng, world, by_origin, origin, None, DATES[day])
        if out is None:
            continue
        dest = world.flights[out[-1]]["destination"]
        segments = [(f, DATES[day]) for f in out]
        flight_type = "one_way"
        if rng.random() < 0.45:
            back_day = min(len(DATES) - 1, day + rng.randint(1, 6))
            back = _itinerary(rng, world, by_origin, dest, origin, DATES[back_day])
            if back is not None:
                segments += [(f, DATES[back_day]) for f in back]
                flight_type = "round_trip"
        cabin = rng.choices(CABINS, [30, 45, 25])[0]
        n_pass = rng.choices([1, 2, 3], [60, 30, 10])[0]
        passengers = []
        if rng.random() < 0.75:
            passengers.append({"first_name": user["first_name"], "last_name": user["last_name"], "dob": user["dob"]})
        while len(passengers) < n_pass:
            passengers.append({"first_name": rng.choice(FIRST_NAMES).capitalize(),
                               "last_name": rng.choice(LAST_NAMES).capitalize(),
                               "dob": f"{rng.randint(1950, 2020)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"})
        first_dep = f"{segments[0][1]}T{world.flights[segments[0][0]]['departure']}"
        latest = min(first_dep, NOW)
        if first_dep > NOW and rng.random() < 0.1:  # booked within the last day: cancellable for any reason
            hours = rng.randint(0, 23)
            created = f"2024-06-{14 + (hours >= 9):02d}T{(15 + hours) % 24:02d}:{rng.randint(0, 59):02d}:00"
        else:
            day_made = rng.randint(1, max(1, int(latest[8:10]) - 1))
            created = f"{'2024-05' if rng.random() < 0.4 else '2024-06'}-{day_made:02d}T" \
                      f"{rng.randint(6, 22):02d}:{rng.randint(0, 59):02d}:00"
        prices = [world.flight_dates[(f, d)]["prices"][cabin] for f, d in segments]
        total_bags = rng.choices([0, 1, 2, 3, 4], [30, 30, 20, 12, 8])[0]
        nonfree = nonfree_bags(user["membership"], cabin, n_pass, total_bags)
        insurance = "yes" if rng.random() < 0.35 else "no"
        total = sum(prices) * n_pass + nonfree * BAG_FEE + (INSURANCE_FEE * n_pass if insurance == "yes" else 0)
        cards = [p for p in user["payment_ids"] if world.payment_methods[p]["source"] == "credit_card"]
        gifts = [p for p in user["payment_ids"] if world.payment_methods[p]["source"] == "gift_card"]
        payments = []
        if gifts and rng.random() < 0.25:
            part = min(total, rng.randint(20, 200))
            payments.append({"kind": "payment", "payment_id": rng.choice(gifts), "amount": part})
            if total > part:
                payments.append({"kind": "payment", "payment_id": rng.choice(cards), "amount": total - part})
        else:
            payments.append({"kind": "payment", "payment_id": rng.choice(cards), "amount": total})
        status = None
        if rng.random() < 0.07:
            status = "cancelled"
            payments += [{"kind": "refund", "payment_id": p["payment_id"], "amount": p["amount"]} for p in list(payments)]
        rid = _unique(rng, used, lambda r: "".join(r.choice(letters) for _ in range(6)))
        world.reservations[rid] = {
            "reservation_id": rid, "user_id": uid, "origin": origin, "destination": dest,
            "flight_type": flight_type, "cabin": cabin, "created_at": created, "total_baggages": total_bags,
            "nonfree_baggages": nonfree, "insurance": insurance, "status": status, "passengers": passengers,
            "flights": [{"flight_number": f, "date": d, "price": p} for (f, d), p in zip(segments, prices)],
            "payments": payments}
        user["reservation_ids"].append(rid)


def generate_world(seed: int = 0) -> WorldData:
    """Draw the airline deterministically from ``seed``."""
    rng = random.Random(f"airline-world-{seed}")
    world = WorldData(seed=seed)
    used: set[str] = set()
    _draw_flights(rng, world, used)
    _draw_users(rng, world, used)
    _draw_reservations(rng, world, used)
    return world


SCHEMA = """
CREATE TABLE airports (code TEXT PRIMARY KEY, city TEXT NOT NULL);
CREATE TABLE flights (flight_number TEXT PRIMARY KEY, origin TEXT NOT NULL, destination TEXT NOT NULL,
    departure TEXT NOT NULL, arrival TEXT NOT NULL);
CREATE TABLE flight_dates (flight_number TEXT NOT NULL REFERENCES flights, date TEXT NOT NULL, status TEXT NOT NULL,
    seats_basic_economy INTEGER NOT NULL, seats_economy INTEGER NOT NULL, seats_business INTEGER NOT NULL,
    price_basic_economy INTEGER NOT NULL, price_economy INTEGER NOT NULL, price_business INTEGER NOT NULL,
    PRIMARY KEY (flight_number, date));
CREATE TABLE users (user_id TEXT PRIMARY KEY, first_name TEXT NOT NULL, last_name TEXT NOT NULL, dob TEXT NOT NULL,
    email TEXT NOT NULL, membership TEXT NOT NULL);
CREATE TABLE payment_methods (payment_id TEXT PRIMARY KEY, user_id TEXT NOT NULL REFERENCES users,
    source TEXT NOT NULL, brand TEXT, last_four TEXT, amount INTEGER);
CREATE TABLE reservations (reservation_id TEXT PRIMARY KEY, user_id TEXT NOT NULL REFERENCES users,
    origin TEXT NOT NULL, destination TEXT NOT NULL, flight_type TEXT NOT NULL, cabin TEXT NOT NULL,
    created_at TEXT NOT NULL, total_baggages INTEGER NOT NULL, nonfree_baggages INTEGER NOT NULL,
    insurance TEXT NOT NULL, status TEXT);
CREATE TABLE reservation_flights (reservation_id TEXT NOT NULL REFERENCES reservations, pos INTEGER NOT NULL,
    flight_number TEXT NOT NULL, date TEXT NOT NULL, price INTEGER NOT NULL, PRIMARY KEY (reservation_id, pos));
CREATE TABLE passengers (reservation_id TEXT NOT NULL REFERENCES reservations, pos INTEGER NOT NULL,
    first_name TEXT NOT NULL, last_name TEXT NOT NULL, dob TEXT NOT NULL, PRIMARY KEY (reservation_id, pos));
CREATE TABLE payments (reservation_id TEXT NOT NULL REFERENCES reservations, pos INTEGER NOT NULL,
    kind TEXT NOT NULL, payment_id TEXT NOT NULL, amount INTEGER NOT NULL, PRIMARY KEY (reservation_id, pos));
CREATE INDEX flights_by_route ON flights (origin, destination);
CREATE INDEX pm_by_user ON payment_methods (user_id);
CREATE INDEX reservations_by_user ON reservations (user_id);
"""

# (table, columns, ORDER BY) of the canonical dump that the state hash is taken over. Of the 9,000
# flight dates only the seats can change (no tool inserts or deletes one): hashing those columns in
# rowid order keeps grading fast.
HASHED_TABLES = [("flights", "*", "flight_number"),
                 ("flight_dates", "seats_basic_economy, seats_economy, seats_business", "rowid"),
                 ("users", "*", "user_id"), ("payment_methods", "*", "payment_id"),
                 ("reservations", "*", "reservation_id"), ("reservation_flights", "*", "reservation_id, pos"),
                 ("passengers", "*", "reservation_id, pos"), ("payments", "*", "reservation_id, pos")]


def write_world(world: WorldData, conn: sqlite3.Connection) -> None:
    """Create the schema in ``conn`` and insert every record of ``world``."""
    conn.executescript(SCHEMA)
    with conn:
        conn.executemany("INSERT INTO airports VALUES (?,?)", AIRPORTS)
        conn.executemany("INSERT INTO flights VALUES (?,?,?,?,?)", [
            (f["flight_number"], f["origin"], f["destination"], f["departure"], f["arrival"])
            for f in world.flights.values()])
        conn.executemany("INSERT INTO flight_dates VALUES (?,?,?,?,?,?,?,?,?)", [
            (n, d, v["status"], *(v["seats"][c] for c in CABINS), *(v["prices"][c] for c in CABINS))
            for (n, d), v in world.flight_dates.items()])
        conn.executemany("INSERT INTO users VALUES (?,?,?,?,?,?)", [
            (u["user_id"], u["first_name"], u["last_name"], u["dob"], u["email"], u["membership"])
            for u in world.users.values()])
        conn.executemany("INSERT INTO payment_methods VALUES (?,?,?,?,?,?)", [
            (p["payment_id"], p["user_id"], p["source"], p["brand"], p["last_four"], p["amount"])
            for p in world.payment_methods.values()])
        res = world.reservations.values()
        conn.executemany("INSERT INTO reservations VALUES (?,?,?,?,?,?,?,?,?,?,?)", [
            (r["reservation_id"], r["user_id"], r["origin"], r["destination"], r["flight_type"], r["cabin"],
             r["created_at"], r["total_baggages"], r["nonfree_baggages"], r["insurance"], r["status"]) for r in res])
        conn.executemany("INSERT INTO reservation_flights VALUES (?,?,?,?,?)", [
            (r["reservation_id"], i, f["flight_number"], f["date"], f["price"])
            for r in res for i, f in enumerate(r["flights"])])
        conn.executemany("INSERT INTO passengers VALUES (?,?,?,?,?)", [
            (r["reservation_id"], i, p["first_name"], p["last_name"], p["dob"])
            for r in res for i, p in enumerate(r["passengers"])])
        conn.executemany("INSERT INTO payments VALUES (?,?,?,?,?)", [
            (r["reservation_id"], i, p["kind"], p["payment_id"], p["amount"])
            for r in res for i, p in enumerate(r["payments"])])


def state_hash(conn: sqlite3.Connection) -> str:
    """SHA-256 over a canonical dump of every table that a tool can change or read."""
    return hash_tables(conn, HASHED_TABLES)


class AirlineWorld(SQLiteWorld):
    """A generated airline: the plain-Python data plus a cached master SQLite copy (one per seed)."""

    generate = staticmethod(generate_world)
    write = staticmethod(write_world)
    state_hash = staticmethod(state_hash)

    def stats(self) -> dict:
        """Counts that the public benchmark's scale is compared against."""
        d = self.data
        count = lambda values: {k: sum(v == k for v in values) for k in sorted(set(values), key=str)}  # noqa: E731
        return {"users": len(d.users), "flights": len(d.flights), "flight_dates": len(d.flight_dates),
                "reservations": len(d.reservations),
                "membership": count([u["membership"] for u in d.users.values()]),
                "cabin": count([r["cabin"] for r in d.reservations.values()]),
                "flight_type": count([r["flight_type"] for r in d.reservations.values()]),
                "status": count([v["status"] for v in d.flight_dates.values()])}
