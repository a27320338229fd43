"""The stop's grace for a writer process (``--store-writer process``): one number for the two waits bounded by it.

The committer's close (commit.py ``GroupCommitter.close``) waits this long for the child's answers to the groups
still out before it gives them up (``GroupSender.abandon``: the child killed); a store closed on its own with groups
out (writer_end.py ``WriterEnd.close``) waits as long in all for the child's end before it kills it. One number:
docs/OPERATIONS.md §Store writer gives one grace for both. This module imports nothing, so both import it (an import
cycle keeps writer_end.py and commit.py apart).
"""

from __future__ import annotations

from typing import Final

__all__ = ["CLOSE_GRACE_S"]

CLOSE_GRACE_S: Final = 10.0  # the longest a stop waits for a writer process's answers (or end) before killing it
