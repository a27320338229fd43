"""A real PostgreSQL server for the tests: initdb + pg_ctl in a temp dir, on a free 127.0.0.1 port.

No mock stands in for PostgreSQL. The server runs as the ``postgres`` user when the tests run as
root (``initdb`` refuses root; the temp dir is chowned to it), as the current user otherwise,
with ``fsync=on`` (commits are durable, as in production). Tests that need it take the
``pg_dsn`` fixture (tests/conftest.py): a fresh database per test on one server per session.
Without the binaries (Debian's ``postgresql`` package: ``/usr/lib/postgresql/*/bin``) or the
``asyncpg`` driver those tests skip and say why; ``.ci/run`` installs the package.
"""

from __future__ import annotations

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

__all__ = ["PostgresServer", "find_bin_dir", "missing_reason", "postgres_server"]


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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PostgresServer:
    """One PostgreSQL server in a temp dir; :meth:`dsn` names a database on it."""

    def __init__(self, bin_dir: Path) -> None:
        self.bin_dir = bin_dir
        self.root = Path(tempfile.mkdtemp(prefix="fleetwire-pg-"))
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
        """initdb (trust auth for the test user, no fsync while creating the files) and start, waiting for it."""
        self._run(str(self.bin_dir / "initdb"), "-D", str(self.data), "-U", self.user, "-A", "trust", "--no-sync",
                  "-E", "UTF8", "--locale", "C")  # fmt: skip
        options = f"-p {self.port} -h 127.0.0.1 -k {self.root} -c fsync=on -c synchronous_commit=on"
        self._run(str(self.bin_dir / "pg_ctl"), "-D", str(self.data), "-l", str(self.root / "log"), "-w",
                  "-t", "60", "-o", options, "start")  # fmt: skip

    def stop(self) -> None:
        """Stop the server (fast shutdown) and delete its files."""
        with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
            self._run(str(self.bin_dir / "pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "stop")
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
def postgres_server() -> Iterator[PostgresServer]:
    """A started server, stopped and deleted afterwards."""
    bin_dir = find_bin_dir()
    assert bin_dir is not None
    server = PostgresServer(bin_dir)
    try:
        server.start()
        yield server
    finally:
        server.stop()
