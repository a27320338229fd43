"""The SQLite store's writer alone: CPU per plan of ``SQLiteStore.write`` on realistic groups.

The records of N plans as the coordinator's core emits them for a no-op plan that waited in
the queue (a ``PlanCreated``; the events ``queued``, ``waiting``, ``leased``, ``running``,
``succeeded``; a status per step: 10 records per plan), spread over groups the way a busy
coordinator's group commit sees them: a plan is created in one group, leased in the next,
and runs and ends in the one after. Each group is one ``write`` (one transaction and fsync)
into a fresh file. Reports the writer's CPU (``time.thread_time``) and wall time per plan,
the time to ``load`` the file back, and the file's size per plan; the best of ``--repeat``.
The garbage collector runs with the coordinator daemon's thresholds.

    python bench/store_writer.py                  # 20,000 plans, groups of 900 new plans
    python bench/store_writer.py --plans 2000 --json
    python bench/store_writer.py --lone           # a sequential round trip's two commits, split up
    python bench/store_writer.py --process        # through the writer process: the parent's CPU and the child's
    python bench/store_writer.py --child-callgrind  # the child's path, callgrind instructions per plan
    python bench/store_writer.py --child-callgrind --top 15  # and its 15 costliest functions (own, per plan)
    python bench/store_writer.py --parent-callgrind --top 15  # the loop's side: encode_group, apply_keys
    python bench/store_writer.py --lone-callgrind   # a lone plan's two commits, callgrind instructions per plan

``--lone``: what one lone plan's commits cost, as a sequential round trip (bench/latency.py)
makes them: a group of the plan's creation and lease (4 records), then one of its run and end
(4 records), each one ``try_write`` (the committer's commit on the loop) into a WAL file with
``synchronous=FULL``. Reported per commit, medians of CPU (``time.thread_time``: the thread's
user and kernel time) and wall: the whole commit; the same with ``synchronous=OFF`` (everything
but the WAL's sync); the store's Python alone (a connection that runs nothing); and the
``pwrite`` + ``fdatasync`` of bench/compare.py's floor (its ``WAL_FRAMES_PER_COMMIT`` WAL frames)
in a file of the same directory. The differences are the table of issue #16: Python, SQLite's
statements, the sync. And the WAL frames a commit appends (the pages it changed;
``wal_autocheckpoint=0``, unsynced).

``--child-callgrind``: what the writer process does with a request (decode it, group its records
as ``writer_child`` does, ``write_grouped``, its keys), in this process, on the same groups encoded
as the parent sends them, with ``synchronous=OFF`` (the disk's sync is not instructions): callgrind
runs it for 900 and 6,300 plans and once more for each without the writes (making the records and
encoding them), and reports the difference of the differences per plan, so start-up and the
records' making cancel out. Plan ids come from a seeded generator: the runs are the same each time.
Machine load hardly moves the figure (it needs valgrind); each run has ``PYTHONHASHSEED=0``.

To compare two versions of the store, run it from each tree (``cd TREE && python
bench/store_writer.py``): it imports the store of the tree it is in.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sqlite3
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from coordinator.io.stores.sqlite import SQLiteStore
from coordinator.records import PlanCreated, PlanStatus, Record
from fleetwire.cli.serve import DAEMON_GC_THRESHOLDS
from protocol.messages import Event, Submit

WAITING = "all matching workers are at capacity"


def plan_steps(n: int, plan_id: str) -> list[list[Record]]:
    """The three groups' records of one plan: submit (queued, waiting), lease, run and end."""
    worker = f"w{n % 2}"
    data = {"worker_id": worker, "attempt": 1}
    submit = Submit(req_id=n, op="echo", args={"n": n}, plan_id=plan_id)
    return [
        [PlanCreated(plan_id, "bench", n, submit), Event(plan_id=plan_id, kind="queued", data={}, seq=1),
         Event(plan_id=plan_id, kind="waiting", data={"reason": WAITING}, seq=2),
         PlanStatus(plan_id, "queued", next_seq=3, waiting_reason=WAITING)],
        [Event(plan_id=plan_id, kind="leased", data=data, seq=3, attempt=1),
         PlanStatus(plan_id, "leased", 1, worker, next_seq=4)],
        [Event(plan_id=plan_id, kind="running", data=data, seq=4, attempt=1),
         PlanStatus(plan_id, "running", 1, worker, next_seq=5, worker_seq=(1, 2 * n)),
         Event(plan_id=plan_id, kind="succeeded", data={"result": {"n": n}, **data}, seq=5, attempt=1),
         PlanStatus(plan_id, "succeeded", 1, worker, next_seq=6, result={"n": n}, worker_seq=(1, 2 * n + 1))],
    ]  # fmt: skip


def groups_of(plans: int, per_group: int) -> list[list[Record]]:
    """Every plan's steps, plan ``i``'s first step in group ``i // per_group``, the next ones after."""
    groups: list[list[Record]] = [[] for _ in range(plans // per_group + 3)]
    for n in range(plans):
        for offset, step in enumerate(plan_steps(n, uuid.uuid4().hex)):
            groups[n // per_group + offset].extend(step)
    return [g for g in groups if g]


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(plans: int, per_group: int, repeat: int, process: bool = False) -> dict[str, Any]:
    groups = groups_of(plans, per_group)
    gc.freeze()
    gc.set_threshold(*DAEMON_GC_THRESHOLDS)
    best: dict[str, float] = {}
    for _ in range(repeat):
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "bench.sqlite3"
            store = SQLiteStore(path)
            child_cpu = 0.0
            if process:  # --process: the parent's CPU (every thread: the receiver's too) and the child's
                store.hand_writes_to_process()
                assert store._child is not None
                store._child.wait_ready()
                pid = store._child.pid
                cpu0, wall0, child0 = time.process_time(), time.perf_counter(), _cpu_s(pid)
                for group in groups:
                    store.send(group, _ignore)
                store.drain()
                cpu, wall, child_cpu = time.process_time() - cpu0, time.perf_counter() - wall0, _cpu_s(pid) - child0
            else:
                cpu0, wall0 = time.thread_time(), time.perf_counter()
                for group in groups:
                    store.write(group)
                cpu, wall = time.thread_time() - cpu0, time.perf_counter() - wall0
            store.close()
            conn = sqlite3.connect(path)
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            conn.close()
            size = path.stat().st_size
            store = SQLiteStore(path)
            load0 = time.perf_counter()
            loaded = store.load()
            load = time.perf_counter() - load0
            store.close()
        if len(loaded) != plans or any(len(p.events) != 5 for p in loaded):
            raise SystemExit("the store did not give every plan back with its 5 events")
        run = {"writer_cpu_us_per_plan": cpu / plans * 1e6, "writer_wall_us_per_plan": wall / plans * 1e6,
               **({"child_cpu_us_per_plan": child_cpu / plans * 1e6} if process else {}),
               "load_us_per_plan": load / plans * 1e6, "file_bytes_per_plan": size / plans}  # fmt: skip
        best = {k: min(v, best.get(k, v)) for k, v in run.items()}
    return {"bench": "store_writer", "plans": plans, "groups": len(groups), "process": process,
            "records_per_plan": sum(map(len, groups)) / plans, **{k: round(v, 2) for k, v in best.items()}}  # fmt: skip


def child_path(plans: int, writes: bool) -> None:
    """The writer process's work on ``plans`` plans' requests (a --child-callgrind run); ``writes`` off: setup only."""
    import random

    import msgspec

    from coordinator.io.stores import writer_child
    from coordinator.io.stores.writer_wire import encode_group as _encode_group

    rng = random.Random(29)
    uuid.uuid4 = lambda: uuid.UUID(int=rng.getrandbits(128))  # the same plan ids in every run
    encoder = msgspec.msgpack.Encoder()
    bodies = [_encode_group(encoder, group) for group in groups_of(plans, 900)]
    gc.freeze()
    gc.set_threshold(*DAEMON_GC_THRESHOLDS)
    if not writes:
        os._exit(0)  # no teardown: freeing what was made is not the child's work either
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bench.sqlite3"
        SQLiteStore(path).close()
        if hasattr(writer_child, "sqlite_for_one_thread"):  # as the child sets its SQLite (a tree without: as it is)
            writer_child.sqlite_for_one_thread()
        store = SQLiteStore.writer(path, encode_record=writer_child._raw_of)
        store._db.execute("PRAGMA synchronous=OFF")
        for body in bodies:
            writer_child.commit(store, [body], True)
            store.keys_message()
        store.close()
    os._exit(0)


def parent_path(plans: int, writes: bool) -> None:
    """The coordinator loop's side of ``plans`` plans' groups sent to the writer process (a --parent-callgrind run):
    each group encoded for the pipe (``encode_group``) and the child's keys of its commit applied (``apply_keys``).
    The child's commits, which make those keys, run in the setup (``writes`` off: setup only), as the requests'
    encoding for them: both cancel in the difference."""
    import random

    import msgspec

    from coordinator.io.stores import writer_child
    from coordinator.io.stores.writer_wire import encode_group as _encode_group

    rng = random.Random(29)
    uuid.uuid4 = lambda: uuid.UUID(int=rng.getrandbits(128))  # the same plan ids in every run
    encoder = msgspec.msgpack.Encoder()
    groups = groups_of(plans, 900)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bench.sqlite3"
        SQLiteStore(path).close()
        child = SQLiteStore.writer(path, encode_record=writer_child._raw_of)
        child._db.execute("PRAGMA synchronous=OFF")
        keys = []
        for group in groups:
            writer_child.commit(child, [_encode_group(encoder, group)], True)
            keys.append(child.keys_message())
        child.close()
        parent = SQLiteStore(path)
        gc.freeze()
        gc.set_threshold(*DAEMON_GC_THRESHOLDS)
        if writes:
            for group, message in zip(groups, keys, strict=True):
                _encode_group(encoder, group)
                parent.apply_keys(message)
    os._exit(0)


def child_callgrind(
    path_flag: str = "--child-path", small: int = 900, large: int = 6300, top: int = 0
) -> tuple[float, list[tuple[float, str]]]:
    """Callgrind instructions per plan of ``path_flag``'s path (the child's; --lone-path: a lone plan's two commits):
    ``large`` plans against ``small``, less the setup's difference; with ``top``, the ``top`` functions' own
    instructions per plan, the same difference of differences (callgrind_annotate of each run)."""
    import re
    import subprocess

    counts = {}
    functions: dict[tuple[int, bool], dict[str, int]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for plans in (small, large):
            for writes in (True, False):
                out_file = f"{tmp}/cg-{plans}-{writes}.out"
                cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out_file}", sys.executable,
                       __file__, path_flag, str(plans), *([] if writes else ["--setup-only"])]  # fmt: skip
                # One hash seed for every run: the dicts' probes (plan ids, field names) the same each time.
                env = {**os.environ, "PYTHONHASHSEED": "0"}
                out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env).stderr
                found = re.search(r"Collected : (\d+)", out)
                if found is None:
                    raise SystemExit(f"callgrind gave no count: {out[-500:]}")
                counts[plans, writes] = int(found.group(1))
                if top:
                    functions[plans, writes] = _functions(out_file)
    path_ir = (counts[large, True] - counts[small, True]) - (counts[large, False] - counts[small, False])
    ranked: list[tuple[float, str]] = []
    if top:
        names = set().union(*functions.values())
        runs = ((large, True), (small, True), (large, False), (small, False))
        for name in names - {":PROGRAM"}:  # callgrind_annotate's totals line
            a, b, c, d = (functions[key].get(name, 0) for key in runs)
            ranked.append((((a - b) - (c - d)) / (large - small), name))
        ranked = sorted(ranked, reverse=True)[:top]
    return path_ir / (large - small), ranked


def _functions(out_file: str) -> dict[str, int]:
    """Each function's own instructions in a callgrind output (callgrind_annotate), keyed by file:function."""
    import re
    import subprocess

    text = subprocess.run(["callgrind_annotate", "--inclusive=no", "--threshold=100", out_file],
                          capture_output=True, text=True, check=True).stdout  # fmt: skip
    found: dict[str, int] = {}
    for match in re.finditer(r"^\s*([\d,]+) \(\s*[\d.]+%\)\s+(\S+)", text, re.MULTILINE):
        where, _, function = match.group(2).rpartition(":")
        name = f"{where.rsplit('/', 1)[-1]}:{function}"
        found[name] = found.get(name, 0) + int(match.group(1).replace(",", ""))
    return found


def lone_path(plans: int, writes: bool) -> None:
    """``plans`` lone plans' two commits each, ``try_write`` on the coordinator's connection (a --lone-callgrind run,
    ``synchronous=OFF``: the sync is the kernel's, not instructions); ``writes`` off: setup only."""
    import random

    rng = random.Random(29)
    steps = [lone_groups(n, f"{rng.getrandbits(128):032x}") for n in range(plans + 1)]
    gc.freeze()
    gc.set_threshold(*DAEMON_GC_THRESHOLDS)
    with tempfile.TemporaryDirectory() as tmp:
        store = SQLiteStore(Path(tmp) / "bench.sqlite3")
        store._db.execute("PRAGMA synchronous=OFF")
        for group in steps[0]:  # the statements prepared, the pages read: as in a running coordinator
            store.try_write(group)
        if writes:
            for groups in steps[1:]:
                for group in groups:
                    store.try_write(group)
        os._exit(0)


def lone_groups(n: int, plan_id: str) -> list[list[Record]]:
    """A lone plan's two groups, as a sequential round trip commits them: submit and lease; run and end."""
    data = {"worker_id": "w1", "attempt": 1}
    submit = Submit(req_id=n, op="echo", args=n, plan_id=plan_id)
    return [
        [PlanCreated(plan_id, "bench", n, submit), Event(plan_id=plan_id, kind="queued", data={}, seq=1),
         Event(plan_id=plan_id, kind="leased", data=data, seq=2, attempt=1),
         PlanStatus(plan_id, "leased", 1, "w1", next_seq=3)],
        [Event(plan_id=plan_id, kind="running", data=data, seq=3, attempt=1),
         Event(plan_id=plan_id, kind="echo", data={"result": n}, seq=4, attempt=1),
         Event(plan_id=plan_id, kind="succeeded", data={"result": n, **data}, seq=5, attempt=1),
         PlanStatus(plan_id, "succeeded", 1, "w1", next_seq=6, result=n, worker_seq=(1, n))],
    ]  # fmt: skip


class _NoStatements:
    """A connection that runs nothing: what is left of a commit is the store's Python."""

    in_transaction = False

    def execute(self, *args: Any) -> _NoStatements:
        return self

    def executemany(self, *args: Any) -> _NoStatements:
        return self

    def fetchone(self) -> tuple[int]:
        return (0,)


def _ignore(error: BaseException | None) -> None:
    if error is not None:
        raise SystemExit(f"the writer process failed: {error}")


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def lone_commits(plans: int, mode: str) -> tuple[float, float]:
    """Median CPU and wall seconds of one lone plan's commit (``mode``: full, sync_off, python)."""
    with tempfile.TemporaryDirectory() as tmp:
        store = SQLiteStore(Path(tmp) / "bench.sqlite3")
        db = store._db
        if mode == "sync_off":
            db.execute("PRAGMA synchronous=OFF")
        if mode == "python":
            store._db = _NoStatements()  # type: ignore[assignment]
        write = store.try_write if mode != "python" else store.write
        steps = [lone_groups(n, uuid.uuid4().hex) for n in range(plans)]
        cpu: list[float] = []
        wall: list[float] = []
        for groups in steps:
            for group in groups:
                c0, w0 = time.thread_time(), time.perf_counter()
                write(group)
                cpu.append(time.thread_time() - c0)
                wall.append(time.perf_counter() - w0)
        store._db = db
        store.close()
    return _median(cpu), _median(wall)


def wal_frames_per_commit(plans: int) -> float:
    """WAL frames one lone plan's commit appends (``wal_autocheckpoint=0``, unsynced: a count, not a time).

    Each frame is a page the commit changed: the plan's row's (and now and then a split's), and until schema 6 the
    generation's in ``store_meta`` too (docs/PERFORMANCE.md §W29c).
    """
    with tempfile.TemporaryDirectory() as tmp:
        store = SQLiteStore(Path(tmp) / "bench.sqlite3")
        store._db.execute("PRAGMA synchronous=OFF")
        store._db.execute("PRAGMA wal_autocheckpoint=0")
        steps = [lone_groups(n, uuid.uuid4().hex) for n in range(plans + 10)]
        for groups in steps[:10]:  # the first pages made
            for group in groups:
                store.try_write(group)
        wal = store.path.with_name(store.path.name + "-wal")
        before, commits = wal.stat().st_size, store.writes
        for groups in steps[10:]:
            for group in groups:
                store.try_write(group)
        frames = (wal.stat().st_size - before) / (24 + 4096) / (store.writes - commits)
        store.close()
    return frames


def fdatasync_commit(samples: int) -> tuple[float, float]:
    """Median CPU and wall seconds of a commit's WAL frames written in place + ``fdatasync``: bench/compare.py's
    floor, its ``WAL_FRAMES_PER_COMMIT`` frames in a WAL of ``WAL_BYTES``."""
    from compare import WAL_BYTES, WAL_FRAME, WAL_FRAMES_PER_COMMIT

    frame = os.urandom(WAL_FRAME * WAL_FRAMES_PER_COMMIT)
    size = WAL_BYTES
    with tempfile.TemporaryDirectory() as tmp:
        fd = os.open(Path(tmp) / "wal", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.ftruncate(fd, size)
            os.fsync(fd)
            cpu: list[float] = []
            wall: list[float] = []
            for i in range(samples):
                c0, w0 = time.thread_time(), time.perf_counter()
                os.pwrite(fd, frame, (i * len(frame)) % (size - len(frame)))
                os.fdatasync(fd)
                cpu.append(time.thread_time() - c0)
                wall.append(time.perf_counter() - w0)
        finally:
            os.close(fd)
    return _median(cpu), _median(wall)


def measure_lone(plans: int) -> dict[str, Any]:
    gc.freeze()
    gc.set_threshold(*DAEMON_GC_THRESHOLDS)
    out: dict[str, Any] = {"bench": "store_writer_lone", "plans": plans, "commits": 2 * plans}
    for mode in ("full", "sync_off", "python"):
        cpu, wall = lone_commits(plans, mode)
        out[f"{mode}_cpu_us"], out[f"{mode}_wall_us"] = round(cpu * 1e6, 1), round(wall * 1e6, 1)
    cpu, wall = fdatasync_commit(2 * plans)
    out["fdatasync_cpu_us"], out["fdatasync_wall_us"] = round(cpu * 1e6, 1), round(wall * 1e6, 1)
    out["wal_frames_per_commit"] = round(wal_frames_per_commit(plans), 2)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plans", type=int, default=20_000, help="plans to write (default 20000)")
    parser.add_argument("--group", type=int, default=900, help="new plans per group (default 900)")
    parser.add_argument("--repeat", type=int, default=3, help="runs; the best is reported (default 3)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--process", action="store_true",
                        help="the writes through the writer process (--store-writer process), pipelined: the "
                             "parent's CPU (every thread) and the child's per plan")
    parser.add_argument("--child-callgrind", action="store_true",
                        help="the writer process's path (decode, group, write) in callgrind instructions per plan")
    parser.add_argument("--top", type=int, default=0, metavar="N",
                        help="with --child-callgrind or --parent-callgrind: the N functions with the most own "
                             "instructions per plan")  # fmt: skip
    parser.add_argument("--child-path", type=int, metavar="N", help=argparse.SUPPRESS)  # --child-callgrind's runs
    parser.add_argument("--parent-callgrind", action="store_true",
                        help="the coordinator loop's side of a group sent to the writer process (encode_group, "
                             "apply_keys of the child's reply) in callgrind instructions per plan")  # fmt: skip
    parser.add_argument("--parent-path", type=int, metavar="N", help=argparse.SUPPRESS)  # --parent-callgrind's runs
    parser.add_argument("--setup-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--lone", action="store_true",
                        help="a lone plan's two commits (a sequential round trip's), split into Python, SQLite, sync")
    parser.add_argument("--lone-callgrind", action="store_true",
                        help="a lone plan's two commits on the coordinator's connection, unsynced, in callgrind "
                             "instructions per plan")  # fmt: skip
    parser.add_argument("--lone-path", type=int, metavar="N", help=argparse.SUPPRESS)  # --lone-callgrind's runs
    args = parser.parse_args(argv)
    if args.child_path is not None:
        child_path(args.child_path, not args.setup_only)
        return 0
    if args.lone_path is not None:
        lone_path(args.lone_path, not args.setup_only)
        return 0
    if args.parent_path is not None:
        parent_path(args.parent_path, not args.setup_only)
        return 0
    if args.lone_callgrind:
        per_plan = round(child_callgrind("--lone-path", 200, 1200)[0])
        if args.json:
            print(json.dumps({"bench": "store_writer_lone_callgrind", "instructions_per_plan": per_plan}))
        else:
            print(f"fleetwire store writer, a lone plan's two commits: {per_plan:,} instructions per plan (callgrind)")
        return 0
    if args.child_callgrind or args.parent_callgrind:
        side = "child" if args.child_callgrind else "parent"
        instructions, top = child_callgrind(f"--{side}-path", top=args.top)
        per_plan = round(instructions)
        if args.json:
            print(json.dumps({"bench": f"store_writer_{side}_callgrind", "instructions_per_plan": per_plan,
                              **({"top": [[round(ir), name] for ir, name in top]} if args.top else {})}))  # fmt: skip
        else:
            what = "the child's path" if side == "child" else "the loop's side (encode_group, apply_keys)"
            print(f"fleetwire store writer process, {what}: {per_plan:,} instructions per plan (callgrind)")
            for ir, name in top:
                print(f"  {ir:9,.0f}  {name}")
        return 0
    if args.lone:
        lone = measure_lone(min(args.plans, 2000))
        if args.json:
            print(json.dumps(lone, sort_keys=True))
            return 0
        print(f"fleetwire store writer, lone plans: {lone['commits']} commits of 4 records; median per commit")
        print(f"  whole commit (synchronous=FULL): CPU {lone['full_cpu_us']} µs, wall {lone['full_wall_us']} µs")
        print(f"  without the WAL sync (OFF):      CPU {lone['sync_off_cpu_us']} µs, "
              f"wall {lone['sync_off_wall_us']} µs")
        print(f"  the store's Python alone:        CPU {lone['python_cpu_us']} µs")
        print(f"  pwrite floor + fdatasync alone:  CPU {lone['fdatasync_cpu_us']} µs, "
              f"wall {lone['fdatasync_wall_us']} µs")
        print(f"  WAL frames a commit:             {lone['wal_frames_per_commit']}")
        return 0
    result = measure(args.plans, args.group, args.repeat, args.process)
    if args.json:
        print(json.dumps(result, sort_keys=True))
    else:
        print(f"fleetwire store writer: {args.plans} plans, {result['groups']} groups, "
              f"{result['records_per_plan']:.0f} records per plan")  # fmt: skip
        print(f"  writer CPU {result['writer_cpu_us_per_plan']:.1f} µs per plan "
              f"(wall {result['writer_wall_us_per_plan']:.1f}); load {result['load_us_per_plan']:.1f} µs per plan; "
              f"file {result['file_bytes_per_plan']:.0f} bytes per plan")  # fmt: skip
        if args.process:
            print(f"  (--process: the writer above is the coordinator's side; its child "
                  f"{result['child_cpu_us_per_plan']:.1f} µs CPU per plan)")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
