"""Lessons 12a and 12b's experiments and closed forms: sequence parallelism against one process,
activations and bytes per rank, ring attention against full attention, the causal work per rank,
memory against sequence length for cp = 1, 2, 4, and the time with and without overlap.

The functions named in the notebooks run on every engine of a cluster (`cluster.run`); a cp or
tp group of the first k ranks is made with `new_group` on every rank, and ranks outside it
return None. Components (course_lib.sequence_parallel, course_lib.context_parallel) are imported
inside the functions that use them, on purpose: the learner's overlay decides at each call which
version runs (theirs or the reference), and a name bound at import time would keep the first one.
"""

from __future__ import annotations

import copy
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F

from course_lib.backend import default_dist
from course_lib.i18n import N_, _

__all__ = ["saved_bytes", "block_activation_bytes", "tp_block_sent_bytes", "ring_block_bytes",
           "ring_messages", "causal_work", "imbalance", "first_ranks", "tensor_parallel_block",
           "expected_grad", "sp_block_against_one_process", "sp_memory_and_bytes",
           "ring_against_full", "work_per_rank", "memory_against_length", "overlap_times",
           "torch_ring_side_by_side"]

B, S, H, HEADS = 2, 12, 24, 12  # the proofs' block: S and HEADS divide by 2, 3 and 4
MODES = ("tp", "sp", "sp keeping the gathered input")
LABELS = {"one process": N_("one process"), MODES[2]: N_("sp keeping the gathered input")}
SP_PARAMS = ["attn.out_proj.bias", "ln_1.bias", "ln_1.weight", "ln_2.bias", "ln_2.weight",
             "mlp.fc2.bias"]


# --- the closed forms ---------------------------------------------------------------------------

def saved_bytes(fn: Callable[..., Any], *args: Any,
                exclude: tuple[torch.Tensor, ...] = ()) -> tuple[Any, int]:
    """(fn(*args), bytes of the distinct storages autograd saved during the call, less those of
    `exclude`: the parameters)."""
    skip = {p.untyped_storage().data_ptr() for p in exclude}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = fn(*args)
    return result, sum(seen.values())


def block_activation_bytes(b: int, s: int, h: int, heads: int, *, tp: int = 1, cp: int = 1,
                           sp: bool = False, save_gathered_input: bool = False,
                           element_size: int = 4) -> float:
    """Bytes one rank keeps for one block's backward: e (16bsh + 4bs + abs) on one process; the
    tp regions (12bsh + abs) / tp; with SP the norm regions (2bsh + 4bs) and, unless kept
    gathered, the linear inputs (2bsh) / tp too; s -> s / cp."""
    n = b * s / cp
    tp_regions = (12 * h + heads) * n / tp
    norm_regions = (2 * h + 4) * n
    linear_inputs = 2 * h * n
    if sp:
        norm_regions /= tp
        linear_inputs = linear_inputs if save_gathered_input else linear_inputs / tp
    return element_size * (tp_regions + norm_regions + linear_inputs)


def tp_block_sent_bytes(b: int, s: int, h: int, tp: int, *, sp: bool = False,
                        save_gathered_input: bool = False, element_size: int = 4) -> float:
    """Bytes one rank sends for one block's forward and backward (ring collectives): 8 (TP's
    four all-reduces, or SP's four all-gathers and four reduce-scatters), 10 with SP's
    re-gathering linear, times (tp - 1) / tp bsh e."""
    collectives = 8 if not sp or save_gathered_input else 10
    return collectives * (tp - 1) / tp * b * s * h * element_size


def ring_block_bytes(b: int, s: int, h: int, cp: int, *, tp: int = 1,
                     element_size: int = 4) -> float:
    """Bytes of one key/value block (k and v stacked) of this rank's heads."""
    return 2 * b * (s / cp) * (h / tp) * element_size


def ring_messages(cp: int) -> dict[str, int]:
    """isends per ring attention: forward cp - 1; backward cp - 1 blocks and cp gradients."""
    return {"forward": cp - 1, "backward": 2 * cp - 1} if cp > 1 else \
        {"forward": 0, "backward": 0}


def causal_work(layout: str, cp: int, chunk: int, causal: bool = True) -> list[list[int]]:
    """work[rank][step]: score elements (per batch and head) a rank computes at each step,
    chunk pairs a mask hides completely skipped (a diagonal pair counts whole)."""
    unit = chunk * chunk
    work = []
    for rank in range(cp):
        steps = []
        for step in range(cp):
            if not causal:
                steps.append(4 * unit)
            elif step == 0:
                steps.append(3 * unit)
            elif layout == "zigzag":
                steps.append(2 * unit)
            else:
                steps.append(4 * unit if step <= rank else 0)
        work.append(steps)
    return work


def imbalance(work: list[list[int]]) -> float:
    """Most work on one rank over the mean (1: balanced)."""
    return max(map(sum, work)) / (sum(map(sum, work)) / len(work))


# --- sequence parallelism -----------------------------------------------------------------------

def first_ranks(k: int, dist: Any = None) -> tuple[Any, Any, bool]:
    """(dist, a group of global ranks 0..k-1, whether this rank is in it); every rank calls it."""
    dist = default_dist(dist)
    group = dist.new_group(list(range(k)))
    return dist, group, dist.get_rank() < k


def tensor_parallel_block(block: Any, dist: Any, group: Any, sequence_parallel: bool) -> None:
    """Swap a GPT block's attention and MLP for this rank's shards, in SP mode or not."""
    from course_lib import sequence_parallel as sp

    attn = block.attn
    with torch.random.fork_rng(devices=[]):  # their own initializations are overwritten
        new = sp.TensorParallelAttention(attn.embed_dim, attn.num_heads, causal=True, dist=dist,
                                         group=group)
        block.mlp = sp.TensorParallelMLP.from_linears(block.mlp.fc1, block.mlp.fc2, dist=dist,
                                                      group=group)
    new.qkv = new.column.from_linear(attn.qkv, dist=dist, group=group, parts=3)
    new.out_proj = new.row.from_linear(attn.out_proj, dist=dist, group=group)
    block.attn = new.to(attn.qkv.weight.dtype)
    sp.set_sequence_parallel(block, sequence_parallel)


def expected_grad(name: str, full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """This rank's slice of a one-process gradient, by the parameter's name."""
    from course_lib.tensor_parallel import shard

    if name.startswith("attn.qkv."):
        return shard(full, 0, rank, world, parts=3)
    if name in ("mlp.fc1.weight", "mlp.fc1.bias"):
        return shard(full, 0, rank, world)
    if name in ("attn.out_proj.weight", "mlp.fc2.weight"):
        return shard(full, 1, rank, world)
    return full  # norms and the row-parallel biases are whole on every rank


def _block(s: int = S, h: int = H, heads: int = HEADS):
    from course_lib import gpt  # the capstone's block, as the overlay resolves it

    torch.manual_seed(0)
    block = gpt.Block(gpt.GPTConfig(n_embd=h, n_head=heads, block_size=s)).double()
    for p in block.parameters():  # norms and biases away from 1 and 0: every gradient counts
        torch.nn.init.normal_(p, std=0.3)
    return block


def sp_modes(world: int, dist: Any, group: Any, rank: int, s: int = S, h: int = H,
             heads: int = HEADS, modes: tuple = MODES) -> dict:
    """One process, then each mode on this rank: errors of the output and every gradient,
    the wrong version's (no all-reduce of the marked gradients), saved bytes, collectives."""
    from course_lib import sequence_parallel as sp
    from course_lib.counting import CountingDist

    block = _block(s, h, heads)
    x = torch.randn(B, s, h, dtype=torch.float64)
    w = torch.randn(B, s, h, dtype=torch.float64)
    ref = copy.deepcopy(block)
    x_ref = x.clone().requires_grad_()
    y_ref, ref_bytes = saved_bytes(ref, x_ref, exclude=tuple(ref.parameters()))
    (y_ref * w).sum().backward()
    full = dict(ref.named_parameters())
    results: dict = {"one process": {"bytes": ref_bytes}}
    for mode in modes:
        counting = CountingDist(dist, group)  # group=None below: this group
        mine = copy.deepcopy(block)
        on = mode != "tp"
        tensor_parallel_block(mine, counting, None, on)
        for m in mine.modules():
            if isinstance(m, sp.ColumnParallelLinear):
                m.save_gathered_input = mode.endswith("gathered input")

        def local(t):
            return t.chunk(world, dim=1)[rank] if on else t

        x_in = local(x).clone().requires_grad_()
        counting.reset()
        y, nbytes = saved_bytes(mine, x_in, exclude=tuple(mine.parameters()))
        (y * local(w)).sum().backward()
        calls, sent = dict(counting.calls), counting.sent_bytes()
        before = {n: p.grad.clone() for n, p in mine.named_parameters()}
        counting.reset()
        sp.allreduce_sequence_parallel_grads(mine, counting)
        errs = {"out": float((y - local(y_ref)).abs().max()),
                "dx": float((x_in.grad - local(x_ref.grad)).abs().max())}
        wrong = {}
        for name, p in mine.named_parameters():
            expected = expected_grad(name, full[name].grad, rank, world)
            errs[name] = float((p.grad - expected).abs().max())
            wrong[name] = float((before[name] - expected).abs().max())
        results[mode] = {"errs": errs, "without all-reduce": wrong, "bytes": nbytes,
                         "calls": calls, "sent": sent,
                         "sp all_reduce": (dict(counting.calls), counting.sent_bytes()),
                         "marked": sorted(n for n, p in mine.named_parameters()
                                          if getattr(p, "sequence_parallel", False))}
    return results


def sp_block_against_one_process(tp: int) -> dict | None:
    """12a's proof on the first `tp` ranks: SP's largest error, and what is wrong without."""
    dist, group, member = first_ranks(tp)
    if not member:
        return None
    r = sp_modes(tp, dist, group, dist.get_rank(group), modes=("sp",))["sp"]
    return {"largest error": max(r["errs"].values()), "compared": len(r["errs"]),
            "wrong without all-reduce": sorted(n for n, e in r["without all-reduce"].items()
                                               if e > 1e-6)}


def sp_memory_and_bytes(tp: int, s: int) -> dict | None:
    """{mode: (saved bytes, the formula's, bytes sent)} for one block of h = 24 on the first
    `tp` ranks (one process when tp = 1); each mode named in the learner's language."""
    dist, group, member = first_ranks(tp)
    if not member:
        return None
    if tp == 1:
        saved = sp_modes(1, dist, group, 0, s=s, modes=())["one process"]["bytes"]
        model = block_activation_bytes(B, s, H, HEADS, element_size=8)
        return {_(LABELS["one process"]): (saved, model, 0)}
    r = sp_modes(tp, dist, group, dist.get_rank(group), s=s)
    out = {}
    for mode in MODES:
        on, keep = mode != "tp", mode.endswith("gathered input")
        out[_(LABELS.get(mode, mode))] = (r[mode]["bytes"], block_activation_bytes(
            B, s, H, HEADS, tp=tp, sp=on, save_gathered_input=keep, element_size=8),
            r[mode]["sent"])
    return out


# --- ring attention -----------------------------------------------------------------------------

def _rand(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def ring_case(dist: Any, group: Any, cp: int, rank: int, t: int, causal: bool, layout: str,
              overlap: bool = True, stats: dict | None = None) -> tuple[dict, torch.Tensor]:
    """Errors of out, dq, dk, dv of ring attention against full attention (float64)."""
    from course_lib import context_parallel as ctx

    q, k, v, w = (_rand(2, 2, t, 3, seed=s + 10 * t) for s in range(4))
    full = [z.clone().requires_grad_() for z in (q, k, v)]
    out_full = F.scaled_dot_product_attention(*full, is_causal=causal)
    (out_full * w).sum().backward()

    def mine(z):
        return ctx.split_sequence(z, cp, rank, layout=layout, dim=2)

    local = [mine(z).requires_grad_() for z in (q, k, v)]
    out = ctx.ring_attention(*local, causal=causal, seq_len=t, layout=layout, dist=dist,
                             group=group, overlap=overlap, stats=stats)
    (out * mine(w)).sum().backward()
    whole = ctx.gather_sequence(out.detach(), t, layout=layout, dim=2, dist=dist, group=group)
    errs = {"out": float((whole - out_full).abs().max())}
    for name, z, f in zip("qkv", local, full):
        errs["d" + name] = float((z.grad - mine(f.grad)).abs().max())
    return errs, out.detach()


def ring_against_full(cp: int) -> dict | None:
    """The notebook's proof on the first `cp` ranks: causal and not, both layouts, T = 4 cp
    (divides by 2 cp) and 4 cp - 3 (does not)."""
    dist, group, member = first_ranks(cp)
    if not member:
        return None
    errs = [e for causal in (False, True) for layout in ("zigzag", "contiguous")
            for t in (4 * cp, 4 * cp - 3)
            for e in ring_case(dist, group, cp, dist.get_rank(group), t, causal, layout)[0]
            .values()]
    return {"cases": len(errs) // 4, "largest error": max(errs)}


def work_per_rank(cp: int, layout: str) -> list[int] | None:
    """Chunk pairs this rank computes at each step of a causal forward (stats / chunk²)."""
    dist, group, member = first_ranks(cp)
    if not member:
        return None
    stats: dict = {}
    ring_case(dist, group, cp, dist.get_rank(group), 8 * cp, True, layout, stats=stats)
    return [w // 16 for w in stats["forward"]]  # chunks of 4 positions: 16 scores a pair


def ring_block(x: torch.Tensor, params: dict, core: Callable) -> torch.Tensor:
    """A pre-norm block on this rank's positions (b, n, h) with `core(q, k, v)` attention."""
    b, n, h = x.shape
    heads = params["heads"]
    y = F.layer_norm(x, (h,))
    q, k, v = F.linear(y, params["qkv"]).view(b, n, 3, heads, h // heads).unbind(dim=2)
    a = core(*(z.transpose(1, 2) for z in (q, k, v)))
    x = x + F.linear(a.transpose(1, 2).reshape(b, n, h), params["proj"])
    y = F.layer_norm(x, (h,))
    return x + F.linear(F.gelu(F.linear(y, params["fc1"])), params["fc2"])


def memory_against_length(cp: int, lengths: list[int], h: int = 64,
                          heads: int = 4) -> list[tuple[int, float]] | None:
    """[(bytes autograd saves on this rank for one block with ring attention, the model's)]
    for each sequence length, the sequence split over the first `cp` ranks (float32)."""
    from course_lib import context_parallel as ctx

    dist, group, member = first_ranks(cp)
    if not member:
        return None
    g = torch.Generator().manual_seed(0)
    params = {name: (torch.randn(*shape, generator=g) * 0.1).requires_grad_()
              for name, shape in (("qkv", (3 * h, h)), ("proj", (h, h)), ("fc1", (4 * h, h)),
                                  ("fc2", (h, 4 * h)))}
    rows = []
    for s in lengths:
        x = ctx.split_sequence(torch.randn(1, s, h, generator=g), cp, dist.get_rank(group))

        def core(q, k, v):
            return ctx.ring_attention(q, k, v, causal=True, seq_len=s, dist=dist, group=group)

        run = {**params, "heads": heads}
        out, nbytes = saved_bytes(lambda z: ring_block(z.requires_grad_(), run, core), x,
                                  exclude=tuple(params.values()))
        out.sum().backward()
        rows.append((nbytes, block_activation_bytes(1, s, h, heads, cp=cp)))
    return rows


def overlap_times(cp: int, s: int, repeats: int, heads: int = 4,
                  head_dim: int = 64) -> dict | None:
    """The fastest of `repeats` forward + backward of causal ring attention (float32), slowest
    rank, with and without overlap, on the first `cp` ranks."""
    from course_lib import context_parallel as ctx

    dist, group, member = first_ranks(cp)
    if not member:
        return None
    q, k, v = (ctx.split_sequence(_rand(1, heads, s, head_dim, seed=i, dtype=torch.float32),
                                  cp, dist.get_rank(group), dim=2) for i in range(3))
    result = {}
    for overlap in (True, False):
        best = float("inf")
        for _ in range(repeats):
            z = [t.clone().requires_grad_() for t in (q, k, v)]
            dist.barrier(group=group)
            start = time.perf_counter()
            ctx.ring_attention(*z, causal=True, seq_len=s, dist=dist, group=group,
                               overlap=overlap).sum().backward()
            took = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(took, op=dist.ReduceOp.MAX, group=group)
            best = min(best, float(took))
        result[f"overlap={overlap}"] = best
    return result


def torch_ring_side_by_side(seq: int = 16) -> dict:
    """torch's ring (the private `_templated_ring_attention` behind `context_parallel`, with the
    CPU flash kernel) and this lesson's, on the same zigzag parts over torch.distributed's
    world: the largest difference of output and gradients, causal and not (float64)."""
    import torch.distributed as tdist
    from torch.distributed.tensor.experimental._context_parallel import _attention as torch_cp

    from course_lib import context_parallel as ctx

    aten = torch.ops.aten
    torch_cp._cp_options.convert_to_f32 = False  # else it merges in float32, even for float64

    def backward_op(*, grad_out, query, key, value, out, logsumexp, is_causal, **_):
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, query, key, value, out, logsumexp, 0.0, is_causal)

    rank, world, errs = tdist.get_rank(), tdist.get_world_size(), {}
    for causal in (False, True):
        torch_cp._cp_options.enable_load_balance = causal  # round robin: our zigzag
        q, k, v, w = (ctx.zigzag_split(_rand(2, 3, seq, 4, seed=s), world, rank, dim=2)
                      for s in range(4))
        out, lse, *_ = torch_cp._templated_ring_attention(
            tdist.group.WORLD, 2, aten._scaled_dot_product_flash_attention_for_cpu, q, k, v,
            is_causal=causal)
        grads = torch_cp._templated_ring_attention_backward(
            tdist.group.WORLD, 2, backward_op, w, "grad_out", q, k, v, out, lse, is_causal=causal)[:3]
        local = [z.clone().requires_grad_() for z in (q, k, v)]
        ours = ctx.ring_attention(*local, causal=causal, dist=tdist)
        (ours * w).sum().backward()
        diffs = [ours - out] + [z.grad - g for z, g in zip(local, grads)]
        errs["causal" if causal else "not causal"] = max(float(d.abs().max()) for d in diffs)
    return errs
