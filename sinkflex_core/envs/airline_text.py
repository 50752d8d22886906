"""How airline customers phrase their requests, how those sentences are read back, and how an
answer in an agent's message is recognised.

The requests use a few sentence templates (short and regular, so that a small model can learn the
conversations). :func:`parse_request` reads them back for the oracle agent, which never sees the
task itself. :func:`answer_given` decides whether a message gives a required answer: a number must
be there as a whole number (``11067.45`` does not give ``1067.45``, ``SF150`` does not give ``150``),
and a label (a flight status, or the ground of a refusal) must be there as words, with no other
label of its group beside it, so that listing every possible status answers nothing.
"""

from __future__ import annotations

import re

CABIN_WORDS = {"basic_economy": "basic economy", "economy": "economy", "business": "business"}
REASON_PHRASES = {"change of plan": "my plans changed", "airline cancelled flight": "the airline cancelled a flight of it",
                  "health": "I have a health problem", "weather": "of the bad weather"}
FLIGHT_STATUSES = ("available", "delayed", "cancelled", "on time", "flying", "landed")
REFUSALS = ("not eligible", "basic economy")
_GROUPS = [FLIGHT_STATUSES, REFUSALS]
_NUMBER = re.compile(r"(?<![\w.\-])\d+(?:\.\d+)?(?!\w|\.\d)")


def _words(label: str) -> re.Pattern:
    return re.compile(r"(?<![\w-])" + re.escape(label) + r"(?![\w-])")


_LABEL_RE = {label: _words(label) for group in _GROUPS for label in group}


def answer_given(answer: str, text: str) -> bool:
    """Whether the agent's message ``text`` gives ``answer`` (see the module docstring)."""
    low = text.lower().replace(",", "")
    want = answer.lower().replace(",", "")
    if re.fullmatch(r"\d+(?:\.\d+)?", want):
        return any(float(tok) == float(want) for tok in _NUMBER.findall(low))
    for group in _GROUPS:
        if want in group:
            return bool(_LABEL_RE[want].search(low)) and not any(
                _LABEL_RE[other].search(low) for other in group if other != want)
    return want in low


def describe_payment(pm: dict) -> str:
    """How a customer names a payment method."""
    if pm["source"] == "credit_card":
        return f"{pm['brand']} card ending in {pm['last_four']}"
    return f"{pm['source'].replace('_', ' ')} {pm['payment_id']}"


def identity_text(persona: dict) -> str:
    return f"My user id is {persona['user_id']}."


def plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


_PM = r"my ((?:gift card|certificate) (?:gift_card|certificate)_\d{7}|\w+ card ending in \d{4})"
_RID = r"([A-Z0-9]{6})"
_DATE = r"(\d{4}-\d{2}-\d{2})"
_REQUEST_RES = [
    ("cancel", re.compile(rf"cancel reservation {_RID} because ({'|'.join(map(re.escape, REASON_PHRASES.values()))})")),
    ("change_flight", re.compile(rf"move reservation {_RID} to flight (SF\d+) on {_DATE} and pay any difference "
                                 rf"with {_PM}")),
    ("cabin", re.compile(rf"change the cabin of reservation {_RID} to (basic economy|economy|business) and pay any "
                         rf"difference with {_PM}")),
    ("bags", re.compile(rf"add (\d+) checked bags? to reservation {_RID} and pay with {_PM}")),
    ("passengers", re.compile(rf"change passenger (\w+) (\w+) on reservation {_RID} to (\w+) (\w+), born {_DATE}")),
    ("book", re.compile(rf"book a one-way (basic economy|economy|business) ticket from ([A-Z]{{3}}) to ([A-Z]{{3}}) "
                        rf"on {_DATE}, flight (SF\d+), for me, with (\d+) checked bags? and (no )?travel insurance, "
                        rf"paid with {_PM}")),
    ("compensation", re.compile(rf"cancelled flight (SF\d+) on {_DATE} of my reservation {_RID}")),
    ("total", re.compile(rf"How much have I paid in total for reservation {_RID}\?")),
    ("status", re.compile(rf"What is the status of flight (SF\d+) on {_DATE}\?")),
    ("cheapest", re.compile(rf"cheapest economy fare on a direct flight from ([A-Z]{{3}}) to ([A-Z]{{3}}) on {_DATE}")),
]
_FIELDS = {"cancel": ("reservation_id", "reason"), "change_flight": ("reservation_id", "flight_number", "date", "payment"),
           "cabin": ("reservation_id", "cabin", "payment"), "bags": ("add", "reservation_id", "payment"),
           "passengers": ("old_first", "old_last", "reservation_id", "first_name", "last_name", "dob"),
           "book": ("cabin", "origin", "destination", "date", "flight_number", "bags", "no_insurance", "payment"),
           "compensation": ("flight_number", "date", "reservation_id"), "total": ("reservation_id",),
           "status": ("flight_number", "date"), "cheapest": ("origin", "destination", "date")}


def parse_request(text: str) -> dict | None:
    """Read a customer's request back from its template (``None`` if the text holds none)."""
    for kind, pattern in _REQUEST_RES:
        m = pattern.search(text)
        if not m:
            continue
        out = {"kind": kind, **dict(zip(_FIELDS[kind], m.groups()))}
        if kind == "cancel":
            out["reason"] = {v: k for k, v in REASON_PHRASES.items()}[out["reason"]]
        if "cabin" in out:
            out["cabin"] = {v: k for k, v in CABIN_WORDS.items()}[out["cabin"]]
        for key in ("add", "bags"):
            if key in out:
                out[key] = int(out[key])
        if kind == "book":
            out["insurance"] = "no" if out.pop("no_insurance") else "yes"
        return out
    return None


def parse_identity(text: str) -> str | None:
    m = re.search(r"user id is ([a-z]+_[a-z]+_\d{4})", text)
    return m.group(1) if m else None
