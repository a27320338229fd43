"""Where a worker keeps plans' inputs and outputs (docs/SEMANTICS.md §Data plane).

Theory of operation:

* An *input* is one named file of one plan attempt, declared with its size and digest (by the
  ``assign``, or by the ticket of an upload that arrives first): an ``InputFile``
  (worker_agent/spool_files.py, which also says how its bytes arrive and settle). Inputs up to
  ``memory_bytes`` stay in memory; larger ones go to a file under the spool directory.
* Room is reserved when an input is declared: past ``capacity_bytes`` (0: no bound but the
  disk), or past the disk's free space, or on ``ENOSPC`` while writing, the input fails with
  ``worker_disk_full``; nothing else on the worker is affected. Inputs kept in memory are
  bounded in all by ``memory_budget_bytes``: one declared past it goes to a file however small,
  so a flood of small uploads costs disk (bounded as above), never the worker's memory.
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
  :func:`~worker_agent.spool_files.open_confined` reads a plan's outputs back without following a symbolic link.

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
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, BinaryIO, Final

import protocol
from protocol.tickets import DIGEST_DEFAULT, name_problem, new_hasher_of
from worker_agent.spool_files import (
    CHUNK,
    DISK_FULL,
    INPUTS_UNAVAILABLE,
    InputFile,
    InputReader,
    OutputFile,
    SpoolError,
    private_opener,
    remove_file,
    remove_tree,
    safe_name,
)

__all__ = ["FETCHED_GRACE_S", "MEMORY_BUDGET_BYTES", "PlanData", "Spool"]

FETCHED_GRACE_S: Final = 60.0  # an output fetched whole is kept this long more (a retried download)
MEMORY_BUDGET_BYTES: Final = 64 << 20  # inputs kept in memory, in all (the rest go to files)
ROOT_MODE: Final = 0o311  # the spool's root: passed through (an attempt's directory by its name), never listed
WORK: Final = "work"  # an attempt's scratch directory (a shell plan's cwd; outputs/ in it)


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
        path = None if in_memory else self._dir(plan_id, attempt) / f"in-{safe_name(name)}"
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
        if not self._inputs and not self._declared_at:  # nothing to drop (every plan's end without inputs)
            return
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
        target = directory / f"out-{safe_name(name)}"
        hasher = new_hasher_of(DIGEST_DEFAULT)
        try:
            if isinstance(value, bytes | bytearray | memoryview):
                size = len(value)
                self._reserve(size, name)
                with open(target, "wb", opener=private_opener) as dst:
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
        with open(target, "wb", opener=private_opener) as dst:
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
                    directory = self.root / f"{safe_name(plan_id)}.{attempt}.{secrets.token_hex(8)}"
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
