"""A device for every tensor (issue 47): no component allocates a tensor without saying where.

On a GPU, a tensor made without `device=` lands on the CPU: NCCL refuses it ("No backend type
associated with device type cpu"), a CPU bucket behind CUDA parameters raises at the first
backward, a CPU flat buffer silently moves a CUDA model to the host. None of that shows on a
CPU-only CI, where every tensor is on the CPU anyway; this lint does. It parses every component
module (`course_lib/*.py`) and fails on a call to an allocating torch function without
`device=`, on `autocast("cpu"` / `init_device_mesh("cpu"` (a hard-coded device), and on a
`torch.Generator()` handed to a call as `generator=` (a CPU generator for the model's device),
unless the site is allow-listed here with its reason. The rule (gpu-audit.md, D1): *data*
tensors on their parameters' device, *control* tensors on `course_lib.backend.comm_device`.
`*_like` allocations inherit their argument's device and are fine.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "course_lib"

ALLOCATORS = {"zeros", "empty", "ones", "full", "tensor", "as_tensor", "arange", "rand", "randn",
              "randint", "randperm", "linspace", "logspace", "eye", "empty_strided"}

# Not components with tensors of a device: the scratch backend is a host backend by design (it
# refuses a non-CPU tensor at its boundary, course_lib.dist.collective_parts.check_host), and
# the course's machinery is not imported by a practitioner.
SKIP_DIRS = {"dist", "course", "cluster", "texts", "locale"}

# (module, enclosing function, torch function): why the CPU is right there, for good.
HOST = {
    ("checkpoint_format.py", "parse_shard", "empty"):
        "a zero-element tensor read back from a file: host bytes, copied into the target later",
    ("comm_model.py", "fit_model", "tensor"): "least squares over measured times: host numbers",
    ("comm_model.py", "fit_model", "ones"): "least squares over measured times: host numbers",
    ("data.py", "shard_indices", "randperm"):
        "the sampler's index order: host ints from a seeded CPU generator, device-independent",
    ("gpt.py", "encode", "tensor"): "the tokenizer's ids: host data, moved with the batch",
    ("clip.py", "_local", "tensor"): "the norm of no gradients at all: a host constant",
    ("tensor_parallel.py", "initial_slice", "empty"):
        "Megatron-style CPU initialisation on purpose: the shards equal the slices of one "
        "nn.Linear drawn with the same seed on any device; the layer is moved afterwards",
    ("training_state.py", "rng_state", "tensor"):
        "a generator's state: host numbers, saved as such",
}

# Findings of the audit in modules other engineers own, left for them (the note names
# each): listed so that this lint fails on any *new* site while these are being fixed.
PENDING = {
}

HARD_CODED = ('autocast("cpu"', "autocast('cpu'", 'init_device_mesh("cpu"',
              "init_device_mesh('cpu'")


def components() -> list[Path]:
    return sorted(p for p in ROOT.rglob("*.py")
                  if not SKIP_DIRS & set(p.relative_to(ROOT).parts[:-1]))


def _is_torch(node: ast.AST, names: set[str]) -> str | None:
    if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
            and node.value.id == "torch" and node.attr in names):
        return node.attr
    return None


def sites(path: Path, root: Path = ROOT) -> list[tuple[str, str, str, int]]:
    """(module, enclosing function, what, line) of each allocation without a device."""
    source = path.read_text(encoding="utf-8")
    name = str(path.relative_to(root))
    out = []

    def visit(node: ast.AST, where: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                else where
            if isinstance(child, ast.Call):
                kind = _is_torch(child.func, ALLOCATORS)
                if kind and not any(k.arg == "device" for k in child.keywords):
                    out.append((name, where, kind, child.lineno))
                for k in child.keywords:
                    if (k.arg == "generator" and isinstance(k.value, ast.Call)
                            and _is_torch(k.value.func, {"Generator"}) and not k.value.args
                            and not k.value.keywords):
                        out.append((name, where, "Generator", child.lineno))
                    # torch.Generator().manual_seed(...) passed as generator=
                    if (k.arg == "generator" and isinstance(k.value, ast.Call)
                            and isinstance(k.value.func, ast.Attribute)
                            and isinstance(k.value.func.value, ast.Call)
                            and _is_torch(k.value.func.value.func, {"Generator"})
                            and not k.value.func.value.args
                            and not k.value.func.value.keywords):
                        out.append((name, where, "Generator", child.lineno))
            visit(child, inner)

    visit(ast.parse(source), "<module>")
    for lineno, line in enumerate(source.splitlines(), 1):
        if any(h in line.replace(" ", "") for h in HARD_CODED):
            out.append((name, "<text>", "hard-coded cpu", lineno))
    return out


def test_every_component_allocation_names_its_device():
    found = [s for p in components() for s in sites(p)]
    bad = [f"course_lib/{m}:{line}: " + (f"torch.{what} in {fn}() without device="
                                          if fn != "<text>" else "a hard-coded 'cpu' device")
           for m, fn, what, line in found if (m, fn, what) not in HOST | PENDING.keys()]
    assert not bad, ("tensors allocated without a device (data: the parameters' device; "
                     "control: course_lib.backend.comm_device(dist, group)); or, if the CPU is "
                     "right for good, allow-list the site in HOST with its reason:\n"
                     + "\n".join(bad))


def test_the_lint_sees_what_it_should(tmp_path):
    """The lint itself: each kind of finding is caught, and a device= clears it."""
    probe = tmp_path / "probe.py"
    text = ("import torch\n"
            "def f(x, g):\n"
            "    a = torch.zeros(3)\n"
            "    b = torch.zeros(3, device=x.device)\n"
            "    c = torch.zeros_like(x)\n"
            "    with torch.autocast(\"cpu\", dtype=torch.bfloat16):\n"
            "        pass\n"
            "    g.generate(x, generator=torch.Generator().manual_seed(0))\n")
    probe.write_text(text)
    got = {(fn, what) for _, fn, what, _ in sites(probe, tmp_path)}
    assert got == {("f", "zeros"), ("<text>", "hard-coded cpu"), ("f", "Generator")}
