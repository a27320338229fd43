"""Where a worker keeps plans' inputs and outputs (docs/SEMANTICS.md §Data plane).

Theory of operation:

* An *input* is one named file of one plan attempt, declared with its size and digest (by the
  ``assign``, or by the ticket of an upload that arrives first). Its bytes arrive in order,
  possibly over several connections (resume): :attr:`InputFile.received` is the acknowledged
  offset. Inputs up to ``memory_bytes`` stay in memory; larger ones go to a file under the
  spool directory. The digest is computed as the bytes arrive; the last byte settles the input:
  ``verified``, or ``failed`` (``input_mismatch``) with an error that names it.
* Room is reserved when an input is declared: past ``capacity_bytes`` (0: no bound but the
  disk), or past the disk's free space, or on ``ENOSPC`` while writing, the input fails with
  ``worker_disk_full``; nothing else on the worker is affected. Inputs kept in memory are
  bounded in all by ``memory_budget_bytes``: one declared past it goes to a file however small,
  so a flood of small uploads costs disk (bounded as above), never the worker's memory.
* A digest that does not match when the last byte arrived is taken for damage in transit: the
  input's bytes are dropped and it starts again from offset 0 (:meth:`InputFile.restart`), at
  most :data:`INPUT_RESTARTS` times; the next mismatch fails it ``input_mismatch``.
* An *output* is a file a handler left (``ctx.output``): copied into the spool, its size and
  digest computed once. It lives until ``output_retention_s`` after it was made, or a short
  grace after a complete download (:meth:`Spool.fetched`), or until the worker stops (outputs
  are not durable: a worker that dies loses them).
* :class:`PlanData` is one attempt's view for its handler: ``ctx.inputs`` and ``ctx.output``.
* Layout and permissions (docs/OPERATIONS.md §Security, "What a plan sees"): the root is mode
  0311 (no one lists it, not even its owner without a chmod), each attempt has a directory of its
  own named ``<plan>.<attempt>.<16 random hex digits>`` (0700; files 0600): its inputs ``in-*``,
  the outputs kept ``out-*``, and ``work/``, the scratch a ``shell`` plan runs in (its
  ``$FLEETWIRE_OUTPUT_DIR`` is ``work/outputs``), removed when the attempt ends; the directory
  goes once the attempt holds nothing more. So a path a plan is handed leads to its own files
  only: another attempt's directory cannot be found by listing a parent, nor guessed.
  :func:`open_confined` reads a plan's outputs back without following a symbolic link.

Everything here runs on the agent's event loop except :meth:`PlanData.output` (any thread).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import os
import secrets
import shutil
import stat
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, BinaryIO, Final, Literal

import protocol
from protocol.tickets import DIGEST_DEFAULT, name_problem, new_hasher, new_hasher_of
from wireio.writeback import DIRECT_ALIGN, O_DIRECT, WriteBehind, page_aligned, pwrite_all

__all__ = [
    "DISK_FULL",
    "INPUTS_UNAVAILABLE",
    "INPUT_MISMATCH",
    "InputFile",
    "InputReader",
    "OutputFile",
    "PlanData",
    "Spool",
    "SpoolError",
    "open_confined",
    "remove_file",
    "remove_tree",
]

DISK_FULL: Final = "worker_disk_full"
INPUT_MISMATCH: Final = "input_mismatch"
INPUTS_UNAVAILABLE: Final = "inputs_unavailable"
FETCHED_GRACE_S: Final = 60.0  # an output fetched whole is kept this long more (a retried download)
INPUT_RESTARTS: Final = 2  # an input whose digest did not match starts again from 0 this many times
MEMORY_BUDGET_BYTES: Final = 64 << 20  # inputs kept in memory, in all (the rest go to files)
CHUNK: Final = 1 << 20
UNLINK_AWAY_BYTES: Final = 8 << 20  # a spool file this big is unlinked in a thread (see remove_file)
ROOT_MODE: Final = 0o311  # the spool's root: passed through (an attempt's directory by its name), never listed
WORK: Final = "work"  # an attempt's scratch directory (a shell plan's cwd; outputs/ in it)

InputState = Literal["receiving", "verified", "failed"]


class SpoolError(Exception):
    """An input or output could not be kept: ``code`` is the plan's failure code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class InputFile:
    """One declared input of one plan attempt, as it arrives."""

    def __init__(self, name: str, size: int, digest: str, path: Path | None, clock: Any = time.monotonic) -> None:
        self.name = name
        self.size = size
        self.digest = digest
        self.path = path  # None: held in memory
        self.buffer: bytearray | None = bytearray() if path is None else None
        self.received = 0
        self.state: InputState = "receiving"
        self.error: protocol.ErrorInfo | None = None
        self.busy = False  # an upload is writing it now
        self.restarts = 0  # times its bytes were dropped for a digest mismatch and it started again from 0
        self.mismatch = ""  # the last mismatch, while it is being sent again
        self.via = "direct"  # how its bytes came: "direct" (the HTTP endpoint) or "relay" (worker_agent/relay.py)
        self.settled = asyncio.Event()
        self.progressed_at = clock()  # when its last bytes were stored (or it was declared)
        self._clock = clock
        self._hasher = new_hasher(digest)
        self._file: BinaryIO | None = None
        self._behind: WriteBehind | None = None  # the file's writeback pacing (direct uploads)
        self._direct_fd: int | None = None  # the file opened with O_DIRECT (aligned blocks of direct uploads)
        self._direct_ok = bool(O_DIRECT)  # False once the file system refused O_DIRECT
        self.direct_bytes = 0  # of what was written, the bytes that went by O_DIRECT
        self._file_stale = False  # O_DIRECT wrote since the buffered file last wrote: seek it first

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Append bytes at :attr:`received` (on the event loop).

        Raises:
            SpoolError: ``worker_disk_full`` (the input has failed).
        """
        try:
            self.store(data)
        except OSError as exc:
            self.write_failed(exc)

    def store(self, data: bytes | bytearray | memoryview) -> None:
        """Append bytes at :attr:`received`: write and hash them, nothing else. Any thread, one at a time.

        Raises:
            OSError: the write failed (then call :meth:`write_failed` on the event loop).
        """
        self.put(data)
        self.hash(data)
        self.advance(len(data))

    def put(self, data: bytes | bytearray | memoryview, *, write_behind: bool = False, direct_io: bool = False) -> None:
        """The writing half of :meth:`store` (a thread may run it while another runs :meth:`hash`).

        ``write_behind``: pace the file's writeback as it grows (wireio/writeback.py), so a big
        input does not pile up in the page cache; it may wait for the disk, so only from a thread.
        ``direct_io``: write ``data`` with ``O_DIRECT`` when it can be (page-aligned memory, a
        whole number of pages, at a page-aligned offset; a file system that takes it): the disk
        reads it straight from the buffer, with no copy into the page cache and nothing to write
        back (0.03-0.06 CPU s per GiB, where a paced buffered write costs ~0.28). The rest (a
        short last chunk, a resume at an odd offset) is written as ``write_behind`` says.
        """
        if self.buffer is not None:
            self.buffer += data
        elif direct_io and self._direct_ok and self._put_direct(data):
            return
        else:
            if self._file is None:
                assert self.path is not None
                self._file = open(self.path, "r+b" if self.received else "wb", opener=_private)
                self._file.seek(self.received)
            elif self._file_stale:  # past what went by O_DIRECT (each chunk advanced once stored)
                self._file.seek(self.received)
            self._file_stale = False
            self._file.write(data)
            if write_behind:
                if self._behind is None:
                    self._behind = WriteBehind(self._file.fileno(), self.received)
                self._behind.wrote(self.received + len(data))

    def _put_direct(self, data: bytes | bytearray | memoryview) -> bool:
        """Write ``data`` at :attr:`received` with ``O_DIRECT``: True, or False when it cannot be (nothing written)."""
        view = memoryview(data).cast("B")
        if self.received % DIRECT_ALIGN or view.nbytes % DIRECT_ALIGN or not view.nbytes or not page_aligned(view):
            return False
        assert self.path is not None
        if self._direct_fd is None:
            flags = os.O_WRONLY | os.O_CREAT | O_DIRECT | (os.O_TRUNC if not self.received else 0)
            try:
                self._direct_fd = os.open(self.path, flags, 0o600)
            except OSError as exc:
                if exc.errno != errno.EINVAL:  # EINVAL: this file system has no O_DIRECT (tmpfs, some FUSE)
                    raise
                self._direct_ok = False
                return False
        if self._file is not None:
            self._file.flush()  # what the buffered file holds goes first
        try:
            pwrite_all(self._direct_fd, view, self.received)
        except OSError as exc:
            if exc.errno != errno.EINVAL:  # EINVAL: O_DIRECT opened but not written here
                raise
            os.close(self._direct_fd)  # what it wrote of the chunk, if any, the buffered write writes again
            self._direct_fd, self._direct_ok = None, False
            return False
        self.direct_bytes += view.nbytes
        self._file_stale = True  # the buffered file's position is behind what O_DIRECT wrote
        return True

    def hash(self, data: bytes | bytearray | memoryview) -> None:
        """The hashing half of :meth:`store`."""
        self._hasher.update(data)

    def advance(self, count: int) -> None:
        """Both halves of :meth:`store` are done for ``count`` more bytes: they are acknowledged."""
        self.received += count
        self.progressed_at = self._clock()

    def write_failed(self, exc: OSError) -> None:
        """A :meth:`store` failed: a full disk fails the input (``SpoolError``); anything else is raised again."""
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            self.fail(DISK_FULL, f"input {self.name!r}: the worker's disk is full ({exc.strerror})")
            raise SpoolError(DISK_FULL, self.error.message if self.error else "disk full") from None
        raise exc

    def pause(self) -> None:
        """The upload stopped (dropped or partial): close the file, keep what was written."""
        self._behind = None
        if self._direct_fd is not None:
            os.close(self._direct_fd)
            self._direct_fd = None
        if self._file is not None:
            self._file.close()
            self._file = None

    def finish(self) -> None:
        """All declared bytes arrived: check the digest and settle the input."""
        self.pause()
        got = f"{self.digest.partition(':')[0]}:{self._hasher.hexdigest()}"
        if got != self.digest:
            mismatch = f"input {self.name!r}: digest {got} does not match the declared {self.digest}"
            if self.restarts < INPUT_RESTARTS:
                self.restart(mismatch)
                return
            self.fail(INPUT_MISMATCH, f"{mismatch} ({self.restarts + 1} times: the bytes sent are not those declared)")
            return
        self.state = "verified"
        self.settled.set()

    def restart(self, mismatch: str) -> None:
        """The bytes did not have the declared digest (damaged in transit?): drop them and start again from 0."""
        self.pause()
        self.restarts += 1
        self.mismatch = (f"{mismatch}; its {self.received} bytes were dropped: send it again from offset 0 "
                         f"(retry {self.restarts} of {INPUT_RESTARTS})")
        if self.buffer is not None:
            self.buffer = bytearray()
        # A file is truncated by its next write from 0 (opened "wb", or O_DIRECT with O_TRUNC): unlinking it in
        # a thread (remove_file) could remove the file that write makes.
        self._hasher = new_hasher(self.digest)
        self._file_stale = False
        self.received = 0
        self.progressed_at = self._clock()

    def fail(self, code: str, message: str) -> None:
        """Settle the input as failed (its bytes are dropped)."""
        self.pause()
        self.state = "failed"
        self.error = protocol.ErrorInfo(code=code, message=message, detail={"input": self.name})
        self.buffer = None
        if self.path is not None:
            remove_file(self.path, self.received)
        self.settled.set()

    def discard(self) -> None:
        """Drop the bytes (the attempt ended)."""
        self.pause()
        self.buffer = None
        if self.path is not None:
            remove_file(self.path, self.received)


class OutputFile:
    """One output a handler left, kept for download."""

    __slots__ = ("digest", "expires_at", "name", "path", "size")

    def __init__(self, name: str, path: Path, size: int, digest: str, expires_at: float) -> None:
        self.name = name
        self.path = path
        self.size = size
        self.digest = digest
        self.expires_at = expires_at

    def spec(self) -> protocol.OutputSpec:
        return protocol.OutputSpec(name=self.name, size=self.size, digest=self.digest)


class Spool:
    """Inputs and outputs of the plans of one worker.

    Args:
        root: a directory of its own (made if missing).
        memory_bytes: inputs up to this size stay in memory.
        memory_budget_bytes: inputs kept in memory in all; one declared past it goes to a file.
        capacity_bytes: the most bytes of inputs and outputs held at once (0: only the disk bounds it).
        output_retention_s: how long an output is kept.
        clock: monotonic seconds (tests may pass their own).
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        memory_bytes: int = 1 << 20,
        memory_budget_bytes: int = MEMORY_BUDGET_BYTES,
        capacity_bytes: int = 0,
        output_retention_s: float = 3600.0,
        clock: Any = None,
    ) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(OSError):  # a root of someone else's: its owner chose its mode
            self.root.chmod(ROOT_MODE)
        self._dirs: dict[tuple[str, int], Path] = {}  # each attempt's directory (named at random)
        self._dir_keys: dict[Path, tuple[str, int]] = {}
        self._dirs_lock = threading.Lock()  # outputs (and so directories) are made from handlers' threads
        self.memory_bytes = memory_bytes
        self.memory_budget_bytes = memory_budget_bytes
        self.memory_used = 0  # declared sizes of the inputs kept in memory
        self.capacity_bytes = capacity_bytes
        self.output_retention_s = output_retention_s
        self._clock = clock or asyncio.get_running_loop().time
        self._inputs: dict[tuple[str, int], dict[str, InputFile]] = {}
        self._outputs: dict[tuple[str, int], dict[str, OutputFile]] = {}
        self._declared_at: dict[tuple[str, int], float] = {}
        self._claimed: set[tuple[str, int]] = set()  # attempts running here (their inputs are not swept)
        self._lock = threading.Lock()  # outputs are added from handlers' threads
        self.used_bytes = 0

    # ------------------------------------------------------------------ inputs

    def declare(self, plan_id: str, attempt: int, name: str, size: int, digest: str) -> InputFile:
        """The input, made on first mention (a failed one when there is no room for it)."""
        entries = self._inputs.setdefault((plan_id, attempt), {})
        self._declared_at.setdefault((plan_id, attempt), self._clock())
        entry = entries.get(name)
        if entry is not None:
            return entry
        in_memory = size <= self.memory_bytes and self.memory_used + size <= self.memory_budget_bytes
        if in_memory:
            self.memory_used += size
        path = None if in_memory else self._dir(plan_id, attempt) / f"in-{_safe(name)}"
        entry = entries[name] = InputFile(name, size, digest, path, self._clock)
        problem = self._no_room(size)
        if problem is not None:
            entry.fail(DISK_FULL, f"input {name!r} ({size} bytes): {problem}")
        else:
            self.used_bytes += size
        return entry

    def input(self, plan_id: str, attempt: int, name: str) -> InputFile | None:
        """The input if it was declared."""
        return self._inputs.get((plan_id, attempt), {}).get(name)

    def plan_data(self, plan_id: str, attempt: int, specs: list[protocol.InputSpec]) -> PlanData:
        """One attempt's inputs (declared now if they were not) and outputs, for its handler."""
        inputs = {spec.name: self.declare(plan_id, attempt, spec.name, spec.size, spec.digest) for spec in specs}
        return PlanData(self, plan_id, attempt, inputs)

    def drop_inputs(self, plan_id: str, attempt: int) -> None:
        """The attempt ended: its inputs' bytes are dropped."""
        self._declared_at.pop((plan_id, attempt), None)
        for entry in self._inputs.pop((plan_id, attempt), {}).values():
            if entry.state != "failed" or entry.error is None or entry.error.code != DISK_FULL:
                self.used_bytes -= entry.size
            if entry.path is None:
                self.memory_used -= entry.size
            entry.discard()

    def drop_unclaimed(self, plan_id: str, attempt: int) -> None:
        """The attempt ended before it ran here (or never came): its inputs go, unless a running plan holds them."""
        if (plan_id, attempt) not in self._claimed:
            self.drop_inputs(plan_id, attempt)

    # ------------------------------------------------------------------ outputs

    def add_output(
        self, plan_id: str, attempt: int, name: str, value: bytes | memoryview | str | os.PathLike[str] | BinaryIO
    ) -> OutputFile:
        """Keep an output: bytes, or a copy of the file at a path or of a file opened for reading
        (from where it is: :func:`open_confined` opens a plan's own). Any thread.

        Raises:
            ValueError: a bad name. TypeError: a value of another type.
            SpoolError: ``worker_disk_full``.
        """
        problem = name_problem(name, "output name")
        if problem is not None:
            raise ValueError(problem)
        directory = self._dir(plan_id, attempt)
        target = directory / f"out-{_safe(name)}"
        hasher = new_hasher_of(DIGEST_DEFAULT)
        try:
            if isinstance(value, bytes | bytearray | memoryview):
                size = len(value)
                self._reserve(size, name)
                with open(target, "wb", opener=_private) as dst:
                    dst.write(value)
                hasher.update(value)
            elif isinstance(value, str | os.PathLike):
                with open(value, "rb") as src:
                    size = self._copy(src, target, name, hasher)
            elif hasattr(value, "read") and hasattr(value, "fileno"):
                size = self._copy(value, target, name, hasher)
            else:
                raise TypeError(f"output {name!r} must be bytes, a path or a file, got {type(value).__name__}")
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                with contextlib.suppress(OSError):
                    target.unlink()
                raise SpoolError(DISK_FULL, f"output {name!r}: the worker's disk is full ({exc.strerror})") from None
            raise
        digest = f"{DIGEST_DEFAULT}:{hasher.hexdigest()}"
        output = OutputFile(name, target, size, digest, self._clock() + self.output_retention_s)
        with self._lock:
            previous = self._outputs.setdefault((plan_id, attempt), {}).get(name)
            self._outputs[(plan_id, attempt)][name] = output
            if previous is not None:
                self.used_bytes -= previous.size
        return output

    def _copy(self, src: BinaryIO, target: Path, name: str, hasher: Any) -> int:
        """Copy an open file into the spool (its size, as it is now, reserved first); the bytes copied."""
        size = os.fstat(src.fileno()).st_size
        self._reserve(size, name)
        copied = 0
        with open(target, "wb", opener=_private) as dst:
            while copied < size and (chunk := src.read(min(CHUNK, size - copied))):
                hasher.update(chunk)
                dst.write(chunk)
                copied += len(chunk)
        if copied != size:  # it shrank meanwhile: what it holds now (the room taken back)
            with self._lock:
                self.used_bytes -= size - copied
        return copied

    def output(self, plan_id: str, attempt: int, name: str) -> OutputFile | None:
        """An output kept for download, if any."""
        return self._outputs.get((plan_id, attempt), {}).get(name)

    def outputs_of(self, plan_id: str, attempt: int) -> list[protocol.OutputSpec]:
        """What an attempt left, for its ``done``."""
        return [o.spec() for o in self._outputs.get((plan_id, attempt), {}).values()]

    def fetched(self, output: OutputFile) -> None:
        """An output was downloaded whole: keep it only a short grace more."""
        output.expires_at = min(output.expires_at, self._clock() + FETCHED_GRACE_S)

    def drop_outputs(self, plan_id: str, attempt: int) -> None:
        """Forget an attempt's outputs (a failed or cancelled attempt)."""
        with self._lock:
            outputs = self._outputs.pop((plan_id, attempt), {})
        for output in outputs.values():
            self._remove_output(output)

    def sweep(self, stale_input_s: float, keep: Callable[[str, int], bool] | None = None) -> None:
        """Drop expired outputs, and inputs declared ``stale_input_s`` ago whose attempt never claimed them
        (nor does ``keep(plan_id, attempt)`` say to keep them: a prefetched plan waiting for a slot)."""
        now = self._clock()
        with self._lock:
            expired = [(key, o) for key, outs in self._outputs.items() for o in outs.values() if o.expires_at <= now]
            for key, output in expired:
                outs = self._outputs.get(key, {})
                outs.pop(output.name, None)
                if not outs:
                    self._outputs.pop(key, None)
        for _key, output in expired:
            self._remove_output(output)
        for key, since in list(self._declared_at.items()):
            if now - since >= stale_input_s and key not in self._claimed and (keep is None or not keep(*key)):
                self.drop_inputs(*key)

    def claim(self, plan_id: str, attempt: int) -> None:
        """An attempt runs here: its inputs are not dropped by :meth:`sweep` until it ends."""
        self._claimed.add((plan_id, attempt))

    def release(self, plan_id: str, attempt: int) -> None:
        """An attempt ended here: its inputs and its scratch directory go now."""
        self._claimed.discard((plan_id, attempt))
        self.drop_inputs(plan_id, attempt)
        self._tidy((plan_id, attempt))

    def close(self) -> None:
        """The worker stops: everything goes."""
        for key in list(self._inputs):
            self.drop_inputs(*key)
        for key in list(self._outputs):
            self.drop_outputs(*key)
        with contextlib.suppress(OSError):
            self.root.chmod(0o700)  # listable again, for rmtree
        shutil.rmtree(self.root, ignore_errors=True)

    # ------------------------------------------------------------------ helpers

    def plan_dir(self, plan_id: str, attempt: int) -> Path:
        """The attempt's directory in the spool (made on first use, 0700, named with 64 random bits)."""
        return self._dir(plan_id, attempt)

    def work_dir(self, plan_id: str, attempt: int) -> Path:
        """The attempt's scratch directory, ``work/`` in its own (made on first use, 0700; removed when it ends)."""
        work = self._dir(plan_id, attempt) / WORK
        with contextlib.suppress(FileExistsError):
            work.mkdir(mode=0o700)
        return work

    def _dir(self, plan_id: str, attempt: int) -> Path:
        key = (plan_id, attempt)
        directory = self._dirs.get(key)
        if directory is None:
            with self._dirs_lock:
                directory = self._dirs.get(key)
                if directory is None:
                    directory = self.root / f"{_safe(plan_id)}.{attempt}.{secrets.token_hex(8)}"
                    directory.mkdir(mode=0o700)
                    self._dirs[key] = directory
                    self._dir_keys[directory] = key
        return directory

    def _tidy(self, key: tuple[str, int]) -> None:
        """Remove an attempt's scratch once it is not running, and its directory once it holds nothing kept."""
        directory = self._dirs.get(key)
        if directory is None or key in self._claimed:
            return
        remove_tree(directory / WORK)
        with self._lock, self._dirs_lock:
            if key in self._inputs or key in self._outputs:
                return
            del self._dirs[key], self._dir_keys[directory]
        remove_tree(directory)

    def _no_room(self, size: int) -> str | None:
        if self.capacity_bytes and self.used_bytes + size > self.capacity_bytes:
            return f"the worker's disk is full: spool holds {self.used_bytes} of {self.capacity_bytes} bytes"
        if size > self.memory_bytes:
            try:
                free = shutil.disk_usage(self.root).free
            except OSError:
                return None
            if size > free:
                return f"the worker's disk is full: {free} bytes free"
        return None

    def _reserve(self, size: int, name: str) -> None:
        with self._lock:
            problem = self._no_room(size)
            if problem is not None:
                raise SpoolError(DISK_FULL, f"output {name!r} ({size} bytes): {problem}")
            self.used_bytes += size

    def _remove_output(self, output: OutputFile) -> None:
        with self._lock:
            self.used_bytes -= output.size
        remove_file(output.path, output.size)
        key = self._dir_keys.get(output.path.parent)
        if key is not None:
            self._tidy(key)


def remove_file(path: Path, size: int) -> asyncio.Future[None] | None:
    """Unlink a spool file; one of :data:`UNLINK_AWAY_BYTES` or more in a thread when called on an event loop.

    Freeing a big file's blocks and cached pages takes a while (about 10 ms per 64 MiB): on the
    agent's loop it would hold up everything else there, such as the ``done`` of the plan whose
    input it was (sent after its inputs are dropped) and other plans' transfers. Returns the
    thread's future (None: unlinked already).
    """
    if size >= UNLINK_AWAY_BYTES:
        with contextlib.suppress(RuntimeError):  # no running loop (or it is closing): unlink here
            return asyncio.get_running_loop().run_in_executor(None, _unlink, path)
    _unlink(path)
    return None


def _unlink(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink()


def remove_tree(path: Path) -> None:
    """Remove a directory and what is in it (a plan's scratch: in a thread when called on an event loop)."""
    if not os.path.lexists(path):
        return
    try:
        asyncio.get_running_loop().run_in_executor(None, functools.partial(shutil.rmtree, path, ignore_errors=True))
    except RuntimeError:  # no running loop: here
        shutil.rmtree(path, ignore_errors=True)


def _private(path: str, flags: int) -> int:
    """``open``'s opener for spool files: mode 0600 whatever the umask."""
    return os.open(path, flags, 0o600)


def open_confined(directory: Path, relative: str, *, owner: int | None = None) -> BinaryIO:
    """Open the regular file ``relative`` below ``directory`` for reading, never following a link.

    Each component is opened with ``O_NOFOLLOW`` from the one before (no symbolic link, no
    ``..``, nothing absolute: the path cannot leave ``directory``); a FIFO or device is refused
    without blocking. ``owner``: the uid the file must belong to (a plan user's outputs).

    Raises:
        ValueError: the path leaves ``directory``, passes a link, or names no regular file of
            ``owner``; the message says which. FileNotFoundError: nothing there.
    """
    parts = relative.split("/")
    if relative.startswith("/") or not relative or any(part in ("", ".", "..") for part in parts):
        raise ValueError(f"path {relative!r} is not a plain relative path inside the output directory "
                         "(no '..', no leading '/', no empty part)")  # fmt: skip
    nofollow = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(directory, nofollow | os.O_DIRECTORY)  # a plan (user) owning its parent may have linked it
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise ValueError(f"the output directory {directory.name!r} is a symbolic link or not a directory") from None
        raise
    try:
        for part in parts[:-1]:
            try:
                following = os.open(part, nofollow | os.O_DIRECTORY, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise ValueError(f"path {relative!r}: {part!r} is a symbolic link or not a directory") from None
                raise
            os.close(fd)
            fd = following
        try:
            file_fd = os.open(parts[-1], nofollow | os.O_NONBLOCK, dir_fd=fd)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise ValueError(f"path {relative!r} is a symbolic link; outputs must be regular files") from None
            raise
    finally:
        os.close(fd)
    info = os.fstat(file_fd)
    problem = None
    if not stat.S_ISREG(info.st_mode):
        problem = f"path {relative!r} is not a regular file"
    elif owner is not None and info.st_uid != owner:
        problem = f"path {relative!r} belongs to uid {info.st_uid}, not the plan's user (uid {owner})"
    if problem is not None:
        os.close(file_fd)
        raise ValueError(problem)
    return os.fdopen(file_fd, "rb")


def _safe(name: str) -> str:
    """A file-system-safe spelling of a validated name or plan id (no separators, no dot-dot)."""
    return "".join(c if c.isalnum() or c in "-_." else f"%{ord(c):02x}" for c in name).replace("..", "%2e.")


class InputReader:
    """One input as its handler sees it: ``.size``, ``.digest``, ``.read(n)``, ``async for chunk``, ``.path``."""

    def __init__(self, entry: InputFile, spool_dir: Callable[[], Path]) -> None:
        self._entry = entry
        self._dir = spool_dir  # the attempt's directory (made when first asked for)
        self._written: Path | None = None  # an in-memory input written out for .path, removed by close()
        self._offset = 0
        self._file: BinaryIO | None = None
        self.name = entry.name
        self.size = entry.size
        self.digest = entry.digest

    @property
    def path(self) -> Path:
        """A file holding the input (an in-memory input is written out on first use)."""
        entry = self._entry
        if entry.path is None:
            if self._written is None:
                path = self._dir() / f"in-{_safe(entry.name)}"
                with open(path, "wb", opener=_private) as file:
                    file.write(entry.buffer or b"")
                self._written = path
            return self._written
        return entry.path

    def read(self, n: int = -1) -> bytes:
        """Up to ``n`` bytes from the current position (all the rest with ``-1``)."""
        entry = self._entry
        if entry.buffer is not None:
            end = entry.size if n < 0 else min(entry.size, self._offset + n)
            data = bytes(entry.buffer[self._offset : end])
        else:
            if self._file is None:
                self._file = open(self.path, "rb")
                self._file.seek(self._offset)
            data = self._file.read(n)
        self._offset += len(data)
        return data

    def chunks(self, size: int = CHUNK) -> Iterator[bytes]:
        """The content in chunks of at most ``size`` bytes, from the start."""
        self._offset = 0
        if self._file is not None:
            self._file.seek(0)
        while chunk := self.read(size):
            yield chunk

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks():
            yield chunk

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._written is not None:
            _unlink(self._written)
            self._written = None


class PlanData:
    """One attempt's inputs and outputs, for its handler (``ctx.inputs``, ``ctx.output``)."""

    def __init__(self, spool: Spool, plan_id: str, attempt: int, inputs: dict[str, InputFile]) -> None:
        self.spool = spool
        self.plan_id = plan_id
        self.attempt = attempt
        self.entries = inputs
        attempt_dir = functools.partial(spool.plan_dir, plan_id, attempt)
        self.inputs: Mapping[str, InputReader] = {n: InputReader(entry, attempt_dir) for n, entry in inputs.items()}

    @property
    def untouched(self) -> bool:
        """Whether no byte of any input has arrived (nor is one being written)."""
        return not any(entry.received or entry.busy or entry.state != "receiving" for entry in self.entries.values())

    @property
    def work_dir(self) -> Path:
        """This attempt's scratch directory in the spool (0700; removed when the attempt ends)."""
        return self.spool.work_dir(self.plan_id, self.attempt)

    async def wait(self, timeout_s: float, on_verified: Any) -> protocol.ErrorInfo | None:
        """Wait until every input settled; the first failure, an ``inputs_unavailable``, or None.

        The bound is on silence, not on the whole transfer: the attempt fails ``inputs_unavailable``
        once ``timeout_s`` passed with no byte of its missing inputs arriving (since the wait began or
        the last bytes stored), so a slow upload that keeps going is never cut off, while a client
        that has gone (or cannot reach this worker) gets ``timeout_s`` to come back and resume.
        ``on_verified(entry)`` runs for each input as it is verified.
        """
        pending = dict(self.entries)
        clock = self.spool._clock  # the inputs' progressed_at is on it too
        began = clock()
        while pending:
            for name, entry in list(pending.items()):
                if entry.state == "failed":
                    return entry.error
                if entry.state == "verified":
                    del pending[name]
                    on_verified(entry)
            if not pending:
                break
            last = max(began, *(entry.progressed_at for entry in pending.values()))
            left = last + timeout_s - clock()
            if left <= 0:
                missing = ", ".join(f"{n!r} ({e.received} of {e.size} bytes)" for n, e in pending.items())
                return protocol.ErrorInfo(
                    code=INPUTS_UNAVAILABLE,
                    message=f"no byte of the plan's inputs arrived for {timeout_s:g} s (the worker's "
                            f"--input-timeout): {missing}; the client that submitted the plan uploads them to each "
                            "attempt's worker, so it has gone and did not come back, or cannot reach this worker's "
                            "data endpoint or the relay",
                    detail={"inputs": sorted(pending)},
                )
            waits = [asyncio.ensure_future(e.settled.wait()) for e in pending.values()]
            try:
                await asyncio.wait(waits, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()
        return None

    def output(self, name: str, value: bytes | memoryview | str | os.PathLike[str] | BinaryIO) -> protocol.OutputSpec:
        """Keep an output for the client to fetch (``plan.output(name)``). Any thread."""
        return self.spool.add_output(self.plan_id, self.attempt, name, value).spec()

    def close(self) -> None:
        for reader in self.inputs.values():
            reader.close()
