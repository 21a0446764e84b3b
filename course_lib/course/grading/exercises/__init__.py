"""One module per lesson (`lessonNN.py`), each calling `register(Exercise(...))`; a long lesson's
is a package instead (`lessonNN/`, a module per part, imported by its `__init__`).

Every module here is imported when an exercise is first looked up; see CONTRIBUTING.md,
"Exercises and grading".
"""
