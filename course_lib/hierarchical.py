"""Hierarchical all_reduce for many ranks per host and few hosts, in two versions.

    hosts = host_groups(ranks_per_host=4)           # collective: every rank calls it
    hierarchical_all_reduce(t, hosts)               # the simple one: one leader per host
    sharded_hierarchical_all_reduce(t, hosts)       # the production one: every rank a share

`hierarchical_all_reduce` reduces inside each host to its leader, all_reduces between the
leaders (a ring over the slow links), and broadcasts inside: only one rank per host crosses
hosts, and it carries the whole tensor. `sharded_hierarchical_all_reduce` is what Horovod's
hierarchical allreduce and NCCL's rings and trees do: a reduce-scatter inside the host leaves
each of its k ranks the host's sum of 1/k of the tensor; k all_reduces across hosts, one per
local rank (each on its own network card, a "rail", on GPU servers), reduce those shares in
parallel, n/k bytes each; an all-gather inside the host puts the pieces back together.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from course_lib.backend import default_dist
from course_lib.comm_model import Fit, cost
from course_lib.i18n import _

__all__ = ["Hosts", "host_groups", "hierarchical_all_reduce", "sharded_hierarchical_all_reduce",
           "hierarchical_cost", "sharded_hierarchical_cost"]


@dataclass
class Hosts:
    """This rank's place in a layout of `ranks_per_host` consecutive ranks per host."""

    ranks_per_host: int
    host: int
    local: Any  # this host's group
    leader: int  # its first rank (global)
    leaders: Any  # the group of every host's leader (None on other ranks)
    dist: Any
    rail: Any = None  # the group of the ranks with this rank's place on every host


def host_groups(ranks_per_host: int, *, dist: Any = None) -> Hosts:
    """Groups for hosts of `ranks_per_host` consecutive ranks each: each host's, the leaders',
    and one per place in a host (its rail). torch's new_group is collective: every rank
    creates every group, in the same order."""
    dist = default_dist(dist)
    world, rank = dist.get_world_size(), dist.get_rank()
    if not isinstance(ranks_per_host, int) or ranks_per_host < 1 or world % ranks_per_host:
        raise ValueError(_("host_groups: {world} ranks do not split into hosts of {per_host} "
                           "ranks", world=world, per_host=repr(ranks_per_host)))
    hosts = world // ranks_per_host
    local = None
    for h in range(hosts):
        group = dist.new_group(list(range(h * ranks_per_host, (h + 1) * ranks_per_host)))
        if rank // ranks_per_host == h:
            local = group
    leaders = dist.new_group([h * ranks_per_host for h in range(hosts)])
    rail = leaders if rank % ranks_per_host == 0 else None
    for place in range(1, ranks_per_host):
        group = dist.new_group([h * ranks_per_host + place for h in range(hosts)])
        if rank % ranks_per_host == place:
            rail = group
    host = rank // ranks_per_host
    return Hosts(ranks_per_host, host, local, host * ranks_per_host,
                 leaders if rank % ranks_per_host == 0 else None, dist, rail)


def hierarchical_all_reduce(tensor: torch.Tensor, hosts: Hosts) -> None:
    """Sum `tensor` over every rank, in place: reduce to the host's leader, ring between
    leaders, broadcast from the leader."""
    dist = hosts.dist
    if hosts.ranks_per_host > 1:
        dist.reduce(tensor, dst=hosts.leader, group=hosts.local)
    if hosts.leaders is not None and dist.get_world_size(hosts.leaders) > 1:
        dist.all_reduce(tensor, group=hosts.leaders)
    if hosts.ranks_per_host > 1:
        dist.broadcast(tensor, src=hosts.leader, group=hosts.local)


def sharded_hierarchical_all_reduce(tensor: torch.Tensor, hosts: Hosts) -> None:
    """Sum `tensor` (contiguous) over every rank, in place: reduce-scatter inside the host,
    all_reduce of this rank's share with the same share of every other host, all-gather
    inside the host. The tensor is padded with zeros to a multiple of the ranks per host."""
    dist, k = hosts.dist, hosts.ranks_per_host
    flat = tensor.view(-1)
    n = flat.numel()
    size = -(-n // k)
    padded = torch.zeros(size * k, dtype=flat.dtype, device=flat.device)
    padded[:n] = flat
    share = torch.empty(size, dtype=flat.dtype, device=flat.device)
    if k > 1:
        dist.reduce_scatter(share, list(padded.chunk(k)), group=hosts.local)
    else:
        share.copy_(padded)
    if dist.get_world_size(hosts.rail) > 1:
        dist.all_reduce(share, group=hosts.rail)
    if k > 1:
        pieces = [torch.empty_like(share) for _ in range(k)]
        dist.all_gather(pieces, share, group=hosts.local)
        flat.copy_(torch.cat(pieces)[:n])
    else:
        flat.copy_(share[:n])


def hierarchical_cost(nbytes: float, hosts: int, ranks_per_host: int, inside: Fit,
                      across: Fit) -> float:
    """The model's time of the leader version: a binomial-tree reduce and broadcast inside a
    host (lg k steps each of n bytes, on `inside`'s alpha-beta-gamma) around a ring between
    hosts (on `across`)."""
    k = ranks_per_host
    steps = (k - 1).bit_length()  # ceil(lg k)
    local = 2 * steps * (inside.alpha + nbytes * inside.beta) + steps * nbytes * inside.gamma
    return local + cost("ring", nbytes, hosts, across)


def sharded_hierarchical_cost(nbytes: float, hosts: int, ranks_per_host: int, inside: Fit,
                              across: Fit) -> float:
    """The model's time of the sharded version: a ring reduce-scatter and all-gather inside a
    host (together, one ring all_reduce's cost on `inside`) around k ring all_reduces of n/k
    between hosts, in parallel, each on a network card of its own (on `across`)."""
    k = ranks_per_host
    return cost("ring", nbytes, k, inside) + cost("ring", nbytes / k, hosts, across)
