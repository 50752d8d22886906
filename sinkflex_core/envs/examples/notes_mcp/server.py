"""The notes store as an MCP server (official SDK, FastMCP), state in SQLite.

    python -m sinkflex_core.envs.examples.notes_mcp.server [--db notes.sqlite]   # stdio
    python -m sinkflex_core.envs.examples.notes_mcp.server --http 8765           # streamable HTTP

The database is in memory unless ``--db`` names a file, so every stdio start is a fresh store.
"""

from __future__ import annotations

import argparse
import json
import sqlite3

from mcp.server.fastmcp import FastMCP

MAX_TEXT = 2000


def build_server(db: str = ":memory:", port: int = 8765) -> FastMCP:
    conn = sqlite3.connect(db, check_same_thread=False)
    conn.executescript("CREATE TABLE IF NOT EXISTS notes (id INTEGER PRIMARY KEY, title TEXT NOT NULL, "
                       "body TEXT NOT NULL, tags TEXT NOT NULL DEFAULT '[]')")
    mcp = FastMCP("notes", log_level="WARNING", host="127.0.0.1", port=port)

    def row(r) -> dict:
        return {"id": r[0], "title": r[1], "body": r[2], "tags": json.loads(r[3])}

    def get(note_id: int):
        r = conn.execute("SELECT id, title, body, tags FROM notes WHERE id = ?", (note_id,)).fetchone()
        if r is None:
            raise ValueError(f"no note with id {note_id}")
        return r

    def short(text: str, what: str) -> str:
        if len(text) > MAX_TEXT:
            raise ValueError(f"{what} is longer than {MAX_TEXT} characters")
        return text

    @mcp.tool()
    def add_note(title: str, body: str, tags: list[str] | None = None) -> str:
        """Store a new note; returns its id."""
        tags = [short(t, "a tag") for t in (tags or [])][:20]
        with conn:
            cur = conn.execute("INSERT INTO notes (title, body, tags) VALUES (?, ?, ?)",
                               (short(title, "the title"), short(body, "the body"), json.dumps(tags)))
        return json.dumps({"id": cur.lastrowid})

    @mcp.tool()
    def list_notes(tag: str | None = None) -> str:
        """Every note (id, title, tags), or only those with the given tag."""
        notes = [row(r) for r in conn.execute("SELECT id, title, body, tags FROM notes ORDER BY id")]
        return json.dumps([{k: n[k] for k in ("id", "title", "tags")} for n in notes if tag is None or tag in n["tags"]])

    @mcp.tool()
    def search_notes(query: str) -> str:
        """Notes whose title or body contains the text (case-insensitive)."""
        q = short(query, "the query").lower()
        notes = [row(r) for r in conn.execute("SELECT id, title, body, tags FROM notes ORDER BY id")]
        return json.dumps([n for n in notes if q in n["title"].lower() or q in n["body"].lower()])

    @mcp.tool()
    def get_note(note_id: int) -> str:
        """One note with its body."""
        return json.dumps(row(get(note_id)))

    @mcp.tool()
    def update_note(note_id: int, body: str) -> str:
        """Replace a note's body."""
        get(note_id)
        with conn:
            conn.execute("UPDATE notes SET body = ? WHERE id = ?", (short(body, "the body"), note_id))
        return json.dumps(row(get(note_id)))

    @mcp.tool()
    def delete_note(note_id: int) -> str:
        """Delete a note."""
        get(note_id)
        with conn:
            conn.execute("DELETE FROM notes WHERE id = ?", (note_id,))
        return json.dumps({"deleted": note_id})

    @mcp.tool()
    def reset_store() -> str:
        """Delete every note (the environment calls it between episodes; agents never see it)."""
        with conn:
            conn.execute("DELETE FROM notes")
        return json.dumps({"notes": 0})

    return mcp


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="The notes store as an MCP server.")
    parser.add_argument("--db", default=":memory:", help="SQLite file (default: in memory)")
    parser.add_argument("--http", type=int, default=None, metavar="PORT",
                        help="serve streamable HTTP on 127.0.0.1:PORT instead of stdio")
    args = parser.parse_args(argv)
    server = build_server(args.db, args.http or 8765)
    server.run("streamable-http" if args.http else "stdio")


if __name__ == "__main__":
    main()
