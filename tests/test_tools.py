import nbformat
import pytest

from rlcourse.tools.make_exercises import make_exercise, stub_source
from rlcourse.tools.nbbuild import notebook_to_py, py_to_notebook


def test_stub_replaces_the_region_and_keeps_indentation():
    source = ("def f(x):\n"
              "    \"\"\"doc\"\"\"\n"
              "    ### BEGIN SOLUTION\n"
              "    y = x + 1\n"
              "    return y\n"
              "    ### END SOLUTION\n"
              "\n"
              "print('after')")
    out = stub_source(source, "nb")
    assert "y = x + 1" not in out and "print('after')" in out
    assert "    # YOUR CODE HERE\n    raise NotImplementedError(\"Exercise: write `f` here" in out
    compile(out, "stub", "exec")


@pytest.mark.parametrize("source, message", [
    ("### BEGIN SOLUTION\nx = 1", "without"),
    ("x = 1\n### END SOLUTION", "without"),
    ("### BEGIN SOLUTION\n### BEGIN SOLUTION\n### END SOLUTION", "nested"),
])
def test_unbalanced_markers_are_errors(source, message):
    with pytest.raises(ValueError, match=message):
        stub_source(source, "nb")


def test_make_exercise_strips_outputs_and_requires_a_region():
    cell = nbformat.v4.new_code_cell("def g():\n    ### BEGIN SOLUTION\n    return 1\n    ### END SOLUTION")
    cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text="hi")]
    cell.execution_count = 3
    nb = nbformat.v4.new_notebook(cells=[cell])
    ex = make_exercise(nb, "nb")
    assert ex.cells[0].outputs == [] and ex.cells[0].execution_count is None
    assert nb.cells[0].outputs, "the solution notebook itself is left alone"
    with pytest.raises(ValueError, match="nothing for the learner"):
        make_exercise(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x = 1")]), "nb")


def test_percent_format_round_trip():
    text = "# %% [markdown]\n# # Title\n#\n# Some *prose*.\n\n# %%\nx = 1\nprint(x)\n"
    nb = py_to_notebook(text)
    assert [c.cell_type for c in nb.cells] == ["markdown", "code"]
    assert nb.cells[0].source == "# Title\n\nSome *prose*."
    assert notebook_to_py(nb) == text


def test_make_exercise_records_the_check_cells_and_the_manifests_are_current():
    from rlcourse.tools import checkcells
    from rlcourse.tools.make_exercises import ROOT, expected_exercises

    cells = [nbformat.v4.new_code_cell("def g():\n    ### BEGIN SOLUTION\n    return 1\n    ### END SOLUTION"),
             nbformat.v4.new_code_cell("check_g(g, n=3)")]
    ex = make_exercise(nbformat.v4.new_notebook(cells=cells), "nb")
    (entry,) = ex.metadata.rlcourse.checks
    assert entry["check"] == "check_g" and entry["args"] == ["g"] and entry["kwargs"] == {"n": "3"}
    assert entry["sha256"] == checkcells.checksum("check_g(g, n=3)")
    manifests = {p: t for p, t in expected_exercises().items() if p.suffix == ".json"}
    assert manifests and all(p.exists() and p.read_text() == t for p, t in manifests.items()), \
        "rlcourse/grading/manifests is stale: run python -m rlcourse.tools.make_exercises"
    assert ROOT.joinpath("rlcourse/grading/manifests").is_dir()


def test_a_check_cell_must_be_one_call_on_the_learners_function():
    from rlcourse.tools.checkcells import parse_check_call

    assert parse_check_call("x = 1") is None
    with pytest.raises(ValueError, match="one call"):
        parse_check_call("check_g(g)\nprint('done')")
    with pytest.raises(ValueError, match="by name"):
        parse_check_call("check_g(lambda x: x)")


def test_every_frame_of_the_grading_core_and_lessons_01_07b_hides_itself():
    """IPython and pytest leave out frames that set __tracebackhide__: the learner sees no grader code."""
    import ast
    from pathlib import Path

    import rlcourse.grading as grading

    folder = Path(grading.__file__).parent
    missing = []
    lessons = [folder / "classic" / f"lesson0{i}.py" for i in "123456"] + [folder / "llm" / f"lesson07{b}.py" for b in ("", "b")]
    for path in [folder / "_core.py"] + lessons:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_show"):
                hides = any(isinstance(s, ast.Assign) and ast.unparse(s.targets[0]) == "__tracebackhide__"
                            for s in node.body[:3])
                if not hides and ("check_" in node.name or _can_raise(node)):
                    missing.append(f"{path.name}:{node.name}")
    assert not missing, missing


def _can_raise(node) -> bool:
    import ast

    return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ("fail", "assert_close",
               "call_unmutated", "gradient_flowing", "fail_if_mistake") or isinstance(n, ast.Raise)
               for n in ast.walk(node))
