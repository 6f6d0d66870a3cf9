"""The files behind :mod:`vescale_zero.optim.state_files`: one per parameter group and rank.

[Note: state file format] ``<directory>/rank<r>-of-<w>.group<g>.state`` holds a 64-byte
header then the group's state bytes (the payload), as laid out by the caller::

    header: b"VZSTATE1" | rank | world | group | payload bytes | layout digest | zeros
            8 bytes       int64 x 5 (little-endian)                              16 bytes

Reads and writes are plain ``os.preadv`` / ``os.pwritev`` into and out of the caller's host
buffer (no memory map: the pages read land in that buffer only, so the process's RSS counts
them once, and the page cache, which the kernel may drop at any time, is not in the RSS). A
file's size and header are checked before every read: a truncated, overwritten or foreign
file is an error naming it, never state read as garbage.

[Note: one owner per directory] Each rank holds an exclusive ``flock`` on
``<directory>/rank<r>-of-<w>.lock`` while its files are in use, so a second optimizer (of
another model, or a second install) pointed at the same directory is refused at once instead
of the two overwriting each other's state. The kernel drops the lock when the process ends.

DeepSpeed's async I/O op (``AsyncIOBuilder``) needs libaio, which this machine lacks
(``is_compatible()`` is False with DeepSpeed 0.19.8), so it is not used.
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
from typing import Dict

import torch

__all__ = ["StateFileDir", "StateFileError", "HEADER_BYTES"]

HEADER_BYTES = 64
_MAGIC = b"VZSTATE1"
_HEADER = struct.Struct("<8s5q")


class StateFileError(RuntimeError):
    """A state file is missing, truncated or not the one expected ([Note: state file format])."""


def _as_buffer(host: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous 1-D uint8 CPU tensor (what ``preadv`` fills)."""
    return memoryview(host.numpy()).cast("B")


class StateFileDir:
    """The state files of one rank in ``directory`` (checked, locked; see the module notes)."""

    def __init__(self, directory: str, rank: int, world: int) -> None:
        directory = os.fspath(directory)
        if not os.path.exists(directory):
            raise FileNotFoundError(f"optimizer state directory {directory!r} does not exist; create it (e.g. "
                                    "os.makedirs) on every node, or pass an existing directory")
        if not os.path.isdir(directory):
            raise NotADirectoryError(f"optimizer state directory {directory!r} is not a directory; pass a directory")
        if not os.access(directory, os.W_OK | os.X_OK):
            raise PermissionError(f"optimizer state directory {directory!r} is not writable by this process; give "
                                  "it write permission or pass a writable directory")
        self.directory, self.rank, self.world = directory, rank, world
        self._fds: Dict[int, int] = {}
        lock_path = os.path.join(directory, f"rank{rank:05d}-of-{world:05d}.lock")
        self._lock = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(self._lock)
            self._lock = -1
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise RuntimeError(
                    f"optimizer state directory {directory!r} is in use by another optimizer's state files (rank "
                    f"{rank}'s lock {lock_path!r} is held): give each model's optimizer its own directory, or close "
                    "the other one first (StateFiles.close())") from None
            raise

    def path(self, group: int) -> str:
        return os.path.join(self.directory, f"rank{self.rank:05d}-of-{self.world:05d}.group{group:05d}.state")

    def _fd(self, group: int) -> int:
        fd = self._fds.get(group)
        if fd is None:
            fd = self._fds[group] = os.open(self.path(group), os.O_RDWR | os.O_CREAT, 0o644)
        return fd

    def _header(self, group: int, nbytes: int, digest: int) -> bytes:
        return _HEADER.pack(_MAGIC, self.rank, self.world, group, nbytes, digest).ljust(HEADER_BYTES, b"\0")

    def write(self, group: int, host: torch.Tensor, nbytes: int, digest: int) -> None:
        """Write ``host[:nbytes]`` as ``group``'s payload (the file is cut to exactly its size)."""
        fd = self._fd(group)
        size = HEADER_BYTES + nbytes
        if os.fstat(fd).st_size != size:
            os.ftruncate(fd, size)
        views = [memoryview(self._header(group, nbytes, digest)), _as_buffer(host[:nbytes])]
        offset = 0
        while views:  # pwritev may write less than asked (a signal, a full disk): go on from there
            done = os.pwritev(fd, views, offset)
            if done == 0:
                raise OSError(errno.ENOSPC, f"no space left writing optimizer state file {self.path(group)!r}")
            offset += done
            while views and done >= views[0].nbytes:
                done -= views[0].nbytes
                views.pop(0)
            if views and done:
                views[0] = views[0][done:]

    def check(self, group: int, nbytes: int, digest: int) -> int:
        """The file descriptor of ``group``'s file, after checking its size and header."""
        path = self.path(group)
        fd = self._fds.get(group)
        if fd is None and not os.path.exists(path):
            raise StateFileError(f"optimizer state file {path!r} is missing (deleted while in use?); the optimizer "
                                 f"state of parameter group {group} is lost: resume from a checkpoint")
        fd = self._fd(group)
        size = os.fstat(fd).st_size
        if size != HEADER_BYTES + nbytes:
            raise StateFileError(
                f"optimizer state file {path!r} is {size} bytes, expected {HEADER_BYTES + nbytes} (header + this "
                f"rank's state of parameter group {group}): it was truncated or overwritten; resume from a checkpoint")
        head = os.pread(fd, _HEADER.size, 0)
        expected = _HEADER.pack(_MAGIC, self.rank, self.world, group, nbytes, digest)
        if head != expected:
            raise StateFileError(
                f"optimizer state file {path!r} has a header that does not match this rank's state of parameter "
                f"group {group} (rank {self.rank} of {self.world}, {nbytes} bytes): it is corrupt or another run's; "
                "resume from a checkpoint")
        return fd

    def read(self, group: int, host: torch.Tensor, nbytes: int, digest: int, offset: int = 0) -> None:
        """Fill ``host[:len(host)]`` from ``group``'s payload at byte ``offset`` (checked first)."""
        fd = self.check(group, nbytes, digest)
        view, pos = _as_buffer(host), HEADER_BYTES + offset
        while view.nbytes:
            got = os.preadv(fd, [view], pos)
            if got == 0:
                raise StateFileError(f"optimizer state file {self.path(group)!r} ended early (truncated while read)")
            view, pos = view[got:], pos + got

    def remove(self, group: int) -> None:
        fd = self._fds.pop(group, None)
        if fd is not None:
            os.close(fd)
        if os.path.exists(self.path(group)):
            os.remove(self.path(group))

    def close(self, remove: bool) -> None:
        """Close every file (``remove``: delete them) and release the directory's lock."""
        for group in list(self._fds):
            if remove:
                self.remove(group)
            else:
                os.close(self._fds.pop(group))
        if self._lock >= 0:
            os.close(self._lock)  # releases the flock
            self._lock = -1
