"""The probe's end of the in-job socket: who may send, and how much is read.

:class:`DatagramListener` binds a Unix ``SOCK_DGRAM`` socket and guards it three ways:

* **file mode 0660**, owned by the probe's user and by ``group`` (``probe.socket_group``: a group
  name or number the training processes hold, e.g. a pod's ``supplementalGroups``). The kernel
  refuses ``sendto`` from anyone else (``EACCES``) before a datagram is queued, so another user's
  flood takes no room in the socket's queue;
* **the sender's credentials, per datagram**: ``SO_PEERCRED`` names only the binder on an
  unconnected datagram socket, so the listener sets ``SO_PASSCRED`` and the kernel attaches each
  sender's real pid, uid and gid (``SCM_CREDENTIALS``; only a process with ``CAP_SETUID`` /
  ``CAP_SETGID`` can claim other ids). A datagram is accepted when its uid is in :attr:`PeerPolicy.uids`
  or its gid in :attr:`PeerPolicy.gids`; with both empty (the default) the rule is the file mode's:
  root, the probe's own uid, or a member of the socket's group (its primary gid, or a supplementary
  group read from ``/proc/PID/status`` once per sender, which needs the sender's pid visible to the
  probe; a sender in another pid namespace needs the group as its primary gid or a configured id).
  Refused datagrams are counted, never parsed;
* **a size bound before buffering**: each datagram is read into a buffer of ``max_bytes`` + 1; a
  longer one arrives truncated (``MSG_TRUNC``), is counted as oversize and dropped, and one read
  takes at most ``max_batch_bytes`` in all.

Nothing here parses a datagram: the rate limits per job and the cap of ranks per step are the
aggregator's (:class:`fleethealth.probe.aggregator.StepAggregator`).
"""

from __future__ import annotations

import contextlib
import grp
import os
import socket
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

from fleethealth.errors import ConfigError
from fleethealth.wire import DEFAULT_SOCKET

__all__ = ["DatagramListener", "PeerPolicy", "ListenerStats", "DEFAULT_MAX_BYTES", "resolve_group", "parse_ids"]

DEFAULT_MAX_BYTES = 65_536
"""The largest datagram read (``probe.socket_max_bytes``): a step datagram is ~150 bytes, an event
with a stack dump a few KiB; a longer one is dropped and counted."""

_CREDS = struct.Struct("iII")  # struct ucred: pid, uid, gid
_CMSG_SPACE = socket.CMSG_SPACE(_CREDS.size)


def parse_ids(text: str | None, what: str, *, groups: bool = False) -> frozenset[int]:
    """``"0,1000"`` (or names, for groups) as ids; empty for ``None`` or ``""``."""
    out: set[int] = set()
    for part in (text or "").replace(" ", ",").split(","):
        if not part:
            continue
        if part.isdigit():
            out.add(int(part))
        elif groups:
            out.add(resolve_group(part))
        else:
            try:
                import pwd

                out.add(pwd.getpwnam(part).pw_uid)
            except KeyError:
                raise ConfigError(f"probe: {what}: no user {part!r}") from None
    return frozenset(out)


def resolve_group(group: str | int | None) -> int | None:
    """A group name or number as a gid (``None`` or ``""``: none)."""
    if group is None or group == "":
        return None
    if isinstance(group, int) or str(group).isdigit():
        return int(group)
    try:
        return grp.getgrnam(str(group)).gr_gid
    except KeyError:
        raise ConfigError(f"probe: socket group {group!r} does not exist") from None


def supplementary_groups(pid: int, uid: int) -> frozenset[int]:
    """The groups of process ``pid`` (``/proc/PID/status``), if it still runs as ``uid``; else none."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return frozenset()
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    try:
        real_uid = int(fields["Uid"].split()[0])
        groups = frozenset(int(g) for g in fields.get("Groups", "").split())
    except (KeyError, ValueError, IndexError):
        return frozenset()
    return groups if real_uid == uid else frozenset()


@dataclass(frozen=True)
class PeerPolicy:
    """Who may send: ``uids`` and ``gids`` (either matching admits); both empty: root, ``own_uid``
    or a member of ``group``, primary or supplementary (the rule the socket's file mode 0660 states)."""

    uids: frozenset[int] = frozenset()
    gids: frozenset[int] = frozenset()
    own_uid: int = -1
    group: int | None = None

    def allows(self, uid: int, gid: int, pid: int = 0) -> bool:
        """Whether a sender with these credentials is admitted; a sender whose primary gid is not
        the socket's group is looked up by ``pid`` for its supplementary groups (a pid the probe's
        namespace cannot see arrives as 0 and is not)."""
        if self.uids or self.gids:
            return uid in self.uids or gid in self.gids
        if uid == 0 or uid == self.own_uid or self.group is None:
            return uid == 0 or uid == self.own_uid
        return gid == self.group or (pid > 0 and self.group in supplementary_groups(pid, uid))


@dataclass(frozen=True, slots=True)
class ListenerStats:
    """Datagrams accepted, refused for their sender's credentials (or for carrying none), and
    dropped as longer than ``max_bytes``."""

    accepted_total: int
    refused_total: int
    oversize_total: int
    last_refused: tuple[int, int, int] | None
    """(pid, uid, gid) of the last refused sender."""


class DatagramListener:
    """A bound, non-blocking Unix datagram socket (mode 0660, ``group``); use as a context manager;
    closing unlinks it. :meth:`receive` returns only datagrams from senders ``policy`` admits."""

    def __init__(self, path: str = DEFAULT_SOCKET, *, rcvbuf: int = 4 << 20, group: str | int | None = None,
                 policy: PeerPolicy | None = None, max_bytes: int = DEFAULT_MAX_BYTES,
                 max_batch_bytes: int = 8 << 20) -> None:
        if max_bytes < 1024 or max_batch_bytes < max_bytes:
            raise ConfigError(f"probe: socket max_bytes must be >= 1024 and <= the batch bound, got {max_bytes}")
        self.path = path
        self.max_bytes = max_bytes
        self.max_batch_bytes = max_batch_bytes
        gid = resolve_group(group)
        base = policy or PeerPolicy()
        self.policy = PeerPolicy(base.uids, base.gids, own_uid=os.geteuid(),
                                 group=gid if gid is not None else (base.group if base.group is not None
                                                                    else os.getegid()))
        folder = Path(path).parent
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"cannot create the socket directory {folder}: {exc.strerror}") from exc
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISSOCK(os.lstat(path).st_mode):
                os.unlink(path)  # a stale socket from a previous probe
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
            old = os.umask(0o177)  # never world-writable, not even between bind and chmod
            try:
                self._sock.bind(path)
            finally:
                os.umask(old)
            if gid is not None:
                os.chown(path, -1, gid)
            os.chmod(path, 0o660)
        except OSError as exc:
            self._sock.close()
            raise ConfigError(f"cannot bind the probe socket {path} (group {group}): {exc.strerror}") from exc
        with contextlib.suppress(OSError):
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self._sock.setblocking(False)
        self._accepted = self._refused = self._oversize = 0
        self._last_refused: tuple[int, int, int] | None = None
        self._verdicts: dict[tuple[int, int, int], bool] = {}

    def fileno(self) -> int:
        return self._sock.fileno()

    @property
    def stats(self) -> ListenerStats:
        return ListenerStats(self._accepted, self._refused, self._oversize, self._last_refused)

    def receive(self, max_datagrams: int = 100_000) -> list[bytes]:
        """The admitted datagrams queued now (up to ``max_datagrams`` read, ``max_batch_bytes`` in
        all), without waiting; refused and oversize ones are counted and dropped."""
        out: list[bytes] = []
        recvmsg = self._sock.recvmsg
        size = self.max_bytes + 1
        budget = self.max_batch_bytes
        try:
            for _ in range(max_datagrams):
                data, ancdata, flags, _addr = recvmsg(size, _CMSG_SPACE)
                creds = None
                for level, kind, payload in ancdata:
                    if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS and len(payload) >= _CREDS.size:
                        creds = _CREDS.unpack_from(payload)
                if creds is None or not self._admits(creds):
                    self._refused += 1
                    self._last_refused = creds
                    continue
                if len(data) > self.max_bytes or flags & socket.MSG_TRUNC:
                    self._oversize += 1
                    continue
                self._accepted += 1
                out.append(data)
                budget -= len(data)
                if budget <= 0:
                    break
        except (BlockingIOError, InterruptedError):
            pass
        return out

    def _admits(self, creds: tuple[int, int, int]) -> bool:
        """``policy.allows``, remembered per (pid, uid, gid) (at most 4,096: a process's groups are
        read from /proc once, not per datagram)."""
        known = self._verdicts.get(creds)
        if known is None:
            if len(self._verdicts) >= 4096:
                self._verdicts.clear()
            known = self._verdicts[creds] = self.policy.allows(creds[1], creds[2], creds[0])
        return known

    def close(self) -> None:
        self._sock.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def __enter__(self) -> DatagramListener:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
