"""A real PostgreSQL server for the tests: initdb + pg_ctl in a temp dir, on a free 127.0.0.1 port.

No mock stands in for PostgreSQL. The server runs as the ``postgres`` user when the tests run as
root (``initdb`` refuses root; the temp dir is chowned to it), as the current user otherwise,
with ``fsync=on`` (commits are durable, as in production). Tests that need it take the
``pg_dsn`` fixture (tests/conftest.py): a fresh database per test on one server per session,
whose files the fixture keeps on tmpfs where there is room (:func:`scratch_dir`: fsync costs
nothing there, while a ``kill -9`` of the server still loses only what it had not written).
``initdb`` runs once per process: later servers start from a copy of its pristine data directory.
Without the binaries (Debian's ``postgresql`` package: ``/usr/lib/postgresql/*/bin``) or the
``asyncpg`` driver those tests skip and say why; ``.ci/run`` installs the package.
"""

from __future__ import annotations

import atexit
import contextlib
import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

__all__ = ["PostgresServer", "find_bin_dir", "missing_reason", "postgres_server", "scratch_dir", "standby_dsn"]

_pristine: dict[Path, Path] = {}  # bin dir -> a data directory straight from initdb, copied by later servers


def find_bin_dir() -> Path | None:
    """The newest ``/usr/lib/postgresql/N/bin`` holding ``initdb`` (``$FLEETWIRE_PG_BIN`` overrides)."""
    explicit = os.environ.get("FLEETWIRE_PG_BIN")
    if explicit:
        return Path(explicit) if (Path(explicit) / "initdb").exists() else None
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[-3]))
    return Path(found[-1]).parent if found else None


def missing_reason() -> str | None:
    """Why PostgreSQL tests cannot run here (None: they can)."""
    if find_bin_dir() is None:
        return ("PostgreSQL binaries not found (/usr/lib/postgresql/*/bin/initdb): `apt-get install postgresql` "
                "(.ci/run does it as root)")  # fmt: skip
    try:
        import asyncpg  # noqa: F401
    except ImportError:
        return "the asyncpg driver is not installed: pip install -e '.[test]' (or '.[postgres]')"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "running as root and there is no `postgres` user to run the server as"
    return None


def scratch_dir(min_free: int = 4 << 30) -> str | None:
    """``/dev/shm`` when it has ``min_free`` bytes free (a container's is often 64 MiB), else None (the default)."""
    with contextlib.suppress(OSError):
        stat = os.statvfs("/dev/shm")
        if stat.f_bavail * stat.f_frsize >= min_free:
            return "/dev/shm"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PostgresServer:
    """One PostgreSQL server in a temp dir; :meth:`dsn` names a database on it."""

    def __init__(self, bin_dir: Path, *, parent: str | None = None, settings: dict[str, str] | None = None) -> None:
        self.bin_dir = bin_dir
        self.settings = {"fsync": "on", "synchronous_commit": "on", **(settings or {})}
        self.root = Path(tempfile.mkdtemp(prefix="fleetwire-pg-", dir=parent))
        self.data = self.root / "data"
        self.port = _free_port()
        self.user = "postgres"
        self._as: list[str] = []
        if os.geteuid() == 0:
            entry = pwd.getpwnam("postgres")
            os.chown(self.root, entry.pw_uid, entry.pw_gid)
            self._as = ["runuser", "-u", "postgres", "--"]
        self._databases = 0

    def _run(self, *args: str) -> None:
        result = subprocess.run([*self._as, *args], capture_output=True, text=True, timeout=120, check=False)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(args[:2])} failed ({result.returncode}): {result.stderr or result.stdout}")

    def start(self) -> None:
        """initdb (trust auth for the test user, no fsync while creating the files) and start, waiting for it.

        The first server of a process keeps a copy of initdb's output; the next ones copy it (``cp -a``,
        owners kept) instead of running initdb again: 1.1-2.2 s each on 2 loaded cores.
        """
        pristine = _pristine.get(self.bin_dir)
        if pristine is None:
            keep = Path(tempfile.mkdtemp(prefix="fleetwire-pg-initdb-"))
            atexit.register(shutil.rmtree, keep, True)
            if self._as:
                entry = pwd.getpwnam(self.user)
                os.chown(keep, entry.pw_uid, entry.pw_gid)
            pristine = keep / "data"
            self._run(str(self.bin_dir / "initdb"), "-D", str(pristine), "-U", self.user, "-A", "trust",
                      "--no-sync", "-E", "UTF8", "--locale", "C")  # fmt: skip
            _pristine[self.bin_dir] = pristine
        self._run("cp", "-a", str(pristine), str(self.data))
        self._start()

    def _start(self) -> None:
        options = f"-p {self.port} -h 127.0.0.1 -k {self.root} " + " ".join(
            f"-c {k}={v}" for k, v in self.settings.items()
        )
        self._run(str(self.bin_dir / "pg_ctl"), "-D", str(self.data), "-l", str(self.root / "log"), "-w",
                  "-t", "60", "-o", options, "start")  # fmt: skip

    def replica(self, *, synchronous: bool = True) -> PostgresServer:
        """A started streaming replica of this server (``pg_basebackup -R``), on its own port.

        ``synchronous``: this server then waits for the replica's flush before acknowledging a
        commit (``synchronous_standby_names = '*'``, ``synchronous_commit = on``), so a commit
        acknowledged here survives :meth:`kill` followed by the replica's :meth:`promote`.
        """
        standby = PostgresServer(self.bin_dir, parent=str(self.root.parent), settings=self.settings)
        self._run(str(self.bin_dir / "pg_basebackup"), "-h", "127.0.0.1", "-p", str(self.port), "-U", self.user,
                  "-D", str(standby.data), "-R", "-X", "stream", "-c", "fast", "--no-sync")  # fmt: skip
        standby._start()
        if synchronous:
            self.sql("ALTER SYSTEM SET synchronous_standby_names = '*'")
            self.sql("SELECT pg_reload_conf()")
            self.sql("DO $$ BEGIN FOR i IN 1..600 LOOP EXIT WHEN EXISTS (SELECT 1 FROM pg_stat_replication "
                     "WHERE sync_state = 'sync'); PERFORM pg_sleep(0.05); END LOOP; END $$")  # fmt: skip
            if self.sql_value("SELECT count(*) FROM pg_stat_replication WHERE sync_state = 'sync'") != "1":
                raise RuntimeError(f"the replica on port {standby.port} did not become a synchronous standby")
        return standby

    def promote(self) -> None:
        """A replica becomes a primary (``pg_ctl promote``, waiting until it accepts writes)."""
        self._run(str(self.bin_dir / "pg_ctl"), "-D", str(self.data), "-w", "-t", "60", "promote")

    def kill(self) -> None:
        """``kill -9`` of the postmaster and of its children (the host is lost); the files stay for :meth:`stop`."""
        pid = int((self.data / "postmaster.pid").read_text().split()[0])
        children = []
        for stat in glob.glob("/proc/[0-9]*/stat"):
            with contextlib.suppress(OSError, ValueError, IndexError):
                fields = Path(stat).read_text().rsplit(")", 1)[1].split()
                if int(fields[1]) == pid:
                    children.append(int(Path(stat).parent.name))
        for victim in [pid, *children]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim, 9)

    def pause(self) -> None:
        """Stop the server at once (``pg_ctl stop -m immediate``: connections cut, no checkpoint); files kept."""
        self._run(str(self.bin_dir / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop")

    def resume(self) -> None:
        """Start a :meth:`pause`d server again on the same port (crash recovery replays its WAL)."""
        self._start()

    def sql(self, statement: str) -> None:
        """Run one statement as the superuser in the ``postgres`` database (psql)."""
        self._run(str(self.bin_dir / "psql"), "-h", "127.0.0.1", "-p", str(self.port), "-U", self.user, "-q",
                  "-d", "postgres", "-v", "ON_ERROR_STOP=1", "-c", statement)  # fmt: skip

    def recycle_wal(self, segments: int = 6) -> int:
        """Give the server WAL segments ahead, recycled, as a server in service has; how many there are then.

        A fresh server has none: the first commit past each 16 MiB segment waits while the next one is created and
        zero-filled (145-192 ms on this disk, docs/PERFORMANCE.md §C29p), which a server in service does not pay (its
        checkpoints rename segments it no longer needs into the ones ahead). So ``segments`` switches, each after a
        little WAL (a switch with none since the last one stays put), then a checkpoint, which recycles the segments
        behind it up to ``min_wal_size`` ahead (4 of 16 MiB at the default 80 MB: ~40,000 plans of a bench's WAL).
        """
        for _ in range(segments):
            self.sql("CREATE TABLE fw_wal_warm (); DROP TABLE fw_wal_warm")
            self.sql("SELECT pg_switch_wal()")
        self.sql("CHECKPOINT")
        return int(self.sql_value(
            "SELECT count(*) FROM pg_ls_waldir() WHERE name ~ '^[0-9A-F]{24}$' "
            "AND name > pg_walfile_name(pg_current_wal_lsn())"
        ))

    def sql_value(self, query: str) -> str:
        """The first column of the first row of ``query``, as text."""
        result = subprocess.run([*self._as, str(self.bin_dir / "psql"), "-h", "127.0.0.1", "-p", str(self.port),
                                 "-U", self.user, "-d", "postgres", "-Atc", query],
                                capture_output=True, text=True, timeout=60, check=True)  # fmt: skip
        return result.stdout.strip()

    def stop(self) -> None:
        """Stop the server at once and delete its files.

        ``-m immediate``: no shutdown checkpoint. A fast shutdown's checkpoint wrote and fsynced every
        file of every test database (the session's server: 8,885 files, 27 s on a loaded machine, and
        the rmtree after it 34 s more) only for them to be deleted.
        """
        with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
            self._run(str(self.bin_dir / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop")
        shutil.rmtree(self.root, ignore_errors=True)

    def dsn(self, database: str = "postgres") -> str:
        return f"postgresql://{self.user}@127.0.0.1:{self.port}/{database}"

    def new_database(self) -> str:
        """A fresh empty database; its DSN."""
        self._databases += 1
        name = f"fw_test_{self._databases}"
        self._run(str(self.bin_dir / "psql"), "-h", "127.0.0.1", "-p", str(self.port), "-U", self.user, "-q",
                  "-d", "postgres", "-c", f"CREATE DATABASE {name}")  # fmt: skip
        return self.dsn(name)

    def log_tail(self, lines: int = 40) -> str:
        with contextlib.suppress(OSError):
            return "\n".join((self.root / "log").read_text(errors="replace").splitlines()[-lines:])
        return ""


@contextlib.contextmanager
def postgres_server(*, parent: str | None = None, settings: dict[str, str] | None = None) -> Iterator[PostgresServer]:
    """A started server, stopped and deleted afterwards; its files in a new directory under ``parent``;
    ``settings``: more ``-c name=value`` server settings (after ``fsync=on``, ``synchronous_commit=on``)."""
    bin_dir = find_bin_dir()
    assert bin_dir is not None
    server = PostgresServer(bin_dir, parent=parent, settings=settings)
    try:
        server.start()
        yield server
    finally:
        server.stop()


def standby_dsn(primary: PostgresServer, standby: PostgresServer, database: str) -> str:
    """A multi-host DSN that reaches whichever of the two accepts writes (asyncpg, as libpq)."""
    return (
        f"postgresql://{primary.user}@127.0.0.1:{primary.port},127.0.0.1:{standby.port}/{database}"
        "?target_session_attrs=read-write"
    )
