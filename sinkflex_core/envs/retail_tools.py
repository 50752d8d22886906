"""The retail store's tools: SQL transactions over one episode's database.

Every tool returns a string: compact JSON for records, a short sentence for writes, ``Error: ...``
for refusals and bad calls. Arguments are checked against the tool's schema before any SQL runs, and
every write validates everything first and then writes in one transaction, so a refused call leaves
the database exactly as it was. All SQL is parameterised: argument text is never part of a statement.

The tools, their arguments and their checks are those of tau-bench's retail domain. One record is laid
out differently: ``get_order_details`` writes each item with its name as the key of its id,
``{"Bookshelf": "2552978718", "product_id": ..., "price": ..., "options": {...}}`` (tau-bench: ``"name":
"Bookshelf", "product_id": ..., "item_id": "2552978718"``), so that the name stands two tokens before the
id. The small policies trained here copy an item's id by its name only at that distance, the reach of
their previous-token heads (docs/experiments.md); :func:`order_items` reads the record back.
"""

from __future__ import annotations

import ast
import json
import math
import operator
import sqlite3
from collections import Counter

from .base import ToolResult

MAX_STRING = 2_000
MAX_LIST = 20
CANCEL_REASONS = ("no longer needed", "ordered by mistake")
ADDRESS_FIELDS = ("address1", "address2", "city", "state", "country", "zip")

_S = {"type": "string"}
_LIST = {"type": "array", "items": {"type": "string"}}


def _fn(name: str, description: str, props: dict, required: list[str] | None = None) -> dict:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": props,
                       "required": list(props) if required is None else required}}}


def _addr_props() -> dict:
    return {k: {"type": "string", "description": k} for k in ADDRESS_FIELDS}


TOOL_SCHEMAS = [
    _fn("find_user_id_by_email", "Find a user id by email.", {"email": _S}),
    _fn("find_user_id_by_name_zip", "Find a user id by first name, last name and zip code.",
        {"first_name": _S, "last_name": _S, "zip": _S}),
    _fn("get_user_details", "Get a user's profile, payment methods and order ids.", {"user_id": _S}),
    _fn("get_order_details", "Get an order's items, status, fulfillments and payments.",
        {"order_id": {"type": "string", "description": "like '#W1234567'"}}),
    _fn("get_product_details", "Get a product's variants (options, availability, price).", {"product_id": _S}),
    _fn("list_all_product_types", "List every product name with its product id.", {}),
    _fn("cancel_pending_order", "Cancel a pending order and refund every payment.",
        {"order_id": _S, "reason": {"type": "string", "enum": list(CANCEL_REASONS)}}),
    _fn("modify_pending_order_address", "Change the shipping address of a pending order.",
        {"order_id": _S, **_addr_props()}),
    _fn("modify_pending_order_items", "Swap items of a pending order for other variants of the same "
        "products; the price difference is paid or refunded with the payment method. Once per order.",
        {"order_id": _S, "item_ids": _LIST, "new_item_ids": _LIST, "payment_method_id": _S}),
    _fn("modify_pending_order_payment", "Pay a pending order with another payment method of the user.",
        {"order_id": _S, "payment_method_id": _S}),
    _fn("modify_user_address", "Change a user's default address.", {"user_id": _S, **_addr_props()}),
    _fn("return_delivered_order_items", "Request a return of items of a delivered order; the refund "
        "goes to the original payment method or a gift card of the user.",
        {"order_id": _S, "item_ids": _LIST, "payment_method_id": _S}),
    _fn("exchange_delivered_order_items", "Request an exchange of items of a delivered order for other "
        "variants of the same products. Once per order.",
        {"order_id": _S, "item_ids": _LIST, "new_item_ids": _LIST, "payment_method_id": _S}),
    _fn("calculate", "Evaluate an arithmetic expression (numbers, + - * / and parentheses).",
        {"expression": _S}),
    _fn("think", "Think out loud; changes nothing.", {"thought": _S}),
    _fn("transfer_to_human_agents", "Hand the customer to a human agent; ends the conversation.",
        {"summary": _S}),
]
TOOL_NAMES = [t["function"]["name"] for t in TOOL_SCHEMAS]
WRITE_TOOLS = ("cancel_pending_order", "modify_pending_order_address", "modify_pending_order_items",
               "modify_pending_order_payment", "modify_user_address", "return_delivered_order_items",
               "exchange_delivered_order_items")
_SCHEMA_BY_NAME = {t["function"]["name"]: t["function"]["parameters"] for t in TOOL_SCHEMAS}

ITEM_FIELDS = ("product_id", "price", "options")


def order_items(order: dict) -> list[dict]:
    """The items of a ``get_order_details`` record, each as ``{"name", "item_id", "product_id", "price",
    "options"}``. The record writes an item as ``{"Bookshelf": "2552978718", "product_id": ..., "price": ...,
    "options": ...}``: its name is the key of its id."""
    items = []
    for entry in order["items"]:
        (name, item_id), = [(k, v) for k, v in entry.items() if k not in ITEM_FIELDS]
        items.append({"name": name, "item_id": item_id, **{k: entry[k] for k in ITEM_FIELDS}})
    return items


class ToolError(Exception):
    """A refusal or a bad call: becomes an ``Error: ...`` observation."""


def _encodable(text: str) -> bool:
    """False for a string that cannot be stored as UTF-8 (JSON's ``\\ud800`` escapes give lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _short(text: str) -> str:
    return text if len(text) <= 60 else text[:60] + "..."


def check_tool_name(name: str, schemas: dict = _SCHEMA_BY_NAME) -> None:
    """Raise :class:`ToolError` unless ``name`` is one of the tools in ``schemas``."""
    if not isinstance(name, str) or name not in schemas:
        raise ToolError(f"unknown tool {_short(str(name))!r}")


def check_arguments(name: str, arguments: dict, schemas: dict = _SCHEMA_BY_NAME, call: str | None = None) -> None:
    """Raise :class:`ToolError` unless ``arguments`` fit the tool's JSON schema (``schemas``: tool name ->
    parameters), so that a malformed call is refused with a clear message before any SQL runs.

    The checker knows the part of JSON Schema the worlds' tools use: strings (with an optional enum),
    integers with bounds, lists of strings, arrays of objects (``maxItems``), objects with required
    properties. ``call`` names the call in the messages about its set of arguments (default: the
    tool's name).
    """
    check_tool_name(name, schemas)
    if not isinstance(arguments, dict):
        raise ToolError(f"{call} must be a JSON object" if call else "arguments must be a JSON object")
    _check_object(call or name, schemas[name], arguments, top=True)


def _check_object(where: str, spec: dict, value, top: bool = False) -> None:
    if not isinstance(value, dict):
        raise ToolError(f"{where} must be a JSON object")
    props = spec["properties"]
    for key in value:
        if key not in props:
            raise ToolError(f"{where} got an unexpected argument {_short(str(key))!r}")
    for key in spec["required"]:
        if key not in value:
            raise ToolError(f"{where} is missing the argument {key!r}")
    for key, item in value.items():
        _check_value(f"argument {key!r}" if top else f"{where}.{key}", props[key], item)


def _check_value(where: str, spec: dict, value) -> None:
    kind = spec["type"]
    if kind == "string":
        if not isinstance(value, str):
            raise ToolError(f"{where} must be a string")
        if len(value) > MAX_STRING:
            raise ToolError(f"{where} is too long ({len(value)} characters)")
        if not _encodable(value):
            raise ToolError(f"{where} is not valid Unicode text (a lone surrogate)")
        if "enum" in spec and value not in spec["enum"]:
            raise ToolError(f"{where} must be one of {spec['enum']}")
    elif kind == "integer":
        if isinstance(value, bool) or not isinstance(value, int):
            raise ToolError(f"{where} must be an integer")
        if not spec.get("minimum", -10**9) <= value <= spec.get("maximum", 10**9):
            raise ToolError(f"{where} must be between {spec.get('minimum')} and {spec.get('maximum')}")
    elif kind == "array" and spec["items"]["type"] == "string":
        # a list of ids is refused as a whole: the message names the argument, not an item
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ToolError(f"{where} must be a list of strings")
        if len(value) > spec.get("maxItems", MAX_LIST) or any(len(v) > MAX_STRING for v in value):
            raise ToolError(f"{where} is too long")
        if not all(_encodable(v) for v in value):
            raise ToolError(f"{where} is not valid Unicode text (a lone surrogate)")
    elif kind == "array":
        if not isinstance(value, list):
            raise ToolError(f"{where} must be a list")
        if len(value) > spec.get("maxItems", 20):
            raise ToolError(f"{where} has too many items (at most {spec.get('maxItems', 20)})")
        for i, item in enumerate(value):
            _check_value(f"{where}[{i}]", spec["items"], item)
    elif kind == "object":
        _check_object(where, spec, value)


def _dollars(cents: int) -> float:
    return round(cents / 100, 2)


def _dump(obj) -> str:
    return json.dumps(obj, separators=(",", ":"))


_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def safe_calculate(expression: str) -> float:
    """Evaluate + - * / over numbers without ``eval``; bounded so that no input can hang."""
    if len(expression) > 200:
        raise ToolError("expression too long")
    try:
        tree = ast.parse(expression, mode="eval")
    except (SyntaxError, ValueError) as err:
        raise ToolError("invalid expression") from err

    def walk(node, depth=0):
        if depth > 50:
            raise ToolError("expression too deep")
        if isinstance(node, ast.Expression):
            return walk(node.body, depth + 1)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return float(node.value)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            v = walk(node.operand, depth + 1)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            a, b = walk(node.left, depth + 1), walk(node.right, depth + 1)
            if isinstance(node.op, ast.Div) and b == 0:
                raise ToolError("division by zero")
            result = _BINOPS[type(node.op)](a, b)
            if abs(result) > 1e15:
                raise ToolError("number too large")
            return result
        raise ToolError("only numbers, + - * / and parentheses are allowed")

    value = walk(tree)
    if not math.isfinite(value):  # "1e999" parses as infinity; inf - inf is not a number
        raise ToolError("number too large")
    return round(value, 2)


class SQLTools:
    """A world's tools over one episode's SQLite connection, one method per tool.

    ``call(name, arguments)`` is the single entry point: it checks the arguments (``check_arguments``
    of the subclass), runs the tool's method, and turns a :class:`ToolError` into an ``Error: ...``
    observation; ``transfer_to_human_agents`` ends the episode.
    """

    check_arguments = staticmethod(check_arguments)

    def __init__(self, conn: sqlite3.Connection):
        self.conn = conn

    def call(self, name: str, arguments: dict) -> ToolResult:
        try:
            self.check_arguments(name, arguments)
            output = getattr(self, name)(**arguments)
        except ToolError as err:
            return ToolResult(f"Error: {err}")
        return ToolResult(output, done=(name == "transfer_to_human_agents"))


class RetailTools(SQLTools):
    """The store's tools over one episode's SQLite connection (:class:`SQLTools`)."""

    # ---- helpers ------------------------------------------------------------------------------
    def _order_row(self, order_id: str) -> sqlite3.Row:
        row = self.conn.execute("SELECT order_id, user_id, status FROM orders WHERE order_id = ?",
                                (order_id,)).fetchone()
        if row is None:
            raise ToolError("order not found")
        return row

    def _order_items(self, order_id: str) -> list[tuple]:
        return self.conn.execute("SELECT pos, item_id, product_id, price_cents FROM order_items "
                                 "WHERE order_id = ? ORDER BY pos", (order_id,)).fetchall()

    def _payment_method(self, user_id: str, pm_id: str) -> tuple:
        row = self.conn.execute("SELECT payment_method_id, source, balance_cents FROM payment_methods "
                                "WHERE payment_method_id = ? AND user_id = ?", (pm_id, user_id)).fetchone()
        if row is None:
            raise ToolError("payment method not found")
        return row

    def _payments(self, order_id: str) -> list[tuple]:
        return self.conn.execute("SELECT pos, kind, payment_method_id, amount_cents FROM payments "
                                 "WHERE order_id = ? ORDER BY pos", (order_id,)).fetchall()

    def _add_payment(self, order_id: str, kind: str, pm_id: str, cents: int) -> None:
        pos = self.conn.execute("SELECT COALESCE(MAX(pos) + 1, 0) FROM payments WHERE order_id = ?",
                                (order_id,)).fetchone()[0]
        self.conn.execute("INSERT INTO payments VALUES (?,?,?,?,?)", (order_id, pos, kind, pm_id, cents))

    def _check_items(self, order_id: str, item_ids: list[str]) -> list[tuple]:
        """The order's rows for ``item_ids`` (each id used at most as often as the order holds it)."""
        if not item_ids:
            raise ToolError("item_ids is empty")
        rows = self._order_items(order_id)
        held = Counter(r[1] for r in rows)
        wanted = Counter(item_ids)
        for iid, n in wanted.items():
            if held[iid] < n:
                raise ToolError(f"item {iid[:40]} not found in the order")
        picked, used = [], Counter()
        for iid in item_ids:
            for r in rows:
                if r[1] == iid and used[r[0]] == 0:
                    used[r[0]] = 1
                    picked.append(r)
                    break
        return picked

    def _check_new_items(self, old_rows: list[tuple], new_item_ids: list[str]) -> list[tuple]:
        if len(new_item_ids) != len(old_rows):
            raise ToolError("the number of items to be exchanged should match")
        out = []
        for old, new_id in zip(old_rows, new_item_ids):
            row = self.conn.execute("SELECT item_id, product_id, available, price_cents FROM variants "
                                    "WHERE item_id = ?", (new_id,)).fetchone()
            if row is None or row[1] != old[2]:
                raise ToolError(f"new item {new_id[:40]} is not a variant of the same product")
            if new_id == old[1]:
                raise ToolError(f"new item {new_id[:40]} is the same as the old one")
            if not row[2]:
                raise ToolError(f"new item {new_id[:40]} not available")
            out.append(row)
        return out

    # ---- reads ------------------------------------------------------------------------------
    def find_user_id_by_email(self, email: str) -> str:
        row = self.conn.execute("SELECT user_id FROM users WHERE lower(email) = lower(?)", (email.strip(),)).fetchone()
        if row is None:
            raise ToolError("user not found")
        return row[0]

    def find_user_id_by_name_zip(self, first_name: str, last_name: str, zip: str) -> str:
        row = self.conn.execute(
            "SELECT user_id FROM users WHERE lower(first_name) = lower(?) AND lower(last_name) = lower(?) "
            "AND zip = ? ORDER BY user_id", (first_name.strip(), last_name.strip(), zip.strip())).fetchone()
        if row is None:
            raise ToolError("user not found")
        return row[0]

    def get_user_details(self, user_id: str) -> str:
        row = self.conn.execute("SELECT user_id, first_name, last_name, email, address1, address2, city, state, "
                                "country, zip FROM users WHERE user_id = ?", (user_id,)).fetchone()
        if row is None:
            raise ToolError("user not found")
        methods = []
        for pm_id, source, brand, last_four, balance in self.conn.execute(
                "SELECT payment_method_id, source, brand, last_four, balance_cents FROM payment_methods "
                "WHERE user_id = ? ORDER BY rowid", (user_id,)):
            pm = {"id": pm_id, "source": source}
            if source == "credit_card":
                pm.update(brand=brand, last_four=last_four)
            elif source == "gift_card":
                pm["balance"] = _dollars(balance)
            methods.append(pm)
        orders = [r[0] for r in self.conn.execute("SELECT order_id FROM orders WHERE user_id = ? ORDER BY rowid",
                                                  (user_id,))]
        return _dump({"user_id": row[0], "name": f"{row[1]} {row[2]}", "email": row[3],
                      "address": dict(zip(ADDRESS_FIELDS, row[4:10])), "payment_methods": methods,
                      "orders": orders})

    def get_order_details(self, order_id: str) -> str:
        row = self.conn.execute("SELECT * FROM orders WHERE order_id = ?", (order_id,)).fetchone()
        if row is None:
            raise ToolError("order not found")
        (oid, uid, a1, a2, city, state, country, zip_, status, reason, ret_items, ret_pm,
         ex_items, ex_new, ex_pm) = row
        items = []
        for _, iid, pid, price in self._order_items(oid):
            name, options = self.conn.execute(
                "SELECT p.name, v.options FROM variants v JOIN products p USING (product_id) WHERE v.item_id = ?",
                (iid,)).fetchone()
            # the name as the key of the id: two tokens before it (see the module's docstring)
            items.append({name: iid, "product_id": pid, "price": _dollars(price), "options": json.loads(options)})
        out = {"order_id": oid, "user_id": uid, "status": status,
               "address": dict(zip(ADDRESS_FIELDS, (a1, a2, city, state, country, zip_))), "items": items,
               "fulfillments": [{"tracking_id": t, "item_ids": json.loads(ids)} for t, ids in self.conn.execute(
                   "SELECT tracking_id, item_ids FROM fulfillments WHERE order_id = ? ORDER BY pos", (oid,))],
               "payment_history": [{"type": k, "amount": _dollars(c), "payment_method_id": p}
                                   for _, k, p, c in self._payments(oid)]}
        if reason:
            out["cancel_reason"] = reason
        if ret_items:
            out["return_items"] = json.loads(ret_items)
            out["return_payment_method_id"] = ret_pm
        if ex_items:
            out["exchange_items"] = json.loads(ex_items)
            out["exchange_new_items"] = json.loads(ex_new)
            out["exchange_payment_method_id"] = ex_pm
        return _dump(out)

    def get_product_details(self, product_id: str) -> str:
        row = self.conn.execute("SELECT product_id, name FROM products WHERE product_id = ?", (product_id,)).fetchone()
        if row is None:
            raise ToolError("product not found")
        variants = [{"item_id": iid, "options": json.loads(opts), "available": bool(avail), "price": _dollars(price)}
                    for iid, opts, avail, price in self.conn.execute(
                        "SELECT item_id, options, available, price_cents FROM variants WHERE product_id = ? "
                        "ORDER BY rowid", (product_id,))]
        return _dump({"product_id": row[0], "name": row[1], "variants": variants})

    def list_all_product_types(self) -> str:
        return _dump({name: pid for pid, name in self.conn.execute("SELECT product_id, name FROM products ORDER BY name")})

    # ---- writes -----------------------------------------------------------------------------
    def cancel_pending_order(self, order_id: str, reason: str) -> str:
        order = self._order_row(order_id)
        if order[2] != "pending":
            raise ToolError("non-pending order cannot be cancelled")
        # what each payment method paid net of what it got back already (a changed payment method
        # was refunded when it was changed): refunding every payment row would pay it twice
        net: dict[str, int] = {}
        for _, kind, pm_id, cents in self._payments(order_id):
            net[pm_id] = net.get(pm_id, 0) + (cents if kind == "payment" else -cents)
        with self.conn:
            for pm_id, cents in net.items():
                if cents <= 0:
                    continue
                self._add_payment(order_id, "refund", pm_id, cents)
                self.conn.execute("UPDATE payment_methods SET balance_cents = balance_cents + ? "
                                  "WHERE payment_method_id = ? AND source = 'gift_card'", (cents, pm_id))
            self.conn.execute("UPDATE orders SET status = 'cancelled', cancel_reason = ? WHERE order_id = ?",
                              (reason, order_id))
        return f"order {order_id} cancelled"

    def modify_pending_order_address(self, order_id: str, address1: str, address2: str, city: str, state: str,
                                     country: str, zip: str) -> str:
        order = self._order_row(order_id)
        if order[2] != "pending":
            raise ToolError("non-pending order cannot be modified")
        with self.conn:
            self.conn.execute("UPDATE orders SET address1=?, address2=?, city=?, state=?, country=?, zip=? "
                              "WHERE order_id = ?", (address1, address2, city, state, country, zip, order_id))
        return f"address of order {order_id} updated"

    def modify_user_address(self, user_id: str, address1: str, address2: str, city: str, state: str,
                            country: str, zip: str) -> str:
        if self.conn.execute("SELECT 1 FROM users WHERE user_id = ?", (user_id,)).fetchone() is None:
            raise ToolError("user not found")
        with self.conn:
            self.conn.execute("UPDATE users SET address1=?, address2=?, city=?, state=?, country=?, zip=? "
                              "WHERE user_id = ?", (address1, address2, city, state, country, zip, user_id))
        return f"address of user {user_id} updated"

    def modify_pending_order_payment(self, order_id: str, payment_method_id: str) -> str:
        order = self._order_row(order_id)
        if order[2] != "pending":
            raise ToolError("non-pending order cannot be modified")
        pm = self._payment_method(order[1], payment_method_id)
        payments = self._payments(order_id)
        if len(payments) != 1 or payments[0][1] != "payment":
            raise ToolError("there should be exactly one payment for a pending order")
        _, _, old_pm, cents = payments[0]
        if old_pm == payment_method_id:
            raise ToolError("the new payment method should be different from the current one")
        if pm[1] == "gift_card" and pm[2] < cents:
            raise ToolError("insufficient gift card balance to pay for the order")
        with self.conn:
            self._add_payment(order_id, "payment", payment_method_id, cents)
            self._add_payment(order_id, "refund", old_pm, cents)
            self.conn.execute("UPDATE payment_methods SET balance_cents = balance_cents - ? "
                              "WHERE payment_method_id = ? AND source = 'gift_card'", (cents, payment_method_id))
            self.conn.execute("UPDATE payment_methods SET balance_cents = balance_cents + ? "
                              "WHERE payment_method_id = ? AND source = 'gift_card'", (cents, old_pm))
        return f"payment of order {order_id} changed to {payment_method_id}"

    def _swap_items(self, order, item_ids: list[str], new_item_ids: list[str], payment_method_id: str):
        """Checks shared by modify and exchange: the items belong to the order, each new item is another
        available variant of the same product, and a gift card covers the price difference.
        Returns (old rows, new rows, price difference in cents)."""
        old_rows = self._check_items(order[0], item_ids)
        new_rows = self._check_new_items(old_rows, new_item_ids)
        pm = self._payment_method(order[1], payment_method_id)
        diff = sum(r[3] for r in new_rows) - sum(r[3] for r in old_rows)
        if pm[1] == "gift_card" and pm[2] < diff:
            raise ToolError("insufficient gift card balance to pay for the price difference")
        return old_rows, new_rows, diff

    def modify_pending_order_items(self, order_id: str, item_ids: list[str], new_item_ids: list[str],
                                   payment_method_id: str) -> str:
        order = self._order_row(order_id)
        if order[2] != "pending":
            raise ToolError("non-pending order cannot be modified")
        old_rows, new_rows, diff = self._swap_items(order, item_ids, new_item_ids, payment_method_id)
        with self.conn:
            for old, new in zip(old_rows, new_rows):
                self.conn.execute("UPDATE order_items SET item_id = ?, price_cents = ? WHERE order_id = ? AND pos = ?",
                                  (new[0], new[3], order_id, old[0]))
            if diff != 0:
                self._add_payment(order_id, "payment" if diff > 0 else "refund", payment_method_id, abs(diff))
                self.conn.execute("UPDATE payment_methods SET balance_cents = balance_cents - ? "
                                  "WHERE payment_method_id = ? AND source = 'gift_card'", (diff, payment_method_id))
            self.conn.execute("UPDATE orders SET status = 'pending (item modified)' WHERE order_id = ?", (order_id,))
        return f"items of order {order_id} modified; price difference {_dollars(diff):.2f}"

    def return_delivered_order_items(self, order_id: str, item_ids: list[str], payment_method_id: str) -> str:
        order = self._order_row(order_id)
        if order[2] != "delivered":
            raise ToolError("non-delivered order cannot be returned")
        pm = self._payment_method(order[1], payment_method_id)
        original = {p[2] for p in self._payments(order_id) if p[1] == "payment"}
        if pm[1] != "gift_card" and payment_method_id not in original:
            raise ToolError("payment method should be either the original payment method or a gift card")
        rows = self._check_items(order_id, item_ids)
        with self.conn:
            self.conn.execute("UPDATE orders SET status = 'return requested', return_items = ?, "
                              "return_payment_method_id = ? WHERE order_id = ?",
                              (json.dumps(sorted(r[1] for r in rows)), payment_method_id, order_id))
        refund = sum(r[3] for r in rows)
        return f"return of order {order_id} requested; refund {_dollars(refund):.2f} to {payment_method_id}"

    def exchange_delivered_order_items(self, order_id: str, item_ids: list[str], new_item_ids: list[str],
                                       payment_method_id: str) -> str:
        order = self._order_row(order_id)
        if order[2] != "delivered":
            raise ToolError("non-delivered order cannot be exchanged")
        old_rows, new_rows, diff = self._swap_items(order, item_ids, new_item_ids, payment_method_id)
        pairs = sorted(zip((r[1] for r in old_rows), (r[0] for r in new_rows)))
        with self.conn:
            self.conn.execute("UPDATE orders SET status = 'exchange requested', exchange_items = ?, "
                              "exchange_new_items = ?, exchange_payment_method_id = ? WHERE order_id = ?",
                              (json.dumps([p[0] for p in pairs]), json.dumps([p[1] for p in pairs]),
                               payment_method_id, order_id))
        return f"exchange of order {order_id} requested; price difference {_dollars(diff):.2f}"

    # ---- other --------------------------------------------------------------------------------
    def calculate(self, expression: str) -> str:
        return f"{safe_calculate(expression):.2f}"

    def think(self, thought: str) -> str:
        return "ok"

    def transfer_to_human_agents(self, summary: str) -> str:
        return "Transfer successful"
