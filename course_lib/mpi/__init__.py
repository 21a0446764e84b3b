"""MPI as a `dist`: torch.distributed's calls on mpi4py's buffer interface, for processes that
mpiexec started.

    from course_lib import mpi
    mpi.init_process_group()        # under mpiexec (or a cluster started with engines="mpi")
    ddp = DistributedDataParallel(model, dist=mpi)

Tensors travel as buffers (uppercase mpi4py calls: no pickling), collectives in place with
`MPI_IN_PLACE`. Every call is non-blocking underneath (`Iallreduce`, `Isend`...) and waited
for with a deadline, so a peer that never arrives is an error naming the rank, the operation
and the peer, not a hang; MPI cannot cancel a collective, so after such an error the
communicator is unusable. 16-bit floats, which MPI has no standard type for, reduce through
a user-defined MPI operation.

The package, a module per concern: `group` (mpiexec, the world, groups), `work` (requests with
a deadline, tensors as buffers, the host-only rule: a tensor on any other device is refused
with an error naming the device and the operation), `collectives`, `p2p`, `alltoall`.
"""

from __future__ import annotations

from course_lib.dist.errors import DistTimeoutError
from course_lib.dist.group import ReduceOp
from course_lib.mpi.alltoall import all_to_all, all_to_all_single
from course_lib.mpi.collectives import (all_gather, all_reduce, barrier, broadcast, gather,
                                        reduce, reduce_scatter, scatter)
from course_lib.mpi.group import (DEFAULT_TIMEOUT, Group, destroy_process_group, get_backend,
                                  get_global_rank, get_process_group_ranks, get_rank,
                                  get_world_size, init_process_group, is_initialized, launch,
                                  new_group, unavailable)
from course_lib.mpi.p2p import irecv, isend, recv, send
from course_lib.mpi.work import Work

__all__ = ["DEFAULT_TIMEOUT", "unavailable", "launch", "Group", "init_process_group",
           "is_initialized", "destroy_process_group", "get_backend", "get_rank", "get_world_size",
           "get_global_rank", "get_process_group_ranks", "new_group", "Work", "all_reduce",
           "broadcast", "reduce", "all_gather", "reduce_scatter", "gather", "scatter", "barrier",
           "isend", "irecv", "send", "recv", "all_to_all", "all_to_all_single", "ReduceOp",
           "DistTimeoutError"]
