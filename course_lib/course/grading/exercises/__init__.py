"""One module per lesson (`lessonNN.py`), each calling `register(Exercise(...))`.

Every module here is imported when an exercise is first looked up; see CONTRIBUTING.md,
"Exercises and grading".
"""
