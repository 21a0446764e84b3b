"""Side-by-side benchmarks: `python -m course_lib.course.bench NAME ... --json FILE [--plot FILE]`.

Each benchmark is one module here exposing `add_arguments(parser)`, `run(args) -> list[dict]`
(one row per measurement) and optionally `plot(rows, path)`.
"""
