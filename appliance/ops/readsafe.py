"""Reading a file from a folder a service owns, for a support bundle run as root.

`sudo appliance support-bundle` reads logs and state from folders the `appliance` user can
write (`/var/log/appliance`, `state_dir/engine`). A compromised daemon could plant a link
there (`x.log -> /root/.ssh/id_ed25519`), or a FIFO that hangs the read. So:

- the configured folder (`root`) is trusted as named; every component below it is opened with
  `O_NOFOLLOW` (a link anywhere below the root is refused, never followed), the file itself
  with `O_NOFOLLOW | O_NONBLOCK`, and it must be a regular file (`fstat`);
- run as root over a folder owned by another user, the read happens in a forked child
  running as that folder's owner (`read_as_owner`): root reads only what the service itself
  could read, so a hard link to a file the service may not read gains nothing either.

A refusal raises `Refused`, whose message says what was refused and why (it goes in the
bundle's README). Pure of config: callers name the root and the path below it.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import stat
import time
from pathlib import Path, PurePosixPath

CHILD_TIMEOUT_S = 30.0


class Refused(Exception):
    """The file was not read; the message says why (a link, not a regular file, absent)."""


def _link_note(path: Path) -> str:
    try:
        return f" (to {os.readlink(path)})"
    except OSError:
        return ""


def open_below(root: Path, relative: str) -> int:
    """A read-only descriptor of `root/relative`, following no link below `root`."""
    parts = PurePosixPath(relative).parts
    if not parts or PurePosixPath(relative).is_absolute() or ".." in parts:
        raise Refused(f"{relative!r} is not a plain path below {root}")
    where = root
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as exc:
        raise Refused(f"{root} cannot be opened: {exc.strerror or exc}") from None
    try:
        for name in parts[:-1]:
            where = where / name
            try:
                next_fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            except OSError as exc:
                raise _refusal(where, exc) from None
            os.close(fd)
            fd = next_fd
        where = where / parts[-1]
        try:
            file_fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=fd)
        except OSError as exc:
            raise _refusal(where, exc) from None
    finally:
        os.close(fd)
    if not stat.S_ISREG(os.fstat(file_fd).st_mode):
        os.close(file_fd)
        raise Refused(f"{where} is not a regular file (a bundle reads only plain files)")
    return file_fd


def _refusal(where: Path, exc: OSError) -> Refused:
    import errno

    if exc.errno in (errno.ELOOP, errno.ENOTDIR) and where.is_symlink():
        return Refused(f"{where} is a symbolic link{_link_note(where)}; a bundle never "
                       "follows links in the appliance's folders (who put it there?)")
    if exc.errno == errno.ENOENT:
        return Refused(f"{where} does not exist")
    return Refused(f"{where} cannot be read: {exc.strerror or exc}")


def read_tail(root: Path, relative: str, cap: int) -> bytes:
    """At most the last `cap` bytes of `root/relative`, in this process (see `open_below`)."""
    fd = open_below(root, relative)
    with os.fdopen(fd, "rb") as handle:
        size = handle.seek(0, os.SEEK_END)
        handle.seek(max(0, size - cap))
        return handle.read(cap)


def read_as_owner(root: Path, relative: str, cap: int) -> bytes:
    """`read_tail`, as the owner of `root` when this process is root and `root` is another
    user's: a forked child drops to that user (its group, no others) before it opens
    anything, and hands the bytes back through a pipe. Otherwise (not root, or a root-owned
    folder) it reads here. A fork rather than a new interpreter: the service user may not
    be able to run this process's Python (a venv under /root), and the child only makes
    system calls."""
    try:
        owner = os.stat(root)
    except OSError as exc:
        raise Refused(f"{root} cannot be read: {exc.strerror or exc}") from None
    if os.geteuid() != 0 or owner.st_uid == 0:
        return read_tail(root, relative, cap)
    readable, writable = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        _child(writable, owner.st_uid, owner.st_gid, root, relative, cap)
    os.close(writable)
    try:
        data = _drain(readable, cap, f"{root / relative}")
    finally:
        os.close(readable)
        with contextlib.suppress(ProcessLookupError):  # done, or stuck: it goes either way
            os.kill(pid, signal.SIGKILL)  # (an exited child is a zombie until reaped below)
        os.waitpid(pid, 0)
    if data[:1] == b"R":
        raise Refused(data[1:].decode(errors="replace"))
    if data[:1] != b"D":
        raise Refused(f"{root / relative}: reading it as uid {owner.st_uid} failed")
    return data[1:]


def _child(out: int, uid: int, gid: int, root: Path, relative: str, cap: int) -> None:
    code = 0
    try:
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)
        try:
            payload = b"D" + read_tail(root, relative, cap)
        except Refused as exc:
            payload = b"R" + str(exc).encode()
        view = memoryview(payload)
        while view:
            view = view[os.write(out, view):]
    except BaseException:
        code = 1
    os._exit(code)


def _drain(fd: int, cap: int, what: str) -> bytes:
    """Everything the child writes (at most `cap` and a message), within CHILD_TIMEOUT_S."""
    chunks: list[bytes] = []
    size = 0
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    while size <= cap + 65536:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise Refused(f"{what}: reading it gave no answer within {CHILD_TIMEOUT_S:.0f} s")
        chunk = os.read(fd, 1 << 20)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)
