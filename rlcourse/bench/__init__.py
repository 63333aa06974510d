"""Benchmarks behind BENCHMARKS.md: ``python -m rlcourse.bench NAME [args]``.

Each benchmark is a module ``rlcourse/bench/<name>.py`` (dashes in NAME become underscores) with a
``main(argv) -> int`` that measures the project's code against a peer in the same run and prints
a short report. ``python -m rlcourse.bench`` lists them.
"""
