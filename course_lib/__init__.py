"""course_lib: the components of "Distributed Training from Scratch".

Client side: `course_lib.cluster` starts a local (or remote) cluster of ipyparallel engines.
Engine side: `course_lib.dist` is the from-scratch process group; the training components
(`data`, `ddp`, `tensor_parallel`, `pipeline`, `zero`, `checkpoint`, `train`, ...) take any
`dist`-like object, so they run on `torch.distributed` unchanged. The course that builds them
(its lessons' checks, the learner's own package, the build, grading and benchmarks) is
`course_lib.course`: importing a component never imports it.
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
