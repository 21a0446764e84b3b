"""Lesson 07d's checks (schedules past 1F1B): the interleaved order against gold lists, the
backward split in B and W in zero-bubble steps on 2, 3 and 4 ranks, and NCCL's matching rule
for a pair of ranks. Expected values and explanations (the gold lists among them):
`course_lib/course/grading/references/lesson07/`.

Components are imported inside the functions that use them, on purpose (see `__init__`).
"""

from __future__ import annotations

from course_lib.course.grading import RANK, WORLD_SIZE, Exercise, case, register
from course_lib.course.grading.sub_worlds import harness, register_on_sub_worlds
from course_lib.i18n import N_

PART_D = "07d_pipeline_schedules_beyond"


# --- 07d: lesson07.interleaved_order -----------------------------------------------------------

def interleaved_harness(fn, n_microbatches: int, num_stages: int, stage_index: int) -> list:
    return [tuple(a) for a in fn(n_microbatches, num_stages, stage_index, 2)]


INTERLEAVED_CASES = [case(m, p, s, label=f"m={m}, p={p}, stage {s}") for m, p, s in (
    (4, 2, 0), (4, 2, 1), (3, 2, 0), (1, 2, 1), (6, 3, 0), (6, 3, 2), (4, 3, 1), (2, 3, 0),
    (8, 4, 0), (8, 4, 3), (6, 4, 1), (3, 4, 2))]

register(Exercise(
    name="lesson07.interleaved_order",
    notebook=PART_D,
    params=("n_microbatches", "num_stages", "stage_index", "chunks_per_stage"),
    cases=INTERLEAVED_CASES,
    reference="lesson07:interleaved_order",
    explain="lesson07:explain_interleaved",
    harness=interleaved_harness,
    points=3,
    hints=("On a stage, each micro-batch visits the stage's chunks forward in model order and "
           "backward in reverse. Micro-batches travel in groups large enough that, when a group "
           "comes back to this stage for its next chunk, its first micro-batch has crossed every "
           "other stage.",
           "Picture p = 2, m = 4, stage 0: two forwards of chunk 0, then two of chunk 2, then "
           "the backwards start with chunk 2. The warm-up covers the other chunks of the first "
           "group, plus what each later stage needs to start its own backward."),
))


# --- 07d: lesson07.backward_input and backward_weight, in zero-bubble steps on real ranks -------

def split_body(dist, rank: int, fn, which: str, name: str, m: int, seed: int) -> dict:
    from course_lib import pipeline_multi as ex
    from course_lib import pipeline_schedules as sch
    from course_lib.pipeline_actions import has_weights

    k = dist.get_world_size()
    s = sch.make(name, k, m)
    model = ex.build_model(seed, blocks=8)
    forwards = [0]
    for layer in model:
        layer.register_forward_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    b_fn = fn if which == "B" else sch.backward_input
    in_w = [0]

    def counted_w(segments):
        before = forwards[0]
        if which == "W":
            fn(segments)
        elif all(seg.grad_out for seg in segments if has_weights(seg)):
            sch.backward_weight(segments)  # else B kept nothing for W: it did W's work itself
        in_w[0] += forwards[0] - before

    x, y = ex.make_batch(seed, 2 * m)
    record, chunks = ex.run_step(rank, s, model, x, y, ex.programs_for(s)[rank], dist=dist,
                                 backward_input=b_fn, backward_weight=counted_w)
    return {"stage gradients": [q.grad for ch in chunks for q in ch.parameters()],
            "weight gradients inside B": record.weights_in_b,
            "layer forwards inside W": in_w[0]}


SPLIT_CASES = [
    case(RANK, WORLD_SIZE, 2, "zb-h1", 4, 0, label="2 stages, ZB-H1, 4 micro-batches"),
    case(RANK, WORLD_SIZE, 3, "zb-h1", 2, 1, label="3 stages, ZB-H1, 2 < 3 micro-batches"),
    case(RANK, WORLD_SIZE, 4, "zbv", 5, 2, label="4 stages, ZBV, 5 micro-batches"),
]

for _which, _name, _params, _hints in (
        ("B", "backward_input", ("segments", "grad_output"),
         (N_("B owes the previous stage one thing, the gradient of the chunk's input, and owes "
             "it now. Each layer's weight gradient can wait for W, but W needs that layer's "
             "output gradient and its graph, so B keeps both."),
          N_("Walk the layers from the last: each one turns its output's gradient into its "
             "input's gradient; where a layer has weights, keep the output gradient and keep its "
             "graph alive."))),
        ("W", "backward_weight", ("segments",),
         (N_("W owes nothing to another stage: it turns each kept output gradient into that "
             "layer's weight gradients, accumulated as a whole backward would."),
          N_("Only the layers with weights have work left; each asks autograd for its own "
             "parameters' gradients alone, from the output gradient B kept, and runs no forward "
             "again.")))):
    register_on_sub_worlds(
        f"lesson07.{_name}", PART_D,
        params=_params,
        cases=SPLIT_CASES,
        reference="lesson07:split_step",
        explain="lesson07:explain_split",
        harness=harness(split_body, _which),
        points=3,
        time_limit=5.0,
        rtol=1e-10,
        atol=1e-10,
        hints=_hints,
    )


# --- 07d: lesson07.first_conflict, NCCL's rule for one pair of ranks --------------------------

def pair_of(scenario: str) -> tuple[list, list]:
    """The operations of two ranks with each other, in issue order, for a named scenario."""
    from course_lib import pipeline_actions as acts
    from course_lib import pipeline_comms as comms
    from course_lib import pipeline_check as chk

    def pair(programs, a=0, b=1):
        return comms.pair_sequence(programs, a, b), comms.pair_sequence(programs, b, a)

    if scenario == "prefetch-1f1b":
        return pair(comms.lesson07_programs(acts.one_f_one_b(2, 3), ("act", "grad")))
    if scenario == "07c-fixed":
        return pair(comms.lesson07_programs(acts.one_f_one_b(3, 5)))
    if scenario == "plain-1f1b":
        return pair(comms.plain_programs(acts.one_f_one_b(2, 2)))
    if scenario == "07c-gpipe":
        return pair(comms.lesson07_programs(acts.gpipe(3, 4)), 1, 2)
    if scenario == "ordered-zb-h1":
        s = acts.zb_h1(3, 4)
        return pair(comms.add_comms(s, chk.simulate(s)), 1, 2)
    if scenario == "swapped":
        mine, theirs = pair(comms.plain_programs(acts.gpipe(2, 3)))
        return [mine[1], mine[0]] + mine[2:], theirs
    if scenario == "missing":
        mine, theirs = pair(comms.lesson07_programs(acts.gpipe(3, 4)), 1, 2)
        return mine, theirs[:-1]
    return pair(comms.plain_programs(acts.zbv(2, 3)))  # "zbv-plain"


def conflict_harness(fn, scenario: str):
    mine, theirs = pair_of(scenario)
    return fn(mine, theirs)


CONFLICT_CASES = [
    case("prefetch-1f1b", label="1F1B, both receives prefetched, p=2, m=3"),
    case("plain-1f1b", label="1F1B, receive just before use, p=2, m=2"),
    case("07c-gpipe", label="lesson 07c's GPipe, p=3, m=4, stages 1 and 2"),
    case("07c-fixed", label="lesson 07c's 1F1B, p=3, m=5, stages 0 and 1"),
    case("ordered-zb-h1", label="ZB-H1 in the global order, p=3, m=4, stages 1 and 2"),
    case("swapped", label="GPipe, p=2, m=3, stage 0's first two sends swapped"),
    case("missing", label="GPipe, p=3, m=4, stage 2's last receive missing"),
    case("zbv-plain", label="ZBV, p=2, m=3, receive just before use"),
]

register(Exercise(
    name="lesson07.first_conflict",
    notebook=PART_D,
    params=("mine", "theirs"),
    cases=CONFLICT_CASES,
    reference="lesson07:first_conflict",
    explain="lesson07:explain_conflict",
    harness=conflict_harness,
    points=2,
    hints=("NCCL matches a pair's operations by position: the k-th on one side meets the k-th on "
           "the other, and it must be the other end of the same message.",
           "Walk both lists together; the first position where both send, both receive, the "
           "messages differ, or one list has ended is the conflict."),
))
