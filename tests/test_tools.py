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
