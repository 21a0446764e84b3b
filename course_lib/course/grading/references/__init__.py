"""The judge's side of each lesson's exercises: the functions that compute expected values
(`reference`) and explain wrong ones (`explain`), named by the declarations in
`course_lib/course/grading/exercises/lessonNN.py` as "lessonNN:function" (a package's
`__init__`, `references/lessonNN/`, gathers those names from its modules).

Only the process that judges imports this package. The processes that run a submission (its
kernel, its engines, whatever they start) get a package without it (`course-grade`'s
answer-free build), so no answer cell can read or compute what the judge expects.
"""
