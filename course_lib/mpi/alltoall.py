"""all_to_all and all_to_all_single on MPI's `Ialltoallv`: the blocks as counts and
displacements into one send and one receive buffer (no pickling), uneven and 0-length blocks
included, with `course_lib.dist`'s signatures and argument errors. MPI chooses the schedule
itself (MPICH: pairwise exchange for large messages); `algorithm` is checked, as ours is, and
otherwise left to MPI."""

from __future__ import annotations

from itertools import accumulate
from typing import Sequence

import torch

from course_lib.dist.alltoall import _check_algorithm, check_lists, check_single
from course_lib.dist.peer import overlaps
from course_lib.mpi.group import Group, _group, _state
from course_lib.mpi.work import Work, _buffer, _contiguous, _host, _issue


def _exchange(g: Group, send: torch.Tensor, send_counts: list[int], recv: torch.Tensor,
              recv_counts: list[int]):
    """MPI_Ialltoallv of flat buffers, counts in elements."""
    sbuf, rbuf = _buffer(send), _buffer(recv)
    send_at = [0, *accumulate(send_counts)][:-1]
    recv_at = [0, *accumulate(recv_counts)][:-1]
    return g.comm.Ialltoallv([sbuf[0], (send_counts, send_at), sbuf[1]],
                             [rbuf[0], (recv_counts, recv_at), rbuf[1]])


def _me() -> int:
    return _state["world"].comm.Get_rank()


def all_to_all_single(output: torch.Tensor, input: torch.Tensor,
                      output_split_sizes: Sequence[int] | None = None,
                      input_split_sizes: Sequence[int] | None = None,
                      group: Group | None = None, async_op: bool = False, *,
                      algorithm: str = "pairwise") -> Work | None:
    """Split `input` along dim 0 by input_split_sizes, block j to rank j; `output` gathers the
    blocks from ranks 0..p-1 in order, sized by output_split_sizes (even splits when None)."""
    _host("all_to_all_single", output, input)
    _check_algorithm(algorithm)
    g = _group(group, "all_to_all_single")
    p, me = g.comm.Get_size(), g.comm.Get_rank()
    in_sizes, out_sizes = check_single(output, input, output_split_sizes, input_split_sizes,
                                       p, me, _me())
    row = torch.Size(input.shape[1:]).numel()  # elements per row (1 for a vector)
    send = input.detach().contiguous()
    if overlaps(send, output):
        send = send.clone()  # in place: MPI's send and receive buffers must not alias
    recv, copy_back = _contiguous(output)
    request = _exchange(g, send, [n * row for n in in_sizes], recv,
                        [n * row for n in out_sizes])
    return _issue(Work(request, "all_to_all_single", then=copy_back, result=[output],
                       keep=(send, recv)), async_op)


def all_to_all(output_tensor_list: list[torch.Tensor], input_tensor_list: list[torch.Tensor],
               group: Group | None = None, async_op: bool = False, *,
               algorithm: str = "pairwise") -> Work | None:
    """input_tensor_list[j] of rank i lands in output_tensor_list[i] of rank j."""
    _host("all_to_all", *output_tensor_list, *input_tensor_list)
    _check_algorithm(algorithm)
    g = _group(group, "all_to_all")
    p, me = g.comm.Get_size(), g.comm.Get_rank()
    check_lists(output_tensor_list, input_tensor_list, p, me, _me())
    send = torch.cat([t.detach().reshape(-1) for t in input_tensor_list])
    recv_counts = [t.numel() for t in output_tensor_list]
    recv = torch.empty(sum(recv_counts), dtype=send.dtype, device=send.device)

    def copy_out() -> None:
        for t, piece in zip(output_tensor_list, recv.split(recv_counts)):
            t.detach().copy_(piece.view(t.shape))

    request = _exchange(g, send, [t.numel() for t in input_tensor_list], recv, recv_counts)
    return _issue(Work(request, "all_to_all", then=copy_out, result=output_tensor_list,
                       keep=(send, recv)), async_op)
