"""The retail store's data: generated from a seed, stored in SQLite.

:func:`generate_world` draws users, products (with variants) and orders at the public benchmark's
scale and status mix; :class:`RetailWorld` writes them once into an in-memory SQLite database (the
*master* copy, cached per seed in the process) and hands each episode its own copy through SQLite's
backup API, which takes about a millisecond. Money is stored in integer cents so that hashes and
price differences are exact.
"""

from __future__ import annotations

import json
import random
import sqlite3
from dataclasses import dataclass, field

from .sqlite_world import SQLiteWorld, hash_tables

N_USERS = 500
N_ORDERS = 1000
STATUS_MIX = {"pending": 0.42, "delivered": 0.38, "processed": 0.10, "cancelled": 0.10}

FIRST_NAMES = [
    "noah", "emma", "liam", "olivia", "mason", "ava", "ethan", "sophia", "lucas", "mia", "yusuf",
    "amara", "omar", "chen", "mei", "raj", "priya", "ivan", "olga", "lena", "mateo", "sofia", "aiden",
    "harper", "james", "isabella", "daiki", "yuki", "fatima", "ali", "sara", "juan", "lucia", "anya",
    "kwame", "ama", "elif", "deniz", "nora", "leo",
]
LAST_NAMES = [
    "brown", "smith", "garcia", "kim", "nguyen", "patel", "silva", "muller", "rossi", "khan", "lopez",
    "ito", "wang", "novak", "ahmed", "moreno", "jensen", "santos", "cohen", "dubois", "sato", "li",
    "martin", "wilson", "clark", "lewis", "walker", "young", "hall", "allen", "wright", "scott",
    "green", "baker", "adams", "nelson", "hill", "ramos", "campbell", "mitchell",
]
STREETS = ["Oak", "Maple", "Cedar", "Pine", "Elm", "Lake", "Hill", "River", "Park", "Sunset",
           "Main", "Church", "Mill", "Spring", "Willow", "Forest"]
CITIES = [("Austin", "TX"), ("Denver", "CO"), ("Seattle", "WA"), ("Boston", "MA"), ("Phoenix", "AZ"),
          ("Chicago", "IL"), ("Portland", "OR"), ("Atlanta", "GA"), ("Miami", "FL"), ("Columbus", "OH"),
          ("Nashville", "TN"), ("San Diego", "CA"), ("Dallas", "TX"), ("Raleigh", "NC"), ("Madison", "WI")]
CARD_BRANDS = ["visa", "mastercard", "amex", "discover"]

OPTION_VALUES = {
    "color": ["red", "blue", "black", "white", "green", "grey", "yellow", "purple"],
    "size": ["XS", "S", "M", "L", "XL"],
    "material": ["cotton", "polyester", "wool", "leather", "steel", "plastic", "glass", "wood"],
    "capacity": ["350ml", "500ml", "750ml", "1L", "1.5L", "2L"],
    "storage": ["32GB", "64GB", "128GB", "256GB", "512GB"],
    "style": ["classic", "modern", "sport", "vintage", "minimal"],
    "power": ["100W", "200W", "500W", "1000W"],
    "pattern": ["plain", "striped", "dotted", "checked"],
}
# (name, option names, base price in dollars); 50 product types.
PRODUCTS = [
    ("T-Shirt", ("color", "size"), 25), ("Hoodie", ("color", "size"), 60), ("Jacket", ("material", "size"), 140),
    ("Running Shoes", ("color", "size"), 110), ("Sneakers", ("color", "style"), 90), ("Boots", ("material", "size"), 160),
    ("Water Bottle", ("capacity", "color"), 20), ("Coffee Mug", ("capacity", "pattern"), 15),
    ("Thermos", ("capacity", "material"), 35), ("Backpack", ("color", "material"), 75),
    ("Laptop Bag", ("color", "material"), 85), ("Wallet", ("color", "material"), 45),
    ("Smartphone", ("storage", "color"), 700), ("Tablet", ("storage", "color"), 450),
    ("Laptop", ("storage", "color"), 1100), ("Smart Watch", ("color", "style"), 300),
    ("Headphones", ("color", "style"), 180), ("Earbuds", ("color", "style"), 120),
    ("Bluetooth Speaker", ("color", "power"), 95), ("Desk Lamp", ("color", "power"), 40),
    ("Office Chair", ("color", "material"), 250), ("Desk", ("material", "style"), 320),
    ("Bookshelf", ("material", "style"), 180), ("Sofa", ("color", "material"), 900),
    ("Blender", ("power", "color"), 80), ("Toaster", ("color", "style"), 50),
    ("Kettle", ("capacity", "material"), 45), ("Air Fryer", ("capacity", "color"), 130),
    ("Vacuum Cleaner", ("power", "color"), 220), ("Hair Dryer", ("power", "color"), 60),
    ("Yoga Mat", ("color", "pattern"), 30), ("Dumbbells", ("material", "style"), 70),
    ("Bicycle", ("color", "size"), 600), ("Helmet", ("color", "size"), 65),
    ("Tent", ("color", "size"), 240), ("Sleeping Bag", ("color", "material"), 110),
    ("Camera", ("storage", "style"), 800), ("Tripod", ("material", "color"), 70),
    ("Keyboard", ("color", "style"), 95), ("Mouse", ("color", "style"), 40),
    ("Monitor", ("style", "color"), 330), ("Printer", ("color", "style"), 210),
    ("Sunglasses", ("color", "style"), 120), ("Scarf", ("color", "pattern"), 35),
    ("Gloves", ("material", "size"), 30), ("Socks", ("color", "pattern"), 12),
    ("Pillow", ("material", "pattern"), 40), ("Blanket", ("color", "pattern"), 70),
    ("Puzzle", ("style", "pattern"), 25), ("Board Game", ("style", "color"), 45),
]
assert len(PRODUCTS) == 50


@dataclass
class WorldData:
    """Everything the generator drew, as plain Python (the tasks are generated from it)."""

    seed: int
    users: dict[str, dict] = field(default_factory=dict)
    products: dict[str, dict] = field(default_factory=dict)
    variants: dict[str, dict] = field(default_factory=dict)
    orders: dict[str, dict] = field(default_factory=dict)
    payment_methods: dict[str, dict] = field(default_factory=dict)


def _unique_id(rng: random.Random, used: set, make) -> str:
    while True:
        value = make(rng)
        if value not in used:
            used.add(value)
            return value


def generate_world(seed: int = 0) -> WorldData:
    """Draw the store deterministically from ``seed`` (about 500 users, 1,000 orders, 50 products,
    600 variants)."""
    rng = random.Random(f"retail-world-{seed}")
    world = WorldData(seed=seed)
    used: set[str] = set()

    for name, option_names, base in PRODUCTS:
        pid = _unique_id(rng, used, lambda r: str(r.randint(10**9, 10**10 - 1)))
        combos = [(a, b) for a in OPTION_VALUES[option_names[0]] for b in OPTION_VALUES[option_names[1]]]
        n_variants = rng.randint(5, min(20, len(combos)))
        chosen = rng.sample(combos, n_variants)
        item_ids = []
        for combo in chosen:
            iid = _unique_id(rng, used, lambda r: str(r.randint(10**9, 10**10 - 1)))
            price_cents = int(round(base * 100 * rng.uniform(0.85, 1.15)))
            world.variants[iid] = {"item_id": iid, "product_id": pid, "name": name,
                                   "options": dict(zip(option_names, combo)),
                                   "available": rng.random() < 0.64, "price_cents": price_cents}
            item_ids.append(iid)
        world.products[pid] = {"product_id": pid, "name": name, "option_names": list(option_names),
                               "item_ids": item_ids}

    for _ in range(N_USERS):
        first, last = rng.choice(FIRST_NAMES), rng.choice(LAST_NAMES)
        uid = _unique_id(rng, used, lambda r, f=first, la=last: f"{f}_{la}_{r.randint(1000, 9999)}")
        city, state = rng.choice(CITIES)
        address = {"address1": f"{rng.randint(1, 999)} {rng.choice(STREETS)} Street",
                   "address2": f"Suite {rng.randint(100, 999)}", "city": city, "state": state,
                   "country": "USA", "zip": f"{rng.randint(10000, 99999)}"}
        methods = []
        kinds = rng.choice([["credit_card"], ["paypal"], ["credit_card", "gift_card"], ["paypal", "gift_card"],
                            ["credit_card", "paypal"], ["credit_card", "credit_card"],
                            ["credit_card", "paypal", "gift_card"]])
        brands = rng.sample(CARD_BRANDS, 2)
        for i, kind in enumerate(kinds):
            pm_id = _unique_id(rng, used, lambda r, k=kind: f"{k}_{r.randint(10**6, 10**7 - 1)}")
            pm = {"payment_method_id": pm_id, "user_id": uid, "source": kind, "brand": None,
                  "last_four": None, "balance_cents": None}
            if kind == "credit_card":
                pm["brand"] = brands[i % 2]
                pm["last_four"] = f"{rng.randint(0, 9999):04d}"
            elif kind == "gift_card":
                pm["balance_cents"] = rng.randint(0, 300) * 100
            world.payment_methods[pm_id] = pm
            methods.append(pm_id)
        email = f"{first}.{last}{uid[-4:]}@example.com"
        world.users[uid] = {"user_id": uid, "first_name": first.capitalize(), "last_name": last.capitalize(),
                            "email": email, "address": address, "payment_method_ids": methods, "order_ids": []}

    user_ids = list(world.users)
    owners = list(user_ids) + [rng.choice(user_ids) for _ in range(N_ORDERS - len(user_ids))]
    rng.shuffle(owners)
    statuses = list(STATUS_MIX)
    weights = list(STATUS_MIX.values())
    all_items = list(world.variants)
    for uid in owners:
        user = world.users[uid]
        oid = _unique_id(rng, used, lambda r: f"#W{r.randint(10**6, 10**7 - 1)}")
        n_items = rng.choices([1, 2, 3, 4, 5], weights=[20, 25, 25, 18, 12])[0]
        items = rng.sample(all_items, n_items)  # distinct variants; products may repeat
        status = rng.choices(statuses, weights=weights)[0]
        total = sum(world.variants[i]["price_cents"] for i in items)
        payable = [p for p in user["payment_method_ids"]
                   if world.payment_methods[p]["source"] != "gift_card"
                   or world.payment_methods[p]["balance_cents"] >= total]
        pm_id = rng.choice(payable or user["payment_method_ids"])
        payments = [{"kind": "payment", "payment_method_id": pm_id, "amount_cents": total}]
        if status == "cancelled":
            payments.append({"kind": "refund", "payment_method_id": pm_id, "amount_cents": total})
        fulfillments = []
        if status in ("processed", "delivered"):
            fulfillments.append({"tracking_id": str(rng.randint(10**11, 10**12 - 1)), "item_ids": list(items)})
        address = dict(user["address"])
        world.orders[oid] = {"order_id": oid, "user_id": uid, "address": address, "items": items,
                             "status": status, "payments": payments, "fulfillments": fulfillments,
                             "cancel_reason": "no longer needed" if status == "cancelled" else None}
        user["order_ids"].append(oid)
    return world


SCHEMA = """
CREATE TABLE users (user_id TEXT PRIMARY KEY, first_name TEXT NOT NULL, last_name TEXT NOT NULL,
    email TEXT NOT NULL UNIQUE, address1 TEXT, address2 TEXT, city TEXT, state TEXT, country TEXT, zip TEXT);
CREATE TABLE payment_methods (payment_method_id TEXT PRIMARY KEY, user_id TEXT NOT NULL REFERENCES users,
    source TEXT NOT NULL, brand TEXT, last_four TEXT, balance_cents INTEGER);
CREATE TABLE products (product_id TEXT PRIMARY KEY, name TEXT NOT NULL, option_names TEXT NOT NULL);
CREATE TABLE variants (item_id TEXT PRIMARY KEY, product_id TEXT NOT NULL REFERENCES products,
    options TEXT NOT NULL, available INTEGER NOT NULL, price_cents INTEGER NOT NULL);
CREATE TABLE orders (order_id TEXT PRIMARY KEY, user_id TEXT NOT NULL REFERENCES users,
    address1 TEXT, address2 TEXT, city TEXT, state TEXT, country TEXT, zip TEXT, status TEXT NOT NULL,
    cancel_reason TEXT, return_items TEXT, return_payment_method_id TEXT, exchange_items TEXT,
    exchange_new_items TEXT, exchange_payment_method_id TEXT);
CREATE TABLE order_items (order_id TEXT NOT NULL REFERENCES orders, pos INTEGER NOT NULL,
    item_id TEXT NOT NULL, product_id TEXT NOT NULL, price_cents INTEGER NOT NULL, PRIMARY KEY (order_id, pos));
CREATE TABLE fulfillments (order_id TEXT NOT NULL REFERENCES orders, pos INTEGER NOT NULL,
    tracking_id TEXT NOT NULL, item_ids TEXT NOT NULL, PRIMARY KEY (order_id, pos));
CREATE TABLE payments (order_id TEXT NOT NULL REFERENCES orders, pos INTEGER NOT NULL, kind TEXT NOT NULL,
    payment_method_id TEXT NOT NULL, amount_cents INTEGER NOT NULL, PRIMARY KEY (order_id, pos));
CREATE INDEX users_by_name ON users (last_name, first_name);
CREATE INDEX pm_by_user ON payment_methods (user_id);
CREATE INDEX orders_by_user ON orders (user_id);
"""

# (table, columns, ORDER BY) of the canonical dump that the state hash is taken over.
HASHED_TABLES = [(table, "*", order) for table, order in [
    ("users", "user_id"), ("payment_methods", "payment_method_id"), ("products", "product_id"),
    ("variants", "item_id"), ("orders", "order_id"), ("order_items", "order_id, pos"),
    ("fulfillments", "order_id, pos"), ("payments", "order_id, pos")]]

_ADDR = ("address1", "address2", "city", "state", "country", "zip")


def write_world(world: WorldData, conn: sqlite3.Connection) -> None:
    """Create the schema in ``conn`` and insert every record of ``world``."""
    conn.executescript(SCHEMA)
    with conn:
        conn.executemany("INSERT INTO users VALUES (?,?,?,?,?,?,?,?,?,?)", [
            (u["user_id"], u["first_name"], u["last_name"], u["email"], *(u["address"][k] for k in _ADDR))
            for u in world.users.values()])
        conn.executemany("INSERT INTO payment_methods VALUES (?,?,?,?,?,?)", [
            (p["payment_method_id"], p["user_id"], p["source"], p["brand"], p["last_four"], p["balance_cents"])
            for p in world.payment_methods.values()])
        conn.executemany("INSERT INTO products VALUES (?,?,?)", [
            (p["product_id"], p["name"], json.dumps(p["option_names"])) for p in world.products.values()])
        conn.executemany("INSERT INTO variants VALUES (?,?,?,?,?)", [
            (v["item_id"], v["product_id"], json.dumps(v["options"]), int(v["available"]), v["price_cents"])
            for v in world.variants.values()])
        conn.executemany("INSERT INTO orders (order_id, user_id, address1, address2, city, state, country, zip, "
                         "status, cancel_reason) VALUES (?,?,?,?,?,?,?,?,?,?)", [
                             (o["order_id"], o["user_id"], *(o["address"][k] for k in _ADDR), o["status"],
                              o["cancel_reason"]) for o in world.orders.values()])
        conn.executemany("INSERT INTO order_items (order_id, pos, item_id, product_id, price_cents) "
                         "VALUES (?,?,?,?,?)", [
                             (o["order_id"], i, iid, world.variants[iid]["product_id"],
                              world.variants[iid]["price_cents"])
                             for o in world.orders.values() for i, iid in enumerate(o["items"])])
        conn.executemany("INSERT INTO fulfillments VALUES (?,?,?,?)", [
            (o["order_id"], i, f["tracking_id"], json.dumps(f["item_ids"]))
            for o in world.orders.values() for i, f in enumerate(o["fulfillments"])])
        conn.executemany("INSERT INTO payments VALUES (?,?,?,?,?)", [
            (o["order_id"], i, p["kind"], p["payment_method_id"], p["amount_cents"])
            for o in world.orders.values() for i, p in enumerate(o["payments"])])


def state_hash(conn: sqlite3.Connection) -> str:
    """SHA-256 over a canonical dump of every table (all rows in primary-key order)."""
    return hash_tables(conn, HASHED_TABLES)


class RetailWorld(SQLiteWorld):
    """A generated store: the plain-Python data plus a cached master SQLite copy.

    ``RetailWorld.get(seed)`` returns the process-wide instance for a seed (generated on first use);
    :meth:`new_episode_db` returns a fresh, private in-memory copy of the master database.
    """

    generate = staticmethod(generate_world)
    write = staticmethod(write_world)
    state_hash = staticmethod(state_hash)

    def stats(self) -> dict:
        """Counts that the public benchmark's scale is compared against."""
        status: dict[str, int] = {}
        for o in self.data.orders.values():
            status[o["status"]] = status.get(o["status"], 0) + 1
        return {"users": len(self.data.users), "orders": len(self.data.orders),
                "products": len(self.data.products), "variants": len(self.data.variants),
                "available_variants": sum(v["available"] for v in self.data.variants.values()),
                "order_status": status}
