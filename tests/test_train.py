"""The capstone's run against one process: every layout's loss per step, the numerics, the CLI.

Every layout trains the same tiny GPT on the same global batches as one process does
(`reference_losses`); float32 losses agree within 1e-5 relative (the layouts only change the
order of sums: micro-batch means, partial matmuls summed by TP's all-reduce, DDP's averages;
measured differences are ~2e-7). All layouts run in one 4-rank spawn to pay start-up once.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from course_lib.gpt import GPT, Block, GPTConfig, set_activation_checkpointing
from course_lib.moe import MoE
from course_lib.context_parallel import pad_sequence, zigzag_split
from course_lib.rng import REPLICATED, SHARDED, RNGStatesTracker, seed_streams
from course_lib.accumulation import saved_activation_bytes
from course_lib.spawn import spawn
from course_lib.train import (DynamicLossScaler, Run, TrainConfig, check_config, reference_losses,
                              torchrun, train, train_one_process, update_scale)
from course_lib.train_loop import one_process, one_process_config, run_steps

TINY = TrainConfig(steps=12, batch_size=8, micro_batches=2, block_size=16, n_layer=2, n_head=2,
                   n_embd=32)
FP32_RTOL = 1e-5
BF16_RTOL = 2e-3  # bf16 keeps 8 bits of mantissa: partial sums rounded in another order
LAYOUTS = {
    "(4,1,1) DDP": dict(dp=4),
    "(2,2,1)": dict(dp=2, tp=2, sample=40),
    "(2,1,2)": dict(dp=2, pp=2),
    "(1,2,2) checkpointed": dict(tp=2, pp=2, checkpoint_activations=True),
    "(2,2,1) ZeRO-1": dict(dp=2, tp=2, zero=1),
    "(2,2,1) ZeRO-3": dict(dp=2, tp=2, zero=3),
    "(4,1,1) ZeRO-3, no accumulation": dict(dp=4, zero=3, micro_batches=1),
    "(2,2,1) bf16": dict(dp=2, tp=2, precision="bf16"),
    "(4,1,1) bf16, bf16 reduction": dict(dp=4, precision="bf16", reduce_dtype="bf16"),
    "(2,1,2) fp16, overflow at step 3": dict(dp=2, pp=2, precision="fp16"),
}
INF_STEP, INF_RANK = 3, 3
# With AdamW a gradient twice too large moves the weights almost as far (its step is normalized):
# a sum left unaveraged over dp, or micro-batches not divided, passes the AdamW tests above.
# SGD's step is in proportion to the gradient, so these runs catch it.
SGD = dataclasses.replace(TINY, optimizer="sgd", lr=0.5, steps=6)
SGD_LAYOUTS = {"(4,1,1) DDP, sgd": dict(dp=4), "(2,1,2), sgd": dict(dp=2, pp=2),
               "(1,2,2), sgd": dict(tp=2, pp=2), "(2,2,1) ZeRO-1, sgd": dict(dp=2, tp=2, zero=1),
               "(4,1,1) ZeRO-3, sgd": dict(dp=4, zero=3)}


def inject_inf(run) -> None:
    """An overflow in one gradient of one rank at one step (what fp16 meets in practice)."""
    if run.steps_done == INF_STEP and run.dist.get_rank() == INF_RANK % run.dist.get_world_size():
        p = next(p for p in run.stage.parameters() if p.grad is not None)
        p.grad.view(-1)[0] = float("inf")


def run_layouts(rank: int, world: int, cfgs: dict) -> dict:
    return {name: train(cfg, after_backward=inject_inf if cfg.precision == "fp16" else None)
            for name, cfg in cfgs.items()}


# Correct at scale (issue 46): dropout, the loss per real token and gradient clipping together.
AT_SCALE = dataclasses.replace(SGD, steps=3, dropout=0.2, token_weighted=True, clip_grad_norm=0.3)
SCALE_LAYOUTS = {"(2,2,1) dropout, per token, clipped": dict(dp=2, tp=2),
                 "(2,1,2) dropout, per token, clipped": dict(dp=2, pp=2),
                 "(1,2,1) cp=2, SP, dropout, per token, clipped": dict(cp=2, tp=2, sp=True,
                                                                       block_size=10)}

# Long sequences (issue 48): context parallelism (each sequence in zigzag parts, ring attention)
# and sequence parallelism (the norm regions split over tp); ZeRO with clipping (issue 46): each
# rank's real elements of its gradient shards, summed over the ranks that share them, the
# replicated parameters' elements counted on tp rank 0 only. Three SGD
# steps each; one process with the same clipping of the whole gradient is the reference.
LONG = dataclasses.replace(SGD, steps=3)
LONG_LAYOUTS = {"(2,1,1) cp=2": dict(dp=2, cp=2),  # 4 ranks
                "(1,2,1) cp=2, SP, block 10": dict(cp=2, tp=2, sp=True, block_size=10),
                "cp=2": dict(cp=2),  # 2 ranks from here
                "tp=2, SP": dict(tp=2, sp=True),
                "(2,2,1) ZeRO-1, clipped": dict(dp=2, tp=2, zero=1, clip_grad_norm=0.3),
                "(2,2,1) ZeRO-3, clipped": dict(dp=2, tp=2, zero=3, clip_grad_norm=0.3)}


def long_world(kw: dict) -> int:
    return kw.get("dp", 1) * kw.get("cp", 1) * kw.get("tp", 1)


def one_process_losses(cfg: TrainConfig) -> list[float]:
    """`reference_losses`, once per one-process configuration (layouts share it)."""
    return _one_process_losses(one_process_config(cfg))


_one_process_losses = functools.lru_cache(maxsize=None)(reference_losses)


RESUMED = ("(2,2,1) ZeRO-1", "(2,1,2)")  # sharded optimizer state; a tied weight on two stages


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    cfgs = {name: dataclasses.replace(TINY, **kw) for name, kw in LAYOUTS.items()}
    cfgs.update({name: dataclasses.replace(SGD, **kw) for name, kw in SGD_LAYOUTS.items()})
    cfgs.update({name: dataclasses.replace(AT_SCALE, **kw) for name, kw in SCALE_LAYOUTS.items()})
    cfgs.update({name: dataclasses.replace(MOE, **kw) for name, kw in MOE_LAYOUTS.items()
                 if kw["dp"] == 4})
    cfgs.update({name: dataclasses.replace(LONG, **kw) for name, kw in LONG_LAYOUTS.items()
                 if long_world(kw) == 4})
    for name in RESUMED:  # stopped after 6 steps (checkpoints at 3 and 6), then resumed
        folder = str(tmp_path_factory.mktemp("checkpoints"))
        cfgs[name + " stopped"] = dataclasses.replace(
            cfgs[name], steps=6, checkpoint_dir=folder, checkpoint_every=3)
        cfgs[name + " resumed"] = dataclasses.replace(cfgs[name], checkpoint_dir=folder)
    return spawn(run_layouts, 4, cfgs, backend="scratch", timeout=600)


@pytest.fixture(scope="module")
def reference():
    return {**{p: reference_losses(dataclasses.replace(TINY, precision=p))
               for p in ("fp32", "bf16")}, "sgd": reference_losses(SGD)}


def rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("name", [n for n in LAYOUTS if "bf16" not in n and "fp16" not in n])
def test_fp32_layout_matches_one_process(results, reference, name):
    losses = results[0][name]["losses"]
    assert len(losses) == TINY.steps
    assert all(r[name]["losses"] == losses for r in results), "ranks disagree on the loss"
    assert rel(losses, reference["fp32"]) < FP32_RTOL
    assert losses[-1] < losses[0] - 0.05, "the loss did not fall"


@pytest.mark.parametrize("name", SGD_LAYOUTS)
def test_sgd_layout_matches_one_process(results, reference, name):
    losses = results[0][name]["losses"]
    assert all(r[name]["losses"] == losses for r in results), "ranks disagree on the loss"
    assert rel(losses, reference["sgd"]) < FP32_RTOL
    assert losses[-1] < losses[0] - 0.05, "the loss did not fall"


@pytest.mark.parametrize("name", RESUMED)
def test_a_run_resumed_from_its_checkpoint_ends_where_an_uninterrupted_one_does(results, name):
    """Lesson 09's checkpoints: model, optimizer (ZeRO's shards too), step and data position."""
    stopped, resumed = results[0][name + " stopped"], results[0][name + " resumed"]
    assert stopped["losses"] == results[0][name]["losses"][:6]
    assert resumed["first_step"] == 6
    assert resumed["losses"] == results[0][name]["losses"][6:]  # bit for bit


@pytest.mark.parametrize("name", [n for n in LAYOUTS if "bf16" in n])
def test_bf16_layout_matches_one_process_in_bf16(results, reference, name):
    losses = results[0][name]["losses"]
    assert rel(losses, reference["bf16"]) < BF16_RTOL
    assert losses != reference["fp32"], "bf16 computed exactly what fp32 does: no autocast?"
    assert rel(reference["bf16"], reference["fp32"]) < BF16_RTOL


def test_bf16_keeps_fp32_master_weights(results):
    mem = results[0]["(2,2,1) bf16"]["memory"]
    assert mem == results[0]["(2,2,1)"]["memory"]  # same bytes: weights, grads, Adam all fp32


def test_fp16_overflow_skips_the_step_everywhere_and_shrinks_the_scale(results, reference):
    name = "(2,1,2) fp16, overflow at step 3"
    for r in results:
        assert r[name]["skipped"] == [i == INF_STEP for i in range(TINY.steps)]
        assert r[name]["scale"] == TINY.init_scale / 2
    losses = results[0][name]["losses"]
    # The skipped step leaves the weights alone: the next step sees the same model again
    # (a different batch), and training goes on close to fp32's.
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0] - 0.05


def test_fp16_reference_with_the_same_skip(results):
    """One process with the same injected overflow: the same losses as the 4-rank pipeline."""
    cfg = dataclasses.replace(TINY, precision="fp16", micro_batches=1)
    one = train_one_process(cfg, after_backward=inject_inf)
    name = "(2,1,2) fp16, overflow at step 3"
    assert one["skipped"] == results[0][name]["skipped"]
    assert rel(results[0][name]["losses"], one["losses"]) < BF16_RTOL


@pytest.mark.parametrize("found,tracker,expected", [
    (True, 5, (0.5, 0)),        # overflow: shrink, restart the count
    (False, 0, (1.0, 1)),       # clean: count
    (False, 2, (2.0, 0)),       # the interval-th clean step in a row: grow, restart
    (False, 1, (1.0, 2)),
])
def test_update_scale(found, tracker, expected):
    assert update_scale(1.0, tracker, found, growth_interval=3) == expected


def test_scaler_grows_after_clean_steps():
    s = DynamicLossScaler(init_scale=8.0, growth_interval=2)
    for found in (False, False, True, False):
        s.update(found)
    assert (s.scale, s.growth_tracker) == (8.0, 1)


def test_activation_checkpointing_changes_nothing_but_memory():
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=20, block_size=16, n_layer=3, n_head=2, n_embd=32)
    model = GPT(cfg)
    x = torch.randint(0, 20, (4, 16))

    def grads():
        model.zero_grad()
        model(x).square().mean().backward()
        return [p.grad.clone() for p in model.parameters()]

    plain, plain_bytes = grads(), saved_activation_bytes(model, x)
    set_activation_checkpointing(model, True)
    ckpt, ckpt_bytes = grads(), saved_activation_bytes(model, x)
    assert all(torch.equal(a, b) for a, b in zip(plain, ckpt))
    assert ckpt_bytes < plain_bytes / 2


@pytest.mark.parametrize("kw,named", [
    (dict(dp=3, tp=2, pp=1), "dp=3 x tp=2 x pp=1 = 6, but the world has 4"),
    (dict(dp=1, tp=4, pp=1, n_head=2), "n_head=2 is not divisible by tp=4"),
    (dict(dp=1, tp=1, pp=4, n_layer=6), "n_layer=6 is not divisible by pp=4"),
    (dict(dp=4, batch_size=6), "batch_size=6 is not divisible by dp=4"),
    (dict(dp=2, pp=2, zero=1), "zero=1 with pp=2"),
    (dict(dp=4, precision="fp8"), "precision='fp8'"),
    (dict(dp=4, optimizer="adam"), "optimizer='adam': choose 'adamw' or 'sgd'"),
    (dict(dp=2, tp=2, stack="torch"), "stack='torch' with tp=2 composes DTensor's TP with FSDP2 "
                                      "over dp=2: it needs zero=3 (got zero=0)"),
    (dict(dp=1, tp=2, pp=2, stack="torch"), "runs tp > 1 or pp > 1, not both (got tp=2, pp=2)"),
    (dict(dp=2, tp=2, zero=1, clip_grad_norm=0.0), "clip_grad_norm=0.0: choose a positive norm"),
    (dict(dp=2, cp=2, tp=2), "dp=2 x cp=2 x tp=2 x pp=1 = 8, but the world has 4"),
    (dict(dp=4, sp=True), "sp=True splits the tensor-parallel regions' norms: it needs tp > 1"),
    (dict(cp=2, pp=2), "cp=2 with pp=2"),
    (dict(dp=2, tp=2, sp=True, zero=1), "sp=True with zero=1"),
    (dict(dp=2, cp=2, sample=10), "cp=2: sampling needs every position"),
    (dict(dp=2, cp=2, stack="torch"), "cp=2 runs on the course's stack only"),
    (dict(dp=4, dropout=1.0), "dropout=1.0: choose a probability in [0, 1)"),
])
def test_bad_layout_is_named_before_anything_runs(kw, named):
    with pytest.raises(ValueError, match=re.escape(named)):
        check_config(dataclasses.replace(TINY, **kw), 4)


@pytest.mark.slow
def test_torchrun_runs_the_same_training(tmp_path, reference):
    # two processes (tp 2): the capstone notebook's checked cell runs (2, 2, 1) on four
    cfg = dataclasses.replace(TINY, tp=2, steps=3)
    before = set(Path(tempfile.gettempdir()).glob("torchelastic_*"))
    result = torchrun(cfg, nproc_per_node=2, json_file=tmp_path / "run.json", timeout=240)
    assert result["config"]["tp"] == 2 and result["rank"] == 0
    assert rel(result["losses"], reference["fp32"][:3]) < FP32_RTOL
    # its agent's log folder went with the run, not left in the temporary folder
    assert set(Path(tempfile.gettempdir()).glob("torchelastic_*")) <= before


def torch_and_ours(rank: int, world: int, cfgs: dict) -> dict:
    import torch.distributed as tdist
    return {name: train(cfg, dist=tdist)["losses"] for name, cfg in cfgs.items()}


def test_torch_stack_computes_the_same_losses(reference):
    """PyTorch's DDP, ZeroRedundancyOptimizer, FSDP2, DTensor's TP (with FSDP2 over dp) and
    torch.distributed.pipelining's 1F1B in our components' places, and ours, all on
    torch.distributed (gloo): the same losses as one process."""
    cfgs = {f"torch zero{z}": dataclasses.replace(TINY, dp=4, zero=z, stack="torch", steps=4)
            for z in (0, 1, 3)}
    cfgs["torch TP + FSDP2 (2,2,1)"] = dataclasses.replace(TINY, dp=2, tp=2, zero=3,
                                                           stack="torch", steps=4)
    cfgs["torch pipelining (2,1,2)"] = dataclasses.replace(TINY, dp=2, pp=2, stack="torch",
                                                           steps=4)
    cfgs["ours on torch.distributed"] = dataclasses.replace(TINY, dp=4, steps=4)
    cfgs["torch pipelining (2,1,2), sgd"] = dataclasses.replace(SGD, dp=2, pp=2, stack="torch",
                                                                steps=4)
    per_rank = spawn(torch_and_ours, 4, cfgs, backend="gloo", timeout=300)
    for name in cfgs:
        want = reference["sgd" if cfgs[name].optimizer == "sgd" else "fp32"][:4]
        assert rel(per_rank[0][name], want) < FP32_RTOL, name
        assert all(r[name] == per_rank[0][name] for r in per_rank), name


def test_sampling_is_the_same_on_tensor_parallel_ranks(results):
    samples = [r["(2,2,1)"]["sample"] for r in results]
    assert len(samples[0]) == 40 and samples == samples[:1] * 4


class OwnersMasks(Run):
    """One process whose every dropout mask is drawn from the stream of the rank of `layout`
    that owns it: dp rank d's rows (x[d::dp]), cp rank c's zigzag part of each padded sequence
    (its streams those of dp coordinate d * cp + c), tp rank t's slice of a sharded activation
    (its heads, its hidden units) and, with SP, its slice of the cp part along the sequence,
    stage p's blocks; micro-batch by micro-batch, in each rank's order. The loss is the step's
    per-token mean, summed micro-batch by micro-batch."""

    def __init__(self, cfg: TrainConfig, dist, layout: TrainConfig):
        super().__init__(cfg, dist)
        self.lay, self.dp_rank = layout, 0
        self.streams = {(d, t, p): seed_streams(cfg.seed, tp_rank=t, dp_rank=d, pp_rank=p,
                                                tracker=RNGStatesTracker())
                        for d in range(layout.dp * layout.cp) for t in range(layout.tp)
                        for p in range(layout.pp)}
        blocks = [m for m in self.model if isinstance(m, Block)]
        per = len(blocks) // layout.pp
        for i, block in enumerate(blocks):
            for m in (block.attn, block.mlp):
                m._drop = functools.partial(self._owners_drop, m, i // per)

    def _parts(self, t: int) -> list[tuple[int, torch.Tensor]]:
        """(cp rank, its positions in the padded sequence, in its order) for sequences of t."""
        cp, sp_tp = self.lay.cp, self.lay.tp if self.lay.sp else 1
        multiple = (2 * cp if cp > 1 else 1) * sp_tp
        whole = torch.arange(-(-t // multiple) * multiple)[None]
        return [(c, zigzag_split(whole, cp, c)[0] if cp > 1 else whole[0]) for c in range(cp)]

    def _owners_drop(self, module, stage: int, x: torch.Tensor, stream: str) -> torch.Tensor:
        if not (module.training and module.dropout):
            return x
        lay, t = self.lay, x.shape[1]

        def draw(part: torch.Tensor, c: int, tp_rank: int, name: str) -> torch.Tensor:
            with self.streams[(self.dp_rank * lay.cp + c, tp_rank, stage)].fork(name):
                return F.dropout(part.contiguous(), module.dropout, training=True)

        parts = self._parts(t)
        padded = pad_sequence(x, len(parts[0][1]) * lay.cp, 1)
        out = torch.empty_like(padded)
        for c, where in parts:
            mine = padded[:, where]
            if stream != REPLICATED:  # a sharded activation: tp rank r's features
                out[:, where] = torch.cat([draw(f, c, r, stream) for r, f in
                                           enumerate(mine.chunk(lay.tp, -1))], -1)
            elif lay.sp:  # the block's output, split along the sequence: each tp rank's own
                for r, w in enumerate(where.chunk(lay.tp)):
                    out[:, w] = draw(padded[:, w], c, r, SHARDED)
            else:
                out[:, where] = draw(mine, c, 0, REPLICATED)
        return out[:, :t]

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        dp, total = self.lay.dp, torch.zeros(())
        for d in range(dp):
            self.dp_rank = d
            for xb, yb in zip(x[d::dp].chunk(self.lay.micro_batches),
                              y[d::dp].chunk(self.lay.micro_batches)):
                loss = F.cross_entropy(self.module(xb).reshape(-1, self.vocab_size),
                                       yb.reshape(-1), reduction="sum") / y.numel()
                loss.backward()
                total += loss.detach()
        return total


def owners_masks_losses(layout: TrainConfig) -> list[float]:
    return one_process(lambda cfg, dist: run_steps(OwnersMasks(cfg, dist, layout)),
                       one_process_config(layout))["losses"]


@pytest.mark.parametrize("name", SCALE_LAYOUTS)
def test_dropout_token_weighting_and_clipping_equal_one_process(results, name):
    """Every layout's loss per step equals one process drawing each mask from its owner's
    stream (dropout 0.2), the loss per real token, the whole model's norm clipped (0.3, below
    the gradients' norm: every step is clipped)."""
    losses = results[0][name]["losses"]
    assert all(r[name]["losses"] == losses for r in results), "ranks disagree on the loss"
    cfg = dataclasses.replace(AT_SCALE, **SCALE_LAYOUTS[name])
    assert rel(losses, owners_masks_losses(cfg)) < FP32_RTOL
    # the comparison can fail: one process drawing its own masks trains another model
    assert rel(losses, reference_losses(cfg)) > 10 * FP32_RTOL


# Experts (issue 49): MoE blocks, their experts split over ep of the dp ranks.
MOE = dataclasses.replace(SGD, steps=3, micro_batches=1, n_expert=4, top_k=2,
                          capacity_factor=1.0)
MOE_LAYOUTS = {"(2,1,1) ep=2, MoE top-2": dict(dp=2, ep=2),
               "(2,1,1) ep=2, MoE top-1 every 2nd block": dict(dp=2, ep=2, top_k=1,
                                                                capacity_factor=1.25, moe_every=2),
               "(4,1,1) ep=2, MoE top-2": dict(dp=4, ep=2)}


class ExpertsSideBySide(Run):
    """One process standing in for `layout`'s dp ranks: every expert here, each MoE routing
    the dp ranks' rows as separate groups (capacity and the auxiliary loss are per rank), the
    batch's rows put rank by rank (dp rank d holds rows d::dp)."""

    def __init__(self, cfg: TrainConfig, dist, layout: TrainConfig):
        super().__init__(cfg, dist)
        dp = layout.dp
        for m in self.model.modules():
            if isinstance(m, MoE):
                m.groups = dp
        self.data = ((torch.cat([x[d::dp] for d in range(dp)]),
                      torch.cat([y[d::dp] for d in range(dp)])) for x, y in self.data)


def experts_losses(layout: TrainConfig) -> list[float]:
    return one_process(lambda cfg, dist: run_steps(ExpertsSideBySide(cfg, dist, layout)),
                       dataclasses.replace(one_process_config(layout), ep=1))["losses"]


@pytest.fixture(scope="module")
def two_rank_results():
    """The two-rank runs, in one spawn: MoE layouts and long sequences."""
    cfgs = {n: dataclasses.replace(MOE, **kw) for n, kw in MOE_LAYOUTS.items() if kw["dp"] == 2}
    cfgs.update({name: dataclasses.replace(LONG, **kw) for name, kw in LONG_LAYOUTS.items()
                 if long_world(kw) == 2})
    return spawn(run_layouts, 2, cfgs, backend="scratch", timeout=300)


@pytest.mark.parametrize("name", MOE_LAYOUTS)
def test_moe_blocks_with_expert_parallelism_equal_one_process(results, two_rank_results, name):
    """Each rank holds half of the experts and sends tokens to the others by all_to_all; the
    loss per step equals one process holding every expert, routing each rank's rows apart."""
    per_rank = (two_rank_results if MOE_LAYOUTS[name]["dp"] == 2 else results)
    losses = per_rank[0][name]["losses"]
    assert all(r[name]["losses"] == losses for r in per_rank), "ranks disagree on the loss"
    assert rel(losses, experts_losses(dataclasses.replace(MOE, **MOE_LAYOUTS[name]))) < FP32_RTOL


@pytest.mark.parametrize("name", LONG_LAYOUTS)
def test_long_sequence_and_clipped_zero_layouts_equal_one_process(results, two_rank_results,
                                                                   name):
    """cp ranks each hold their zigzag part of every sequence (block 10: padded to 16 on
    cp = tp = 2 with SP) and their tokens' share of the loss; SP's norms are summed over tp;
    ZeRO-1 and ZeRO-3 clip the norm of the gradient their shards hold together. The loss per
    step equals one process's (clipping the whole gradient where clipped), fp32 within 1e-5."""
    kw = LONG_LAYOUTS[name]
    per_rank = two_rank_results if long_world(kw) == 2 else results
    losses = per_rank[0][name]["losses"]
    assert all(r[name]["losses"] == losses for r in per_rank), "ranks disagree on the loss"
    cfg = dataclasses.replace(LONG, **kw)
    assert rel(losses, one_process_losses(cfg)) < FP32_RTOL
    if cfg.clip_grad_norm is not None:  # the clipping bites: unclipped, another trajectory
        unclipped = one_process_losses(dataclasses.replace(cfg, clip_grad_norm=None))
        assert rel(losses, unclipped) > 10 * FP32_RTOL


def test_the_command_line_documents_cp_and_sp(capsys):
    from course_lib.train_loop import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert "--cp CP context-parallel ranks" in shown and "--sp sequence parallelism" in shown
    cfg, _ = parse_args(["--dp", "2", "--cp", "2", "--tp", "2", "--sp"])
    assert (cfg.dp, cfg.cp, cfg.tp, cfg.sp) == (2, 2, 2, True)
