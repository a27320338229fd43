"""A store with commits and no generation side file is refused like one behind it (issue #25 part 4).

Without the side file nothing shows which commits were acknowledged: a ``-wal`` cut after a
kill -9 with the side file also gone started silently, acknowledged plans lost and finished
ones queued again. Real SQLite files, damaged the way that run damaged them.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator.io.stores.admin import check_store
from coordinator.io.stores.integrity import StoreDamaged, marker_problem
from coordinator.io.stores.sqlite import SQLiteStore
from coordinator.io.stores.store import DB_FILE
from tests.unit.test_store_integrity import _crash_copy, fill


def _marker(path: Path) -> Path:
    return path.with_name(path.name + ".generation")


@pytest.mark.parametrize("how", ["deleted", "emptied", "garbled"])
def test_a_cut_wal_with_its_generation_file_gone_is_refused(tmp_path: Path, how: str) -> None:
    """-wal cut after a crash and the side file deleted, emptied or garbled: refused, naming the file."""
    store = fill(tmp_path / "live" / DB_FILE, close=False)
    copy = _crash_copy(store, tmp_path / "crash")
    store.close()
    wal = copy.with_name(copy.name + "-wal")
    with open(wal, "r+b") as f:
        f.truncate(wal.stat().st_size // 2)
    marker = _marker(copy)
    if how == "deleted":
        marker.unlink()
    else:
        marker.write_bytes(b"" if how == "emptied" else b"\x00garbage\n")
    with pytest.raises(StoreDamaged, match=r"holds \d+ commits but its generation file .* is missing or empty"):
        SQLiteStore(copy)
    assert not check_store(copy).sound  # `fleetwire store check` says so too (exit 3)


def test_accepting_a_missing_generation_file_starts_and_the_next_start_is_clean(tmp_path: Path) -> None:
    """--accept-store-loss is a way out: the loss is listed, the side file follows the database from then on."""
    path = tmp_path / DB_FILE
    fill(path)
    _marker(path).unlink()
    with pytest.raises(StoreDamaged, match="missing or empty"):
        SQLiteStore(path)
    accepted = SQLiteStore(path, accept_loss=True)
    assert len(accepted.losses) == 1 and "may be lost" in accepted.losses[0]
    assert len(accepted.load()) == 6
    accepted.close()
    SQLiteStore(path).close()
    assert check_store(path).sound


def test_a_new_store_has_a_durable_generation_file_and_starts_again(tmp_path: Path) -> None:
    """A store created without commits starts with a side file of 0; reopening it without commits is fine."""
    path = tmp_path / DB_FILE
    SQLiteStore(path).close()
    assert int(_marker(path).read_text()) == 0
    _marker(path).unlink()  # no commit was ever acknowledged: nothing to refuse
    SQLiteStore(path).close()


def test_marker_problem_rules() -> None:
    """Behind or missing with commits: a problem; ahead of it or missing without commits: sound."""
    assert marker_problem(5, 7, "m") is not None
    assert marker_problem(5, None, "m") is not None
    assert marker_problem(7, 5, "m") is None  # a power cut leaves the side file behind, never ahead
    assert marker_problem(0, None, "m") is None
