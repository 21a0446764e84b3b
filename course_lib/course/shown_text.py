"""What a learner reads from a cell's or a module's code: the string literals it prints, plots
(titles, axis labels, legends, tick labels) or raises, and an exercise stub's docstring. The
lessons' catalogues translate them in notebooks (`course_lib.course.translate`); the package's
go through `_()` (tests/test_untranslated.py finds both kinds of gap)."""

from __future__ import annotations

import ast

__all__ = ["LABELS", "LABEL_KEYWORDS", "TRANSLATORS", "code_of", "shown_literals"]

# What a learner reads from code: the arguments of print, a plot's labels, an error's message.
LABELS = {"set_title", "set_xlabel", "set_ylabel", "suptitle", "title", "xlabel", "ylabel",
          "set_label", "text", "annotate", "legend", "set_xticklabels", "set_yticklabels"}
LABEL_KEYWORDS = {"label", "labels", "title", "xlabel", "ylabel", "suptitle"}
TRANSLATORS = {"_", "N_", "ngettext"}  # the package's own messages: its catalogues hold them


def code_of(source: str) -> str:
    """A cell's source as Python: IPython magics and shell lines blanked (lines kept)."""
    return "\n".join("" if line.lstrip().startswith(("%", "!")) else line
                     for line in source.split("\n"))


def shown_literals(source: str, docstrings: bool = False,
                   returned: bool = False) -> list[tuple[ast.expr, str]]:
    """(string literal, kind) of every text a learner reads when `source` runs: what it prints
    ("printed"), a plot's title, axis labels and legends ("label"), an error's message
    ("error"); with `docstrings`, each function's and class's docstring ("docstring"); with
    `returned`, what a function returns (a lesson's demo returns the line its cell prints).
    A literal passed to `_()`, `N_()` or `ngettext()` is the package catalogues'."""
    try:
        tree = ast.parse(code_of(source))
    except SyntaxError:
        return []
    found: list[tuple[ast.expr, str]] = []

    def add(node: ast.expr, kind: str) -> None:
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):  # "a " + f"b"
            add(node.left, kind)
            add(node.right, kind)
        elif isinstance(node, ast.IfExp):  # "a" if c else "b"
            add(node.body, kind)
            add(node.orelse, kind)
        elif isinstance(node, (ast.List, ast.Tuple)):  # labels=["a", "b"]
            for element in node.elts:
                add(element, kind)
        elif isinstance(node, (ast.ListComp, ast.GeneratorExp)):  # [f"step {s}" for s in ...]
            add(node.elt, kind)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in ("join", "format") and node.args):  # ", ".join(...)
            add(node.func.value, kind)
            for arg in node.args:
                add(arg, kind)
        elif isinstance(node, ast.JoinedStr) or (isinstance(node, ast.Constant)
                                                 and isinstance(node.value, str)):
            found.append((node, kind))

    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else \
                getattr(node.func, "id", "")
            if name in TRANSLATORS:
                continue
            if name == "print":
                for arg in node.args:
                    add(arg, "printed")
            elif name in LABELS and node.args:
                add(node.args[2] if name == "text" and len(node.args) >= 3  # text(x, y, s)
                    else node.args[0], "label")
            for kw in node.keywords:
                if kw.arg in LABEL_KEYWORDS and name != "print":
                    add(kw.value, "label")
        elif isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and node.exc.args:
            add(node.exc.args[0], "error")
        elif returned and isinstance(node, ast.Return) and node.value is not None:
            add(node.value, "returned")
        elif docstrings and isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr):
                add(first.value, "docstring")
    return found
