"""Names of temporary files and folders that say which process made them, so that a later process
can remove what a killed one left (a SIGKILL runs no clean-up) without touching a live one's.

A name carries its maker's PID and PID namespace: ``<prefix><pid>-<namespace>-<random>``. A PID
names a process only inside its namespace, and containers that share a folder (``/dev/shm`` in the
host's IPC namespace, a bind-mounted ``/tmp``) each have their own: a name of another namespace is a
process this one cannot see, and is left alone, as is another user's. Used for the staging
areas in /dev/shm (`engine.staging`) and mpickpt-run's agent folders (`launch.rank_wrapper`).
Local: nothing here uses MPI.
"""
from __future__ import annotations

import os
import shutil


def pid_namespace() -> str:
    """This process's PID namespace, as the inode number of /proc/self/ns/pid ('0' where it
    cannot be read: then `stale` takes nothing for stale, as any container may be another).
    Local."""
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return "0"


def owned_name(prefix: str, suffix: str) -> str:
    """`prefix` + this process's PID and namespace + `suffix` (e.g. a random tag). Local."""
    return f"{prefix}{os.getpid()}-{pid_namespace()}-{suffix}"


def stale(name: str, prefix: str, uid_of, namespace: str, legacy: bool = False) -> bool:
    """Whether `name` (an `owned_name` of `prefix`) was made by a process of `namespace` that
    is gone, and belongs to this user (`uid_of(name)`: its owner, None where it is gone).
    `legacy`: also a name of `<prefix><pid>-<random>`, from before the namespace was in names,
    judged in this namespace. Local."""
    if not name.startswith(prefix) or namespace == "0":  # namespaces unknown: no one's is
        return False
    parts = name[len(prefix):].split("-")
    if legacy and len(parts) == 2:
        parts.insert(1, namespace)
    if len(parts) != 3 or not parts[0].isdigit() or parts[1] != namespace:
        return False
    return not running(int(parts[0])) and uid_of(name) == os.getuid()


def running(pid: int) -> bool:
    """Whether process `pid` of this namespace runs: it exists and is no zombie (a process that
    ended and that its parent, often init after its launcher left, has not reaped yet: its
    memory and files are released). Local."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def remove_stale(folder: str, prefix: str, legacy: bool = False) -> list[str]:
    """Delete what gone processes of this namespace and user left in `folder` under `prefix`
    (`stale`), files or folders; returns the names removed. Never raises: a clean-up is no
    reason to fail a start. Local."""
    try:
        names = [n for n in os.listdir(folder) if n.startswith(prefix)]
    except OSError:
        return []
    namespace, removed = pid_namespace(), []
    for name in names:
        path = os.path.join(folder, name)
        if not stale(name, prefix, lambda n: _owner(path), namespace, legacy):
            continue
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.unlink(path)
            removed.append(name)
        except OSError:
            pass
    return removed


def _owner(path: str) -> int | None:
    try:
        return os.lstat(path).st_uid
    except OSError:
        return None
