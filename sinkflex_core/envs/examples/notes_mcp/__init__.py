"""A small notes store served over MCP (FastMCP, SQLite): the example behind ``sinkflex/MCP-v0``.

``server.py`` is the MCP server, ``tasks.json`` its tasks, ``checks.py`` their verifier (a Python
callable, and a command for the answer-only tasks) and ``expert.py`` an agent that solves them."""

from importlib import resources

TASKS_FILE = str(resources.files(__package__).joinpath("tasks.json"))
SERVER_MODULE = f"{__package__}.server"
