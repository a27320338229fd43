"""One child process of a store (the SQLite writer process, writer_process.py): :class:`ChildProcess`.

What it owns: the child's start (its environment without secrets, its stdin and stdout pipes, their
size), its end (SIGKILL, its exit status in words) and its reaping. What it does not: the wire, the
groups, the failure rules (writer_process.py).

Rule: nothing here waits on the event loop (docs/PERFORMANCE.md §R29). A child that died, or was
killed, is reaped by a thread of its own (:meth:`ChildProcess.when_ended`), which hands the exit
status to the loop: a child in uninterruptible sleep (a disk that does not answer) ends only when
the disk does, after its SIGKILL too, and a ``waitpid`` on the loop's thread stopped every session,
heartbeat and client for as long (``Popen.wait(timeout=5)``: up to 5 s each time). Only the
blocking callers (:meth:`end_status`, :meth:`wait`: a close in a thread, the receiver thread) wait.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import subprocess
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    import asyncio

__all__ = ["ENV_KEPT", "ChildProcess", "exit_words"]

# What a child's environment keeps of the parent's: the interpreter's and the locale's, nothing else.
ENV_KEPT: Final = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "TMPDIR", "HOME", "PYTHONPATH", "PYTHONHOME",
                   "PYTHONDONTWRITEBYTECODE", "PYTHONHASHSEED", "VIRTUAL_ENV", "COVERAGE_PROCESS_START")  # fmt: skip
_F_SETPIPE_SZ = 1031
_PIPE_BYTES = 1 << 20


def exit_words(code: int) -> str:
    """A child's exit status (``Popen.returncode``) as a failure's words."""
    if code < 0:
        return f"it was killed by signal {-code} ({signal.Signals(-code).name})"
    return f"it exited with status {code}"


class ChildProcess:
    """A started child with pipes to its stdin and from its stdout (``args`` run with :data:`ENV_KEPT` of ours).

    Args:
        args: the command.
        python_path: put in front of the child's ``PYTHONPATH`` (the tree the parent runs from).
        pass_fds: kept open in the child (a lock file both hold).

    Raises:
        OSError: the child cannot be started.
    """

    def __init__(self, args: Sequence[str], *, python_path: str = "", pass_fds: Sequence[int] = ()) -> None:
        env = {k: v for k, v in os.environ.items() if k in ENV_KEPT}
        if python_path:
            env["PYTHONPATH"] = os.pathsep.join(p for p in (python_path, env.get("PYTHONPATH")) if p)
        self.process = subprocess.Popen(list(args), stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
                                        close_fds=True, pass_fds=tuple(pass_fds))  # fmt: skip
        assert self.process.stdin is not None and self.process.stdout is not None
        self.stdin_fd = self.process.stdin.fileno()
        self.stdout_fd = self.process.stdout.fileno()
        for fd in (self.stdin_fd, self.stdout_fd):  # room for a busy group and its reply's keys: fewer blocked writes
            with contextlib.suppress(OSError):
                fcntl.fcntl(fd, _F_SETPIPE_SZ, _PIPE_BYTES)
        self._watcher: threading.Thread | None = None
        # Called on their loop once the child ended (when_ended).
        self._on_end: list[tuple[asyncio.AbstractEventLoop, Callable[[str], None]]] = []
        self._end_words: str | None = None  # the exit status in words, once the watcher reaped the child
        self._end_lock = threading.Lock()

    @property
    def pid(self) -> int:
        return self.process.pid

    def ended(self) -> str | None:
        """The exit status in words once the child ended and was reaped, else None; never waits."""
        code = self.process.poll()
        return None if code is None else exit_words(code)

    def end_status(self, wait_s: float) -> str:
        """The exit status in words, waiting up to ``wait_s`` for it (not on the loop: it blocks)."""
        try:
            return exit_words(self.process.wait(timeout=wait_s))
        except subprocess.TimeoutExpired:
            return "it closed its pipe"

    def kill(self) -> None:
        """SIGKILL, never waiting for the end (:meth:`when_ended`, :meth:`wait`)."""
        with contextlib.suppress(OSError):
            self.process.kill()

    def when_ended(
        self, loop: asyncio.AbstractEventLoop | None = None, callback: Callable[[str], None] | None = None
    ) -> None:
        """``callback(exit status in words)`` on ``loop`` once the child ended (none: only reaped then); one thread
        waits for the end, and reaps the child.

        Never waits: the thread's ``waitpid`` is the only one that blocks, and a loop closed meanwhile
        gets no call (the child is reaped all the same).
        """
        with self._end_lock:
            words = self._end_words
            if loop is not None and callback is not None:
                if words is not None:  # reaped already
                    with contextlib.suppress(RuntimeError):  # the loop closed
                        loop.call_soon_threadsafe(callback, words)
                    return
                self._on_end.append((loop, callback))
            if self._watcher is not None:
                return
            self._watcher = threading.Thread(target=self._reap, name="fleetwire-store-child-reaper", daemon=True)
        self._watcher.start()

    def _reap(self) -> None:
        words = exit_words(self.process.wait())
        with self._end_lock:
            self._end_words = words
            calls, self._on_end = self._on_end, []
        for loop, callback in calls:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: reaped, nobody to tell
                loop.call_soon_threadsafe(callback, words)

    def wait(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the end (not on the loop); False: it still runs."""
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return False
        return True

    def close_stdin(self) -> None:
        """The child's stdin closed: its end of input (a child that reads it exits then)."""
        with contextlib.suppress(OSError):
            self.process.stdin.close()  # type: ignore[union-attr]

    def close_pipes(self) -> None:
        for pipe in (self.process.stdin, self.process.stdout):
            with contextlib.suppress(OSError):
                pipe.close()  # type: ignore[union-attr]
