"""Course tooling: exercise generation, notebook execution and grading."""
