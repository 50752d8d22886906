"""Writing a result file in one step: a reader sees the old file or the whole new one."""

from __future__ import annotations

import pytest

from sinkflex_core.paths import atomic_path, write_text_atomic


def test_a_write_that_fails_leaves_the_old_file_and_no_temporary_file(tmp_path):
    path = tmp_path / "table.csv"
    path.write_text("old\n")
    with pytest.raises(RuntimeError), atomic_path(path) as tmp:
        tmp.write_text("half of the new")
        raise RuntimeError("cut off")
    assert path.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["table.csv"]
    write_text_atomic(path, "new\n")
    assert path.read_text() == "new\n" and sorted(p.name for p in tmp_path.iterdir()) == ["table.csv"]


def test_two_writers_of_one_path_at_once_each_write_their_own_file(tmp_path):
    # two processes (or test workers) writing one cache file: with one shared temporary name the first
    # to finish moved the second's half-written file into place and the second failed
    path = tmp_path / "cache.json"
    with atomic_path(path) as first, atomic_path(path) as second:
        assert first != second and first.parent == second.parent == tmp_path
        first.write_text("A" * 1000)
        second.write_text("B" * 10)
        with open(first, "a") as f:  # the first writer is still writing
            f.write("A")
    assert path.read_text() == "A" * 1001  # the last to finish, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache.json"]
