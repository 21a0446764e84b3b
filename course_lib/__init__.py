"""course_lib: the components of "Distributed Training from Scratch".

Client side: `course_lib.cluster` starts a local (or remote) cluster of ipyparallel engines.
Engine side: `course_lib.dist` is the from-scratch process group; the training components
(`data`, `ddp`, `tensor_parallel`, `pipeline`) take any `dist`-like object, so they run on
`torch.distributed` unchanged.
"""

__version__ = "0.1.0"
__all__ = ["__version__", "use"]

# Each component resolves to the learner's version (their overlay) or the reference.
from course_lib.overlay import install as _install_overlay, use  # noqa: E402

_install_overlay()
