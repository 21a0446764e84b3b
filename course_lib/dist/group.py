"""Process groups: this process's rank, the world, sub-groups, and setting them up and down.

The rendezvous seam (used by `course_lib.spawn` and `course_lib.cluster`):
`listen()` opens this rank's socket and returns its address; once every rank's address and a
shared secret are known, `init_process_group("scratch", rank=, world_size=, addresses=,
secret=, timeout=)` connects the mesh. `destroy_process_group()` closes it.

A group itself (its members, its point-to-point calls, a collective call and its flight record)
is `course_lib.dist.process_group`'s; its names are importable from here too.
"""

from __future__ import annotations

import enum
import json
from datetime import timedelta
from typing import Sequence

from course_lib.dist import flight
from course_lib.dist.process_group import (FINGERPRINT_TAGS, MAX_TAG, QUERY_TIMEOUT, Collective,
                                           ProcessGroup)
from course_lib.dist.work import seconds
from course_lib.dist.transport import Listener, Transport
from course_lib.i18n import _

__all__ = ["DEFAULT_TIMEOUT", "MAX_TAG", "QUERY_TIMEOUT", "FINGERPRINT_TAGS", "ReduceOp",
           "ProcessGroup", "Collective", "flight_record", "set_debug_level", "get_debug_level",
           "listen", "init_process_group", "destroy_process_group", "is_initialized", "resolve",
           "resolve_any", "new_group", "get_rank", "get_world_size", "get_global_rank",
           "get_process_group_ranks", "get_address", "get_backend"]

DEFAULT_TIMEOUT = 300.0


class ReduceOp(enum.Enum):
    """How all_reduce, reduce and reduce_scatter combine values (torch.distributed's names)."""
    SUM = "sum"
    AVG = "avg"
    PRODUCT = "product"
    MIN = "min"
    MAX = "max"

    __hash__ = object.__hash__  # members are singletons; Enum's hash by name is a Python call


# --- this process's state ----------------------------------------------------------------

_listener: Listener | None = None
_world: ProcessGroup | None = None
_groups: list[ProcessGroup] = []
_detail = flight.detail_from_env()


def flight_record() -> dict:
    """This rank's flight record: every group's last collectives, as plain data."""
    transport = _world.transport if _world is not None else None
    return {"rank": None if transport is None else transport.rank,
            "groups": {str(g.id): {"ranks": g.ranks, "description": g.description,
                                   "entries": g.recorder.snapshot()} for g in _groups},
            "links": {} if transport is None else {str(r): p.kind()
                                                   for r, p in sorted(transport.peers.items())},
            "rejected": [] if transport is None else list(transport.listener.rejected)}


def set_debug_level(level: str) -> None:
    """"DETAIL" checks every collective's fingerprint across its group (as torch's
    TORCH_DISTRIBUTED_DEBUG=DETAIL does); "OFF" or "INFO" does not. Call it on every rank."""
    global _detail
    if str(level).upper() not in ("OFF", "INFO", "DETAIL"):
        raise ValueError(_("debug level must be OFF, INFO or DETAIL, got {level!r}",
                           level=level))
    _detail = str(level).upper() == "DETAIL"
    for g in _groups:
        g.detail = _detail


def get_debug_level() -> str:
    return "DETAIL" if _detail else "OFF"


def listen(host: str = "127.0.0.1", port: int = 0) -> tuple[str, int]:
    """Open this rank's listening socket (loopback unless told otherwise); returns its address."""
    global _listener
    if _world is not None:
        raise RuntimeError(_("listen() must come before init_process_group()"))
    if _listener is not None:
        _listener.close()
    _listener = Listener(host, port)
    return _listener.address


def init_process_group(backend: str = "scratch", *, rank: int, world_size: int,
                       addresses: Sequence[tuple[str, int]] | None = None,
                       secret: bytes | None = None,
                       timeout: float | timedelta = DEFAULT_TIMEOUT) -> None:
    """Connect to every other rank (each link authenticated with `secret`); sets the world."""
    global _listener, _world, _detail
    if backend != "scratch":
        raise ValueError(_("course_lib.dist only has the 'scratch' backend, got {backend!r}",
                           backend=backend))
    if _world is not None:
        raise RuntimeError(_("the process group is already initialized; destroy it first"))
    if not (isinstance(world_size, int) and world_size >= 1 and 0 <= rank < world_size):
        raise ValueError(_("need 0 <= rank < world_size, got rank={rank!r}, "
                           "world_size={world_size!r}", rank=rank, world_size=world_size))
    if world_size > 1:
        if _listener is None:
            raise RuntimeError(_("call dist.listen() first and pass every rank's address"))
        if addresses is None or len(addresses) != world_size:
            raise ValueError(_("addresses must list one (host, port) per rank ({world_size})",
                               world_size=world_size))
        if tuple(addresses[rank])[1] != _listener.address[1]:
            raise ValueError(_("addresses[{rank}]={address} is not this rank's listener "
                               "{listener}", rank=rank, address=addresses[rank],
                               listener=_listener.address))
        if not isinstance(secret, bytes) or len(secret) < 16:
            raise ValueError(_("secret must be at least 16 random bytes shared by the "
                               "cluster"))
    listener, _listener = _listener or Listener(), None
    transport = Transport(rank, world_size, list(addresses or [listener.address]),
                          secret or b"", seconds(timeout), listener)
    _world = ProcessGroup(transport, range(world_size), 0, seconds(timeout))
    _detail = _detail or flight.detail_from_env()  # torch reads its switch at init too
    _world.detail = _detail
    _groups[:] = [_world]
    transport.on_query = lambda: json.dumps(flight_record()).encode()


def destroy_process_group(group: ProcessGroup | None = None) -> None:
    """Close every connection and background thread (the whole world, as torch does)."""
    global _world
    if _world is None:
        return
    world, _world = _world, None
    for g in _groups:
        g.close()
    _groups.clear()
    world.transport.close()


def is_initialized() -> bool:
    return _world is not None


def resolve(group: ProcessGroup | None, name: str) -> ProcessGroup:
    """The group to use: the world by default; checks this rank belongs to it."""
    group = resolve_any(group, name)
    if group.rank < 0:
        group.check_member(name)  # raises
    return group


def resolve_any(group: ProcessGroup | None, name: str) -> ProcessGroup:
    """The group to use (the world by default), whether or not this rank is a member."""
    if _world is None:
        raise RuntimeError(_("{name}: the process group is not initialized (call "
                             "init_process_group, or use course_lib.spawn/cluster)", name=name))
    return _world if group is None else group


def new_group(ranks: Sequence[int] | None = None,
              timeout: float | timedelta | None = None) -> ProcessGroup:
    """A sub-group of global ranks; every rank of the world must call it, in the same order."""
    world = resolve(None, "new_group")
    ranks = list(range(world.size)) if ranks is None else sorted(int(r) for r in ranks)
    if not ranks or len(set(ranks)) != len(ranks) or not all(0 <= r < world.size for r in ranks):
        raise ValueError(_("new_group: ranks must be distinct ranks of the world, got {ranks}",
                           ranks=ranks))
    group = ProcessGroup(world.transport, ranks, len(_groups),
                         world.timeout if timeout is None else seconds(timeout))
    group.detail = _detail
    _groups.append(group)
    return group


def get_rank(group: ProcessGroup | None = None) -> int:
    """This process's rank in `group` (the world by default); -1 if it is not a member."""
    if _world is None:
        raise RuntimeError(_("{name}: the process group is not initialized (call "
                             "init_process_group, or use course_lib.spawn/cluster)",
                             name="get_rank"))
    return (group or _world).rank


def get_world_size(group: ProcessGroup | None = None) -> int:
    if _world is None:
        raise RuntimeError(_("{name}: the process group is not initialized (call "
                             "init_process_group, or use course_lib.spawn/cluster)",
                             name="get_world_size"))
    return (group or _world).size


def get_global_rank(group: ProcessGroup | None, group_rank: int) -> int:
    """The global rank of `group`'s member number `group_rank` (torch.distributed's name)."""
    group = resolve_any(group, "get_global_rank")
    if not isinstance(group_rank, int) or not 0 <= group_rank < group.size:
        raise ValueError(_("get_global_rank: group_rank {group_rank!r} is not in [0, {size}) "
                           "for {group!r}", group_rank=group_rank, size=group.size,
                           group=group))
    return group.ranks[group_rank]


def get_process_group_ranks(group: ProcessGroup | None) -> list[int]:
    """The global ranks of `group`'s members, in group-rank order (torch.distributed's name)."""
    return list(resolve_any(group, "get_process_group_ranks").ranks)


def get_address() -> tuple[str, int]:
    """Where this rank listens for its peers (host, port): what a stranger could connect to."""
    return resolve(None, "get_address").transport.listener.address


def get_backend(group: ProcessGroup | None = None) -> str:
    return "scratch"
