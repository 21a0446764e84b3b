"""Hierarchical all_reduce for many ranks per host and few hosts: reduce inside each host to its
leader, all_reduce between the leaders (a ring over the slow links), broadcast inside.

    hosts = host_groups(ranks_per_host=4)           # collective: every rank calls it
    hierarchical_all_reduce(t, hosts)

Only one rank per host sends across hosts, once per call: 2 (h-1)/h n bytes over the
network instead of every rank's share of a flat ring; the hops inside a host are cheap.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from course_lib.backend import default_dist
from course_lib.comm_model import Fit, cost

__all__ = ["Hosts", "host_groups", "hierarchical_all_reduce", "hierarchical_cost"]


@dataclass
class Hosts:
    """This rank's place in a layout of `ranks_per_host` consecutive ranks per host."""

    ranks_per_host: int
    host: int
    local: Any  # this host's group
    leader: int  # its first rank (global)
    leaders: Any  # the group of every host's leader (None on other ranks)
    dist: Any


def host_groups(ranks_per_host: int, *, dist: Any = None) -> Hosts:
    """Groups for hosts of `ranks_per_host` consecutive ranks each (torch's new_group is
    collective: every rank creates every group, in the same order)."""
    dist = default_dist(dist)
    world, rank = dist.get_world_size(), dist.get_rank()
    if not isinstance(ranks_per_host, int) or ranks_per_host < 1 or world % ranks_per_host:
        raise ValueError(f"host_groups: {world} ranks do not split into hosts of "
                         f"{ranks_per_host!r} ranks")
    hosts = world // ranks_per_host
    local = None
    for h in range(hosts):
        group = dist.new_group(list(range(h * ranks_per_host, (h + 1) * ranks_per_host)))
        if rank // ranks_per_host == h:
            local = group
    leaders = dist.new_group([h * ranks_per_host for h in range(hosts)])
    host = rank // ranks_per_host
    return Hosts(ranks_per_host, host, local, host * ranks_per_host,
                 leaders if rank % ranks_per_host == 0 else None, dist)


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


def hierarchical_cost(nbytes: float, hosts: int, ranks_per_host: int, inside: Fit,
                      across: Fit) -> float:
    """The model's time: a binomial-tree reduce and broadcast inside a host (lg k steps each
    of n bytes, on `inside`'s alpha-beta-gamma) around a ring between hosts (on `across`)."""
    k = ranks_per_host
    steps = (k - 1).bit_length()  # ceil(lg k)
    local = 2 * steps * (inside.alpha + nbytes * inside.beta) + steps * nbytes * inside.gamma
    return local + cost("ring", nbytes, hosts, across)
