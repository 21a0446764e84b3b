"""`course_lib.dist`: a process group built from scratch on TCP sockets, shaped like torch.distributed.

    from course_lib import dist
    dist.all_reduce(t, op=dist.ReduceOp.SUM, algorithm="ring")

Layers, each its own file, bottom up: `stream` (tensors as bytes, deadlines, writes) -> `wire`
(the frame header and the exact read, lesson 01) and `handshake` (each connection proves the
secret) -> `ring` (the byte stream a link's frames take: its socket, or a ring in shared memory) -> `shm` (large payloads to a
rank on this machine) -> `work` (an operation in flight), `matching` (which receive a message
fills), `sender` and `receiver` (the two halves of a link; `frame_reader` reads the
receiver's frames) -> `peer` (one link; how `send` travels) -> `transport` (the mesh of
links) -> `process_group` (a group: its members, its point-to-point calls, a collective
call) -> `group` (ranks, sub-groups, set-up) -> `p2p` and `collectives` (the API, the
algorithms lessons 02a-02b teach; the rooted ones in `rooted`, what they are all written
with in `collective_parts`), `tuned` (the all_reduce algorithms lesson 10 adds, and the
choice "auto" makes), `symmetric` (buffers every rank maps,
read in place by all_reduce, and each group's staging buffer for small all_reduces),
`alltoall` (all_to_all and all_to_all_single, lesson 13: expert parallelism's collective); beside
them `flight`, each group's record of its collectives, and `diagnosis` (lesson 09b: each
rank's verdict when one fails). In
every file `op` is a `ReduceOp`, `name` an operation's name, `peer` a `Peer` and `peer_rank`
the rank at its other end.
"""

from course_lib.dist.alltoall import all_to_all, all_to_all_single
from course_lib.dist.collectives import (all_gather, all_reduce, barrier, broadcast, gather,
                                         reduce, reduce_scatter, scatter, set_all_reduce_table)
from course_lib.dist.errors import DistError, DistTimeoutError
from course_lib.dist.group import (ProcessGroup, ReduceOp, destroy_process_group,
                                   flight_record, get_address, get_backend, get_debug_level,
                                   get_global_rank, get_process_group_ranks, get_rank,
                                   get_world_size, init_process_group, is_initialized, listen,
                                   new_group, set_debug_level)
from course_lib.dist.p2p import irecv, isend, recv, send
from course_lib.dist.shared import shared_zeros
from course_lib.dist.work import Work

__all__ = [
    "DistError", "DistTimeoutError", "ProcessGroup", "ReduceOp", "Work",
    "all_gather", "all_reduce", "all_to_all", "all_to_all_single", "barrier", "broadcast",
    "destroy_process_group",
    "flight_record", "gather", "get_address", "get_backend", "get_debug_level",
    "get_global_rank", "get_process_group_ranks", "get_rank", "get_world_size",
    "init_process_group", "irecv", "is_initialized", "isend", "listen",
    "new_group", "recv", "reduce", "reduce_scatter", "scatter", "send", "set_all_reduce_table",
    "set_debug_level", "shared_zeros",
]
