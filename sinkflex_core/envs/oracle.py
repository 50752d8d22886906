"""Agents that play the environments without a model: the policy-following oracle (source of expert
trajectories for supervised fine-tuning) and a random baseline; plus the episode loop that records
a conversation as Hugging Face chat messages.

The retail oracle works from the conversation alone: it reads the customer's requests with
:func:`parse_request`, looks everything up with tools, confirms before writing, and refuses (changing
nothing) when the policy says no. Its messages are short and regular on purpose.
"""

from __future__ import annotations

import importlib
import json
import random
import re
from collections.abc import Generator

import gymnasium as gym

from .base import ScriptedExpert, format_tool_call, parse_action
from .customer import CONFIRM_MARK, STOP
from .retail_tasks import parse_identity, parse_request
from .retail_tools import order_items

ASK_IDENTITY = "Sure. Please tell me your email, or your name and zip code."
ASK_REQUEST = "How can I help you?"
_NEEDS = {"cancel": "pending", "order_address": "pending", "payment": "pending", "items": "pending",
          "return": "delivered", "exchange": "delivered"}
_VERB = {"cancel": "cancel", "order_address": "modify", "payment": "modify", "items": "modify",
         "return": "return", "exchange": "exchange"}


def _call(name: str, **arguments) -> str:
    return format_tool_call(name, arguments)


def _cents(x: float) -> int:
    return int(round(float(x) * 100))


def _money(cents: int) -> str:
    return f"{cents / 100:.2f}"


def _name_items(items: list[dict]) -> str:
    """The order's items as a confirmation names them: each item's name right before its id, then its
    options, ``the Bookshelf 2552978718 (cotton, modern) and the Tent 1234567890 (blue)``."""
    named = [f"the {i['name']} {i['item_id']}" + (f" ({', '.join(i['options'].values())})" if i["options"] else "")
             for i in items]
    return named[0] if len(named) == 1 else f"{', '.join(named[:-1])} and {named[-1]}"


def _find_pm(user: dict, desc: str) -> dict | None:
    for pm in user["payment_methods"]:
        if desc == "gift card" and pm["source"] == "gift_card":
            return pm
        if desc == "paypal account" and pm["source"] == "paypal":
            return pm
        m = re.fullmatch(r"(\w+) card ending in (\d{4})", desc)
        if m and pm["source"] == "credit_card" and pm["brand"] == m.group(1) and pm["last_four"] == m.group(2):
            return pm
    return None


class RetailOracle(ScriptedExpert):
    """Policy-following agent for the retail store (a coroutine driven by :meth:`act`)."""

    fallback = "Goodbye."

    # ---- the script ---------------------------------------------------------------------------
    def _script(self, msg: str) -> Generator[str, str, None]:
        uid, user = None, None
        tries = 0
        while STOP not in msg:
            req = parse_request(msg)
            if req is None:
                tries += 1
                if tries > 3:
                    return
                msg = yield ASK_REQUEST
                continue
            while uid is None:
                ident = parse_identity(msg)
                if ident is None:
                    msg = yield ASK_IDENTITY
                    if STOP in msg:
                        return
                    ident = parse_identity(msg)
                    if ident is None:
                        continue
                if "email" in ident:
                    out = yield _call("find_user_id_by_email", email=ident["email"])
                else:
                    out = yield _call("find_user_id_by_name_zip", **ident)
                if out.startswith("Error"):
                    msg = yield "Sorry, I could not find your account. " + ASK_IDENTITY
                    continue
                uid = out.strip()
                user = json.loads((yield _call("get_user_details", user_id=uid)))
            msg = yield from self._handle(req, uid, user)

    def _handle(self, req: dict, uid: str, user: dict) -> Generator[str, str, str]:
        kind = req["kind"]
        if kind == "user_address":
            addr = req["address"]
            text = ", ".join(addr.values())
            reply = yield f"I will change your default address to {text}. Proceed? {CONFIRM_MARK}"
            return (yield from self._execute(reply, "modify_user_address", dict(user_id=uid, **addr)))
        oid = req["order_id"]
        out = yield _call("get_order_details", order_id=oid)
        if out.startswith("Error"):
            return (yield f"Sorry, I cannot find order {oid}.")
        order = json.loads(out)
        order["items"] = order_items(order)
        if order["user_id"] != uid:
            return (yield f"Sorry, order {oid} is not in your account.")
        status = order["status"]
        if kind == "status":
            return (yield f"Order {oid} is {status}.")
        if kind == "total":
            total = sum(_cents(i["price"]) for i in order["items"])
            return (yield f"The total of order {oid} is {_money(total)}.")
        if status != _NEEDS[kind]:
            return (yield f"Sorry, order {oid} is {status}, so I cannot {_VERB[kind]} it.")
        if kind == "cancel":
            reason = req["reason"]
            reply = yield f"I will cancel order {oid} (reason: {reason}). Proceed? {CONFIRM_MARK}"
            return (yield from self._execute(reply, "cancel_pending_order", dict(order_id=oid, reason=reason)))
        if kind == "order_address":
            addr = req["address"]
            reply = yield f"I will change the address of order {oid} to {', '.join(addr.values())}. Proceed? {CONFIRM_MARK}"
            return (yield from self._execute(reply, "modify_pending_order_address", dict(order_id=oid, **addr)))
        pm = _find_pm(user, req["payment"])
        if kind == "payment":
            if pm is None:
                return (yield "Sorry, I cannot find that payment method in your account.")
            paid = [p for p in order["payment_history"] if p["type"] == "payment"]
            total = _cents(paid[0]["amount"]) if paid else 0
            if len(order["payment_history"]) != 1 or paid[0]["payment_method_id"] == pm["id"]:
                return (yield f"Sorry, I cannot change the payment of order {oid}.")
            if pm["source"] == "gift_card" and _cents(pm["balance"]) < total:
                return (yield "Sorry, your gift card balance is too low.")
            reply = yield f"I will pay order {oid} with {pm['id']}. Proceed? {CONFIRM_MARK}"
            return (yield from self._execute(reply, "modify_pending_order_payment",
                                             dict(order_id=oid, payment_method_id=pm["id"])))
        # items, return, exchange: find the order's items from their descriptions
        old = []
        for want in req["items"]:
            match = [i for i in order["items"] if i["name"] == want["name"]
                     and list(i["options"].values()) == want["options"] and i not in old]
            if not match:
                return (yield f"Sorry, I cannot find the {want['name']} ({', '.join(want['options'])}) in order {oid}.")
            old.append(match[0])
        if pm is None:
            return (yield "Sorry, I cannot find that payment method in your account.")
        old_ids = [i["item_id"] for i in old]
        if kind == "return":
            originals = {p["payment_method_id"] for p in order["payment_history"] if p["type"] == "payment"}
            if pm["source"] != "gift_card" and pm["id"] not in originals:
                return (yield "Sorry, a refund can only go to the original payment method or a gift card.")
            refund = sum(_cents(i["price"]) for i in old)
            reply = yield (f"I will return {_name_items(old)} of order {oid} and refund {_money(refund)} "
                           f"to {pm['id']}. Proceed? {CONFIRM_MARK}")
            return (yield from self._execute(reply, "return_delivered_order_items",
                                             dict(order_id=oid, item_ids=old_ids, payment_method_id=pm["id"])))
        products: dict[str, dict] = {}
        new = []
        for item, want in zip(old, req["items"]):
            pid = item["product_id"]
            if pid not in products:
                products[pid] = json.loads((yield _call("get_product_details", product_id=pid)))
            match = [v for v in products[pid]["variants"] if list(v["options"].values()) == want["new_options"]]
            if not match or not match[0]["available"] or match[0]["item_id"] == item["item_id"]:
                return (yield f"Sorry, the {want['name']} ({', '.join(want['new_options'])}) is not available.")
            new.append(match[0])
        new_ids = [v["item_id"] for v in new]
        diff = sum(_cents(v["price"]) for v in new) - sum(_cents(i["price"]) for i in old)
        if pm["source"] == "gift_card" and _cents(pm["balance"]) < diff:
            return (yield "Sorry, your gift card balance is too low.")
        verb = "change" if kind == "items" else "exchange"
        reply = yield (f"I will {verb} {_name_items(old)} for {', '.join(new_ids)} in order {oid}; the "
                       f"difference of {_money(diff)} goes to {pm['id']}. Proceed? {CONFIRM_MARK}")
        tool = "modify_pending_order_items" if kind == "items" else "exchange_delivered_order_items"
        return (yield from self._execute(reply, tool, dict(order_id=oid, item_ids=old_ids, new_item_ids=new_ids,
                                                          payment_method_id=pm["id"])))

    def _execute(self, reply: str, tool: str, arguments: dict) -> Generator[str, str, str]:
        if reply.strip().lower() != "yes":
            return reply  # not confirmed: the reply is the customer's next message
        out = yield _call(tool, **arguments)
        if out.startswith("Error"):
            return (yield f"Sorry, that did not work: {out[7:]}.")
        return (yield f"Done: {out}.")


# Which world a tool set belongs to (a tool only that world has), and the module and class of its oracle;
# the retail store is the default.
_ORACLES = (
    ("run_sql", (".bank", "BankOracle")),
    ("search_direct_flight", (".airline_oracle", "AirlineOracle")),
    ("patch_file", (".code_repair", "CodeRepairExpert")),
    ("run", (".bash_env", "BashExpert")),
)


class OracleAgent:
    """The oracle for any of the registered environments; picks the right script from the tools.

    ``reset(obs, info)`` then, each turn, ``act()`` returns the action and ``observe(obs)`` feeds the
    environment's answer back.
    """

    def reset(self, observation: str, info: dict) -> None:
        names = {t["function"]["name"] for t in info["tools"]}
        module, cls = next((where for tool, where in _ORACLES if tool in names), (".oracle", "RetailOracle"))
        self._impl = getattr(importlib.import_module(module, __package__), cls)()
        self._impl.reset(observation, info)

    def act(self, observation: str | None = None, role: str = "user") -> str:
        return self._impl.act(observation, role)

    def observe(self, observation: str) -> None:
        self._impl.observe(observation)


_ID_RES = [re.compile(p) for p in (r"#W\d{7}", r"\b\d{10}\b", r"\b(?:credit_card|gift_card|paypal)_\d{7}\b",
                                   r"\b[a-z]+_[a-z]+_\d{4}\b", r"[\w.]+@example\.com")]


class RandomAgent:
    """Baseline: random tool calls (with ids picked from what it has seen) and random messages."""

    def __init__(self, seed: int = 0):
        self.rng = random.Random(seed)

    def reset(self, observation: str, info: dict) -> None:
        self.tools = [t["function"] for t in info["tools"]]
        self.seen: list[str] = []
        self.observe(observation)

    def observe(self, observation: str) -> None:
        for pattern in _ID_RES:
            self.seen.extend(pattern.findall(observation))

    def _value(self, spec: dict):
        rng = self.rng
        if spec.get("enum"):
            return rng.choice(spec["enum"])
        if spec["type"] == "array":
            return [self._value({"type": "string"}) for _ in range(rng.randint(1, 2))]
        if self.seen and rng.random() < 0.8:
            return rng.choice(self.seen)
        return rng.choice(["yes", "no", "12345", "SELECT 1", "#W0000000"])

    def act(self, observation: str | None = None, role: str = "user") -> str:
        rng = self.rng
        if rng.random() < 0.6:
            tool = rng.choice(self.tools)
            props = tool["parameters"]["properties"]
            return _call(tool["name"], **{k: self._value(v) for k, v in props.items()})
        return rng.choice(["yes", "Hello!", "Please tell me your email.", "Done.", "Sorry, I cannot do that.",
                           f"Proceed? {CONFIRM_MARK}"])


class DoNothingAgent:
    """Baseline: says "OK." every turn."""

    def reset(self, observation: str, info: dict) -> None:
        pass

    def observe(self, observation: str) -> None:
        pass

    def act(self, observation: str | None = None, role: str = "user") -> str:
        return "OK."


def _as_message(action: str) -> dict:
    parsed = parse_action(action)
    if parsed.kind == "tool":
        return {"role": "assistant", "content": "",
                "tool_calls": [{"type": "function", "function": {"name": parsed.name, "arguments": parsed.arguments}}]}
    return {"role": "assistant", "content": action}


def run_episode(env: gym.Env, agent, task_index: int, seed: int = 0) -> tuple[list[dict], float, dict]:
    """Play one episode; return ``(messages, reward, last_info)`` with HF chat-template messages
    (system policy, then user / assistant / tool turns)."""
    obs, info = env.reset(seed=seed, options={"task_index": task_index})
    agent.reset(obs, info)
    messages = [{"role": "system", "content": info["policy"]}, {"role": "user", "content": obs}]
    role = "user"
    while True:
        action = agent.act(obs, role)
        messages.append(_as_message(action))
        obs, reward, terminated, truncated, step_info = env.step(action)
        role = step_info["obs_role"]
        messages.append({"role": role, "content": obs})
        agent.observe(obs)
        if terminated or truncated:
            return messages, float(reward), step_info


def expert_conversation(env_id: str, split: str, task_index: int, seed: int = 0,
                        env: gym.Env | None = None) -> tuple[list[dict], float]:
    """The oracle's conversation for one task as HF chat messages, and its reward (the SFT data).

    Pass ``env`` to reuse an environment made with ``gymnasium.make(env_id, split=split)``."""
    own = env is None
    if own:
        env = gym.make(env_id, split=split)
    try:
        messages, reward, _ = run_episode(env, OracleAgent(), task_index, seed)
    finally:
        if own:
            env.close()
    return messages, reward


def evaluate_agent(env: gym.Env, make_agent, task_indices, trials: int = 1, seed: int = 0) -> list[list[bool]]:
    """Success (reward == 1) of ``trials`` episodes per task; ``make_agent(trial)`` builds a fresh agent.

    The result feeds :func:`pass_hat_k`: one list of booleans per task."""
    out = []
    for i in task_indices:
        out.append([run_episode(env, make_agent(t), int(i), seed=seed + t)[1] >= 1.0 for t in range(trials)])
    return out
