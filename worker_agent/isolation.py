"""What a plan's processes get of the worker: their environment, their devices, their user.

The ``shell`` op's commands and ``python`` plans run in a process of their own
(worker_agent/handlers.py, worker_agent/pyproc.py) are started through one :class:`PlanIsolation`,
which the runner hands every plan's ``Context``. Rules (docs/OPERATIONS.md §Security, "What a plan
sees"):

* **Environment, built, never inherited.** A plan's process gets the variables :data:`PLAN_ENV`
  names (and the operator's ``--plan-env`` names and patterns), taken from the worker's
  environment, then what the op sets (``FLEETWIRE_INPUT_*``, ``FLEETWIRE_OUTPUT_DIR``, a shell
  plan's own ``env``), then its devices. No ``FLEETWIRE_*`` variable of the worker passes, whatever
  ``--plan-env`` says: the worker token, and any other token the worker's shell held, stay with
  the worker. Whatever else the worker's environment holds (cloud keys, ``NOTIFY_SOCKET``,
  systemd's ``CREDENTIALS_DIRECTORY``) passes only when the operator names it.
* **Devices.** On a worker that has devices, a plan sees its own (``CUDA_VISIBLE_DEVICES`` and
  ``NVIDIA_VISIBLE_DEVICES`` are their ids) or, holding none, none (``CUDA_VISIBLE_DEVICES=""``,
  ``NVIDIA_VISIBLE_DEVICES=void``, ``ROCR_VISIBLE_DEVICES=""``; ``HIP_VISIBLE_DEVICES`` is not
  passed: ROCm's lower layer hides them). This is what CUDA and ROCm libraries look at; it is not
  a device cgroup: a command that sets the variables again, or opens ``/dev/nvidia*``, reaches
  every device the worker's user can open.
* **Plan user** (``--plan-user NAME``, the worker running as root): a plan's processes run as that
  user and its primary group, with no supplementary groups; its scratch directory is handed to
  that user, and so are its input files; the worker reads outputs back without following a
  symbolic link and only from files that user owns (worker_agent/spool_files.py ``open_confined``).
  ``HOME``, ``USER`` and ``LOGNAME`` are that user's.
* :func:`lock_worker_process`: the worker's own process is made non-dumpable (Linux
  ``PR_SET_DUMPABLE`` 0, as ssh-agent does), so a plan running as the same user cannot read its
  memory, its open files or its ``/proc/PID/environ`` (which keeps the environment the process
  started with, whatever ``os.environ`` says later).
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import os
import pwd
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

__all__ = [
    "NO_DEVICES",
    "PLAN_ENV",
    "PlanIsolation",
    "PlanUser",
    "device_environment",
    "lock_worker_process",
    "plan_environment",
]

#: The worker's variables a plan's process gets (exact names, and ``fnmatch`` patterns).
PLAN_ENV: Final = (
    "PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "LC_*", "TZ", "TMPDIR", "TERM",
    "LD_LIBRARY_PATH", "PYTHONPATH", "VIRTUAL_ENV", "CONDA_PREFIX", "CONDA_DEFAULT_ENV",
    "CUDA_HOME", "CUDA_PATH", "CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES",
    "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "HF_HOME", "TORCH_HOME", "XDG_CACHE_HOME",
    "SSL_CERT_FILE", "SSL_CERT_DIR",
)  # fmt: skip

#: Never passed from the worker's environment, whatever ``--plan-env`` says (its tokens live there).
WORKER_ONLY_PREFIX: Final = "FLEETWIRE_"

#: What a plan holding no device sees on a worker that has devices.
NO_DEVICES: Final = {"CUDA_VISIBLE_DEVICES": "", "NVIDIA_VISIBLE_DEVICES": "void", "ROCR_VISIBLE_DEVICES": ""}

_DEVICE_VARIABLES: Final = (
    "CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES",
)  # fmt: skip

_PR_SET_DUMPABLE: Final = 4

Spawn = tuple[list[str], dict[str, str], tuple[int, ...]]
"""What starts a plan's process: the command line, its environment, the fds it is passed."""

# Run by the worker's interpreter as root, with an empty environment (a plan's LD_PRELOAD must not load
# into a root process): read the plan's environment from the fd named, become the plan user for
# good, then be the plan's command.
_AS_USER: Final = """import json, os, sys
uid, gid, fd = (int(a) for a in sys.argv[1:4])
with os.fdopen(fd, "rb") as f:
    env = json.loads(f.read())
os.setgroups([]); os.setgid(gid); os.setuid(uid)
try:
    os.execvpe(sys.argv[4], sys.argv[4:], env)
except OSError as e:
    sys.stderr.write(f"cannot start {sys.argv[4]!r} as uid {uid}: {e.strerror or e}\\n")
    sys.exit(127)
"""


def _is_pattern(name: str) -> bool:
    return any(c in name for c in "*?[")


def plan_environment(passthrough: Iterable[str] = (), environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The worker's variables a plan's process starts with: :data:`PLAN_ENV` and ``passthrough``,
    never a ``FLEETWIRE_*`` one."""
    environ = os.environ if environ is None else environ
    names = (*PLAN_ENV, *passthrough)
    exact = {n for n in names if not _is_pattern(n)}
    patterns = [n for n in names if _is_pattern(n)]
    return {
        name: value
        for name, value in environ.items()
        if not name.startswith(WORKER_ONLY_PREFIX)
        and (name in exact or any(fnmatch.fnmatchcase(name, p) for p in patterns))
    }


def device_environment(env: dict[str, str], visible: str | None) -> dict[str, str]:
    """``env`` showing a plan its devices: ``visible`` is their CUDA ids (``""``: none; None: the
    worker has no devices, and whatever ``env`` holds stands)."""
    if visible is None:
        return env
    for name in _DEVICE_VARIABLES:
        env.pop(name, None)
    if visible:
        env["CUDA_VISIBLE_DEVICES"] = env["NVIDIA_VISIBLE_DEVICES"] = visible
    else:
        env.update(NO_DEVICES)
    return env


@dataclass(frozen=True, slots=True)
class PlanUser:
    """The Unix user plans run as (``--plan-user``)."""

    name: str
    uid: int
    gid: int
    home: str

    @classmethod
    def named(cls, name: str) -> PlanUser:
        """The user called ``name`` (or with that numeric uid).

        Raises:
            ValueError: no such user, or root (plans as root isolate nothing).
        """
        try:
            entry = pwd.getpwuid(int(name)) if name.isdigit() else pwd.getpwnam(name)
        except (KeyError, OverflowError):
            raise ValueError(f"--plan-user {name!r}: no such user on this host") from None
        if entry.pw_uid == 0:
            raise ValueError(f"--plan-user {name!r} is root: plans would run as root, isolated from nothing")
        return cls(name=entry.pw_name, uid=entry.pw_uid, gid=entry.pw_gid, home=entry.pw_dir)

    @contextlib.contextmanager
    def spawn(self, argv: Sequence[str], env: Mapping[str, str]) -> Iterator[Spawn]:
        """``(command, environment, fds to pass)`` starting ``argv`` with ``env`` as this user: a
        launcher (the worker's interpreter, isolated, with an empty environment) reads ``env`` from
        a memfd, drops to this user's uid and group with no supplementary groups, and executes
        ``argv``. (uvloop, the CLI's event loop, cannot start a process as another user itself.)"""
        fd = os.memfd_create("fleetwire-plan-env")
        try:
            os.write(fd, json.dumps(dict(env)).encode())
            os.lseek(fd, 0, os.SEEK_SET)
            command = [sys.executable, "-I", "-S", "-c", _AS_USER, str(self.uid), str(self.gid), str(fd), *argv]
            yield command, {}, (fd,)
        finally:
            os.close(fd)

    def give(self, path: str | os.PathLike[str]) -> None:
        """Make ``path`` (a directory or file of the plan's own, never a link) this user's."""
        os.chown(path, self.uid, self.gid, follow_symlinks=False)


@dataclass(frozen=True, slots=True)
class PlanIsolation:
    """How one worker starts its plans' processes (the runner gives every plan's ``Context`` it).

    Args:
        passthrough: more of the worker's variables a plan gets (``--plan-env``: names or patterns).
        plan_user: the user plans run as (``--plan-user``); None: the worker's own user.
    """

    passthrough: tuple[str, ...] = ()
    plan_user: PlanUser | None = None

    @classmethod
    def of(cls, passthrough: Sequence[str] = (), plan_user: str | None = None) -> PlanIsolation:
        """From the flags (``--plan-env``, ``--plan-user``).

        Raises:
            ValueError: a ``--plan-env`` entry that would pass a ``FLEETWIRE_*`` variable, an
                unknown or root plan user, or a plan user on a worker not running as root.
        """
        for name in passthrough:
            if not name or "=" in name:
                raise ValueError(f"--plan-env {name!r} is not a variable name or pattern")
            if name.startswith(WORKER_ONLY_PREFIX):
                raise ValueError(f"--plan-env {name!r}: FLEETWIRE_* variables never pass to plans (the worker's "
                                 "tokens are among them)")  # fmt: skip
        user = None
        if plan_user:
            user = PlanUser.named(plan_user)
            if os.geteuid() != 0:
                raise ValueError(f"--plan-user {plan_user!r} needs the worker to run as root (it starts each plan's "
                                 "processes as that user)")  # fmt: skip
        return cls(passthrough=tuple(passthrough), plan_user=user)

    def environment(self, visible_devices: str | None = None, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """A new environment for one plan's process: the worker's variables that pass, the plan user's
        own, ``extra`` (what the op sets), then the plan's devices (:func:`device_environment`)."""
        env = plan_environment(self.passthrough)
        if self.plan_user is not None:
            env.update(HOME=self.plan_user.home, USER=self.plan_user.name, LOGNAME=self.plan_user.name)
        if extra:
            env.update(extra)
        return device_environment(env, visible_devices)

    @contextlib.contextmanager
    def spawn(self, argv: Sequence[str], env: dict[str, str]) -> Iterator[Spawn]:
        """``(command, environment, fds to pass)`` for ``create_subprocess_exec`` starting ``argv``
        with ``env`` as a plan's process: as it is, or as the plan user (:meth:`PlanUser.spawn`)."""
        if self.plan_user is None:
            yield list(argv), env, ()
        else:
            with self.plan_user.spawn(argv, env) as spawned:
                yield spawned

    def hand_over(self, *paths: str | os.PathLike[str]) -> None:
        """Give the plan user ``paths`` (its scratch directory, its inputs); nothing without one."""
        if self.plan_user is not None:
            for path in paths:
                self.plan_user.give(path)

    def open_to_plan(self, directory: Path) -> None:
        """Let the plan user pass through ``directory`` (an attempt's, holding its scratch): mode 0711."""
        if self.plan_user is not None:
            directory.chmod(0o711)

    @property
    def owner(self) -> int | None:
        """The uid whose files a plan may leave as outputs (None: any, the worker's own user runs plans)."""
        return self.plan_user.uid if self.plan_user is not None else None


def lock_worker_process() -> bool:
    """Make this process non-dumpable: same-user processes (a plan) cannot read its memory or
    ``/proc/PID/environ``. Linux only; returns whether it was done. Children are not affected
    (``execve`` resets the flag)."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes  # here: only the CLI's worker calls it, once

    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) == 0)
    return False
