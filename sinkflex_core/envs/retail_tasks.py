"""Retail tasks: what a customer wants, its ground-truth tool calls and required outputs.

The customer's requests use a small set of sentence templates (short and regular, so that a
tiny model can learn the conversations); :func:`parse_request` and :func:`parse_identity` read them
back, and are what the oracle agent uses: it never sees the task itself.

A task is a dict: ``task_id``, ``user_id``, ``identify_by`` ("email" or "name_zip"), ``persona``,
``requests`` (each with ``kind``, ``text``, ``actions``, ``outputs``, ``confirm_keys``,
``answer_keys``), ``actions`` and ``outputs`` (all requests' together) and ``instruction`` (the
customer's brief, for an LLM-backed customer).
"""

from __future__ import annotations

import random
import re
from functools import lru_cache

from .retail_world import CITIES, STREETS, WorldData
from .task_draw import SPLITS, draw_requests, split_draw  # noqa: F401 (SPLITS: the world's splits)

REASON_PHRASES = {"no longer needed": "I no longer need it", "ordered by mistake": "I ordered it by mistake"}
WRITE_KINDS = ("cancel", "order_address", "user_address", "payment", "items", "return", "exchange")
KIND_WEIGHTS = {"cancel": 12, "order_address": 9, "user_address": 4, "payment": 16, "items": 12, "return": 12,
                "exchange": 12, "status": 4, "total": 4, "refuse": 19}


# ---- text templates and their parsers ----------------------------------------------------------

def describe_payment_method(pm: dict) -> str:
    """How a customer names a payment method: "gift card", "paypal account", "visa card ending in 1234"."""
    if pm["source"] == "gift_card":
        return "gift card"
    if pm["source"] == "paypal":
        return "paypal account"
    return f"{pm['brand']} card ending in {pm['last_four']}"


def describe_item(name: str, options: dict) -> str:
    return f"the {name} ({', '.join(options.values())})"


def format_address(addr: dict) -> str:
    return ", ".join(addr[k] for k in ("address1", "address2", "city", "state", "country", "zip"))


# The answers of status and refusal requests come from this small set. A message that names several
# of them answers nothing: "pending, processed, delivered or cancelled" would otherwise pass every
# status question without looking anything up (a loophole that reinforcement learning finds).
ANSWER_LABELS = ("pending", "processed", "delivered", "cancelled", "not available")
_LABEL_RE = {label: re.compile(rf"\b{re.escape(label)}\b") for label in ANSWER_LABELS}


_NUMBER_RE = re.compile(r"\d+(?:\.\d+)?")


def answer_given(answer: str, text: str) -> bool:
    """Whether the agent's message ``text`` gives ``answer``: it contains it (case and commas
    ignored); an answer of :data:`ANSWER_LABELS` must be there as a word, and no other of them; a
    number must be there as a whole number ("11067.45" and "1067.456" do not give 1067.45)."""
    low, want = text.lower().replace(",", ""), answer.lower().replace(",", "")
    if want in _LABEL_RE:  # as a word ("undelivered" is not "delivered"), and alone
        return bool(_LABEL_RE[want].search(low)) and not any(
            rx.search(low) for label, rx in _LABEL_RE.items() if label != want)
    if _NUMBER_RE.fullmatch(want):
        # no digit (nor a digit and a decimal point) may touch it on either side
        return re.search(rf"(?<!\d)(?<!\d\.){re.escape(want)}(?!\d)(?!\.\d)", low) is not None
    return want in low


def mentions(key: str, text: str) -> bool:
    """Whether ``text`` names ``key`` (an id, a zip code, an address) as a whole token, case ignored:
    "#W12345678" does not name order #W1234567, nor "1202 Oak Street" the address 202 Oak Street."""
    return re.search(rf"(?<!\w){re.escape(key.lower())}(?!\w)", text.lower()) is not None


def identity_text(persona: dict, by: str) -> str:
    if by == "email":
        return f"My email is {persona['email']}."
    return f"I am {persona['first_name']} {persona['last_name']}, zip {persona['zip']}."


_PM_RE = r"my (gift card|paypal account|\w+ card ending in \d{4})"
_ITEM_RE = re.compile(r"the ([A-Za-z][A-Za-z -]*?) \(([^)]*)\)")
_CHANGE_RE = re.compile(r"the ([A-Za-z][A-Za-z -]*?) \(([^)]*)\) to \(([^)]*)\)")
_REQUEST_RES = [
    ("cancel", re.compile(r"cancel order (#W\d+) because (I no longer need it|I ordered it by mistake)")),
    ("order_address", re.compile(r"change the shipping address of order (#W\d+) to ([^.]+)\.")),
    ("user_address", re.compile(r"change my default address to ([^.]+)\.")),
    ("payment", re.compile(r"pay for order (#W\d+) with " + _PM_RE + " instead")),
    ("items", re.compile(r"In order (#W\d+), please change (.+) and pay any difference with " + _PM_RE)),
    ("return", re.compile(r"return (.+) from order (#W\d+) and refund " + _PM_RE)),
    ("exchange", re.compile(r"exchange (.+) in order (#W\d+) and pay any difference with " + _PM_RE)),
    ("status", re.compile(r"What is the status of order (#W\d+)\?")),
    ("total", re.compile(r"What is the total price of order (#W\d+)\?")),
]


def _split_address(text: str) -> dict | None:
    parts = [p.strip() for p in text.split(",")]
    if len(parts) != 6:
        return None
    return dict(zip(("address1", "address2", "city", "state", "country", "zip"), parts))


def _options(text: str) -> list[str]:
    return [p.strip() for p in text.split(",")]


def parse_request(text: str) -> dict | None:
    """Read a customer's request back from its template; ``None`` if the text holds none.

    Returns ``{"kind", "order_id", ...}`` with items as ``{"name", "options": [values]}`` and new
    variants as ``new_options``; payment methods as the customer's description.
    """
    for kind, pattern in _REQUEST_RES:
        m = pattern.search(text)
        if not m:
            continue
        if kind == "cancel":
            reason = {v: k for k, v in REASON_PHRASES.items()}[m.group(2)]
            return {"kind": kind, "order_id": m.group(1), "reason": reason}
        if kind == "order_address":
            addr = _split_address(m.group(2))
            return addr and {"kind": kind, "order_id": m.group(1), "address": addr}
        if kind == "user_address":
            addr = _split_address(m.group(1))
            return addr and {"kind": kind, "address": addr}
        if kind == "payment":
            return {"kind": kind, "order_id": m.group(1), "payment": m.group(2)}
        if kind in ("items", "exchange"):
            order_id, changes = (m.group(1), m.group(2)) if kind == "items" else (m.group(2), m.group(1))
            items = [{"name": n, "options": _options(o), "new_options": _options(w)}
                     for n, o, w in _CHANGE_RE.findall(changes)]
            return items and {"kind": kind, "order_id": order_id, "items": items, "payment": m.group(3)}
        if kind == "return":
            items = [{"name": n, "options": _options(o)} for n, o in _ITEM_RE.findall(m.group(1))]
            return items and {"kind": kind, "order_id": m.group(2), "items": items, "payment": m.group(3)}
        return {"kind": kind, "order_id": m.group(1)}
    return None


def parse_identity(text: str) -> dict | None:
    """``{"email": ...}`` or ``{"first_name", "last_name", "zip"}`` from a customer's message."""
    m = re.search(r"email is (\S+@[\w.-]+\w)", text)
    if m:
        return {"email": m.group(1)}
    m = re.search(r"I am (\w+) (\w+), zip (\d{5})", text)
    if m:
        return {"first_name": m.group(1), "last_name": m.group(2), "zip": m.group(3)}
    return None


# ---- generation ----------------------------------------------------------------------------------

def _call(name: str, **arguments) -> dict:
    return {"name": name, "arguments": arguments}


class _Gen:
    """Draws the requests of one task from the world's plain-Python data."""

    def __init__(self, world: WorldData, rng: random.Random):
        self.w, self.rng = world, rng

    def _orders(self, user: dict, statuses: tuple, used: set) -> list[dict]:
        return [self.w.orders[o] for o in user["order_ids"]
                if self.w.orders[o]["status"] in statuses and o not in used]

    def _new_address(self) -> dict:
        city, state = self.rng.choice(CITIES)
        return {"address1": f"{self.rng.randint(1, 999)} {self.rng.choice(STREETS)} Street",
                "address2": f"Apt {self.rng.randint(1, 99)}", "city": city, "state": state, "country": "USA",
                "zip": f"{self.rng.randint(10000, 99999)}"}

    def _pms(self, user: dict) -> list[dict]:
        return [self.w.payment_methods[p] for p in user["payment_method_ids"]]

    def _swap(self, order: dict, n: int, available: bool = True) -> list[tuple[str, str]] | None:
        """Pick ``n`` items of the order and, for each, another variant of its product."""
        items = list(order["items"])
        self.rng.shuffle(items)
        pairs = []
        for iid in items:
            v = self.w.variants[iid]
            others = [o for o in self.w.products[v["product_id"]]["item_ids"]
                      if o != iid and self.w.variants[o]["available"] == available]
            if others:
                pairs.append((iid, self.rng.choice(others)))
            if len(pairs) == n:
                return pairs
        return None

    def _change_text(self, pairs) -> str:
        out = []
        for old, new in pairs:
            v, nv = self.w.variants[old], self.w.variants[new]
            out.append(f"{describe_item(v['name'], v['options'])} to ({', '.join(nv['options'].values())})")
        return " and ".join(out)

    def request(self, kind: str, user: dict, used: set, state: dict) -> dict | None:
        rng, w = self.rng, self.w
        if kind == "cancel":
            orders = self._orders(user, ("pending",), used)
            if not orders:
                return None
            o = rng.choice(orders)
            reason = rng.choice(list(REASON_PHRASES))
            if any(w.payment_methods[p["payment_method_id"]]["source"] == "gift_card" for p in o["payments"]):
                if state["gift"]:
                    return None
                state["gift"] = True
            return {"kind": kind, "order_id": o["order_id"],
                    "text": f"Please cancel order {o['order_id']} because {REASON_PHRASES[reason]}.",
                    "actions": [_call("cancel_pending_order", order_id=o["order_id"], reason=reason)],
                    "confirm_keys": [o["order_id"], reason]}
        if kind == "order_address":
            orders = self._orders(user, ("pending",), used)
            if not orders:
                return None
            o, addr = rng.choice(orders), self._new_address()
            return {"kind": kind, "order_id": o["order_id"],
                    "text": f"Please change the shipping address of order {o['order_id']} to {format_address(addr)}.",
                    "actions": [_call("modify_pending_order_address", order_id=o["order_id"], **addr)],
                    "confirm_keys": [o["order_id"], addr["address1"], addr["zip"]]}
        if kind == "user_address":
            if state["user_address"]:
                return None
            state["user_address"] = True
            addr = self._new_address()
            return {"kind": kind, "order_id": None,
                    "text": f"Please change my default address to {format_address(addr)}.",
                    "actions": [_call("modify_user_address", user_id=user["user_id"], **addr)],
                    "confirm_keys": [addr["address1"], addr["zip"]]}
        if kind == "payment":
            orders = self._orders(user, ("pending",), used)
            rng.shuffle(orders)
            for o in orders:
                current = o["payments"][0]["payment_method_id"]
                total = o["payments"][0]["amount_cents"]
                if w.payment_methods[current]["source"] == "gift_card" and state["gift"]:
                    continue
                choices = [pm for pm in self._pms(user) if pm["payment_method_id"] != current
                           and (pm["source"] != "gift_card" or (pm["balance_cents"] >= total and not state["gift"]))]
                if not choices:
                    continue
                pm = rng.choice(choices)
                if pm["source"] == "gift_card" or w.payment_methods[current]["source"] == "gift_card":
                    state["gift"] = True
                return {"kind": kind, "order_id": o["order_id"],
                        "text": f"Please pay for order {o['order_id']} with my {describe_payment_method(pm)} instead.",
                        "actions": [_call("modify_pending_order_payment", order_id=o["order_id"],
                                          payment_method_id=pm["payment_method_id"])],
                        "confirm_keys": [o["order_id"], pm["payment_method_id"]]}
            return None
        if kind in ("items", "exchange"):
            status = "pending" if kind == "items" else "delivered"
            orders = self._orders(user, (status,), used)
            rng.shuffle(orders)
            for o in orders:
                pairs = self._swap(o, rng.choice([1, 1, 2]))
                if not pairs:
                    continue
                diff = sum(w.variants[n]["price_cents"] - w.variants[i]["price_cents"] for i, n in pairs)
                if kind == "items":
                    # the new item ids must not repeat in the order after the swap
                    kept = set(o["items"]) - {i for i, _ in pairs}
                    if any(n in kept for _, n in pairs):
                        continue
                choices = [pm for pm in self._pms(user)
                           if pm["source"] != "gift_card" or (not state["gift"] and pm["balance_cents"] >= diff)]
                if not choices:
                    continue
                pm = rng.choice(choices)
                if pm["source"] == "gift_card":
                    state["gift"] = True
                old_ids, new_ids = [p[0] for p in pairs], [p[1] for p in pairs]
                tool = "modify_pending_order_items" if kind == "items" else "exchange_delivered_order_items"
                pm_text = describe_payment_method(pm)
                if kind == "items":
                    text = (f"In order {o['order_id']}, please change {self._change_text(pairs)} and pay any "
                            f"difference with my {pm_text}.")
                else:
                    text = (f"Please exchange {self._change_text(pairs)} in order {o['order_id']} and pay any "
                            f"difference with my {pm_text}.")
                return {"kind": kind, "order_id": o["order_id"], "text": text,
                        "actions": [_call(tool, order_id=o["order_id"], item_ids=old_ids, new_item_ids=new_ids,
                                          payment_method_id=pm["payment_method_id"])],
                        "confirm_keys": [o["order_id"], *new_ids, pm["payment_method_id"]]}
            return None
        if kind == "return":
            orders = self._orders(user, ("delivered",), used)
            if not orders:
                return None
            o = rng.choice(orders)
            items = rng.sample(o["items"], min(len(o["items"]), rng.choice([1, 1, 2])))
            original = o["payments"][0]["payment_method_id"]
            choices = [pm for pm in self._pms(user)
                       if pm["payment_method_id"] == original or pm["source"] == "gift_card"]
            pm = rng.choice(choices)
            desc = " and ".join(describe_item(w.variants[i]["name"], w.variants[i]["options"]) for i in items)
            return {"kind": kind, "order_id": o["order_id"],
                    "text": f"Please return {desc} from order {o['order_id']} and refund my "
                            f"{describe_payment_method(pm)}.",
                    "actions": [_call("return_delivered_order_items", order_id=o["order_id"], item_ids=items,
                                      payment_method_id=pm["payment_method_id"])],
                    "confirm_keys": [o["order_id"], *items, pm["payment_method_id"]]}
        if kind in ("status", "total"):
            orders = self._orders(user, ("pending", "processed", "delivered", "cancelled"), used)
            if not orders:
                return None
            o = rng.choice(orders)
            if kind == "status":
                answer, text = o["status"], f"What is the status of order {o['order_id']}?"
            else:
                total = sum(w.variants[i]["price_cents"] for i in o["items"])
                answer, text = f"{total / 100:.2f}", f"What is the total price of order {o['order_id']}?"
            return {"kind": kind, "order_id": o["order_id"], "text": text, "actions": [], "outputs": [answer],
                    "answer_keys": [answer]}
        if kind == "refuse":
            return self.refusal(user, used)
        raise ValueError(kind)

    def refusal(self, user: dict, used: set) -> dict | None:
        """A request whose right answer is to change nothing (and say why)."""
        rng, w = self.rng, self.w
        sub = rng.choice(["cancel", "order_address", "payment", "items", "return", "exchange", "unavailable"])
        wrong = {"cancel": ("processed", "delivered", "cancelled"), "order_address": ("processed", "delivered"),
                 "payment": ("processed", "delivered", "cancelled"), "items": ("processed", "delivered"),
                 "return": ("pending", "processed"), "exchange": ("pending", "processed"),
                 "unavailable": ("delivered",)}[sub]
        orders = self._orders(user, wrong, used)
        if not orders:
            return None
        o = rng.choice(orders)
        oid = o["order_id"]
        pm = rng.choice(self._pms(user))
        pm_text = describe_payment_method(pm)
        if sub == "cancel":
            text = f"Please cancel order {oid} because {rng.choice(list(REASON_PHRASES.values()))}."
        elif sub == "order_address":
            text = f"Please change the shipping address of order {oid} to {format_address(self._new_address())}."
        elif sub == "payment":
            text = f"Please pay for order {oid} with my {pm_text} instead."
        elif sub == "return":
            i = rng.choice(o["items"])
            text = (f"Please return {describe_item(w.variants[i]['name'], w.variants[i]['options'])} from order "
                    f"{oid} and refund my {pm_text}.")
        else:
            pairs = self._swap(o, 1, available=(sub != "unavailable"))
            if not pairs:
                return None
            if sub == "items":
                text = (f"In order {oid}, please change {self._change_text(pairs)} and pay any difference "
                        f"with my {pm_text}.")
            else:
                text = (f"Please exchange {self._change_text(pairs)} in order {oid} and pay any difference "
                        f"with my {pm_text}.")
        answer = "not available" if sub == "unavailable" else o["status"]
        return {"kind": "refuse", "refusal_of": sub, "order_id": oid, "text": text, "actions": [],
                "outputs": [answer], "answer_keys": [answer]}


def _persona(user: dict) -> dict:
    return {"first_name": user["first_name"], "last_name": user["last_name"], "zip": user["address"]["zip"],
            "email": user["email"]}


def _instruction(persona: dict, by: str, requests: list[dict]) -> str:
    ident = (f"your email is {persona['email']}" if by == "email"
             else f"you do not remember your email; your zip code is {persona['zip']}")
    asks = " Then: ".join(r["text"] for r in requests)
    return (f"You are {persona['first_name']} {persona['last_name']}; {ident}. Give your identity only when "
            f"asked. Your requests, one at a time: {asks} Say yes only to a confirmation that matches your "
            f"request. When everything is done, end with ###STOP###.")


def generate_tasks(world: WorldData, split: str, n_tasks: int | None = None) -> list[dict]:
    """The split's tasks, deterministic in the world's seed.

    ``"train"`` (600 tasks, for GRPO) and ``"test"`` (120, held out) use disjoint sets of users.
    ``"synthetic"`` (10,000) is a separate draw over the training users only, the supply of the oracle's
    expert trajectories for SFT (the paper's synthetic expert data): it never shares a user with a
    test task, and its task stream is independent of the ``"train"`` one."""
    n_tasks, pool, rng = split_draw(world, split, n_tasks, "retail")
    # name + zip must identify the user
    name_zip_count: dict[tuple, int] = {}
    for u in world.users.values():
        key = (u["first_name"].lower(), u["last_name"].lower(), u["address"]["zip"])
        name_zip_count[key] = name_zip_count.get(key, 0) + 1
    gen = _Gen(world, rng)
    tasks: list[dict] = []
    while len(tasks) < n_tasks:
        user = world.users[rng.choice(pool)]
        state = {"gift": False, "user_address": False}
        requests = draw_requests(gen, rng, KIND_WEIGHTS, user, state, "order_id")
        if not requests:
            continue
        persona = _persona(user)
        key = (user["first_name"].lower(), user["last_name"].lower(), user["address"]["zip"])
        by = "name_zip" if rng.random() < 0.4 and name_zip_count[key] == 1 else "email"
        tasks.append({"task_id": f"{split}-{len(tasks):04d}", "user_id": user["user_id"], "identify_by": by,
                      "persona": persona, "requests": requests,
                      "actions": [a for r in requests for a in r["actions"]],
                      "outputs": [o for r in requests for o in r["outputs"]],
                      "instruction": _instruction(persona, by, requests)})
    return tasks


@lru_cache(maxsize=8)
def _tasks_cached(seed: int, split: str) -> tuple:
    from .retail_world import RetailWorld

    return tuple(generate_tasks(RetailWorld.get(seed).data, split))


def get_tasks(seed: int, split: str) -> tuple:
    """The (cached) tasks of a world seed and split; treat them as read-only."""
    return _tasks_cached(seed, split)
