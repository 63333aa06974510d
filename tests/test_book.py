"""The web book (``make book``: rlcourse.tools.book.build and rlcourse.tools.book.check).

The course's own site is built once (about 20 s) and must pass every check with no warning from
the build. The checks themselves are tested on a two-lesson course made here: each defect put into
its built site (a page, an image, a figure, an anchor, the search index, the page order, maths,
a traceback) is reported, and a warning from the build fails it.
"""
import base64
import json
import re
import shutil

import pytest
from bs4 import BeautifulSoup

import rlcourse  # noqa: F401  (before torch, as everywhere)
from rlcourse.tools.book import browser as book_browser
from rlcourse.tools.book import build as book
from rlcourse.tools.book import check as book_check
from rlcourse.tools.make_exercises import lesson_notebooks

PNG = base64.b64encode(bytes.fromhex(
    "89504e470d0a1a0a0000000d4948445200000001000000010806000000"
    "1f15c4890000000d4944415478da63f8ffff3f0005fe02fea7d6a4c20000000049454e44ae426082")).decode()


@pytest.fixture(scope="module")
def course_site(tmp_path_factory):
    return book.build(tmp_path_factory.mktemp("book"))


def test_the_course_builds_without_a_warning_into_a_sound_site(course_site):
    assert book_check.check_site(course_site) == []


def test_every_lesson_and_exercise_notebook_is_a_page_in_course_order(course_site):
    pages = book.site_pages()
    root = book.ROOT
    assert pages[0] == "index" and pages[1] == "course/00_start_here"
    assert [p for p in pages if p.startswith("course/")] == \
        [f"course/{p.stem}" for p in lesson_notebooks(root / "course")]
    assert [p for p in pages if p.startswith("exercises/")] == \
        [f"exercises/{p.stem}" for p in lesson_notebooks(root / "exercises")]
    index = (course_site / "index.html").read_text()
    # the README's links to lessons (course/NN_x.ipynb) lead to the lessons' pages
    links = re.findall(r'href="([^"#]*)', index)
    assert "course/10_grpo.html" in links and not [u for u in links if u.endswith(".ipynb")]


def test_a_widget_page_says_its_knobs_turn_in_jupyterlab(course_site):
    page = (course_site / "course" / "01_gridworld_mdp.html").read_text()
    assert "you turn its knobs (γ from 0 to 0.99; slip from 0 to 0.6)" in page
    assert "widget-view" not in page and "Loading widget" not in page


# ----------------------------------------------------------------------------- a course made here

def _notebook(cells, widgets=None):
    nb = {"cells": cells, "nbformat": 4, "nbformat_minor": 5,
          "metadata": {"language_info": {"name": "python"},
                       "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}}}
    if widgets:
        nb["metadata"]["widgets"] = {book.WIDGET_STATE: {"state": widgets, "version_major": 2,
                                                         "version_minor": 0}}
    return nb


def _markdown(text):
    return {"cell_type": "markdown", "id": f"m{abs(hash(text))}", "metadata": {}, "source": text}


def _code(source, outputs=()):
    return {"cell_type": "code", "id": f"c{abs(hash(source))}", "metadata": {}, "source": source,
            "execution_count": 1, "outputs": list(outputs)}


def _widget(model_id):
    return {"output_type": "display_data", "metadata": {},
            "data": {book.WIDGET_VIEW: {"model_id": model_id, "version_major": 2, "version_minor": 0},
                     "text/plain": "HBox(...)"}}


def _model(name, **state):
    return {"model_name": name, "model_module": "@jupyter-widgets/controls", "state": state}


TQDM = {"bar": _model("HBoxModel", children=["IPY_MODEL_a", "IPY_MODEL_b", "IPY_MODEL_c"]),
        "a": _model("HTMLModel", value="train:\u2007100%"),
        "b": _model("FloatProgressModel", value=40.0, max=40.0),
        "c": _model("HTMLModel", value="\u200740/40\u2007[00:02&lt;00:00,\u2007reward=0.5]"),
        "knobs": _model("VBoxModel", children=["IPY_MODEL_s", "IPY_MODEL_l", "IPY_MODEL_o"]),
        "s": _model("FloatSliderModel", description="β", min=0.0, max=2.0, value=1.0),
        "l": _model("FloatLogSliderModel", description="lr", min=-5, max=-2, base=10, value=1e-3),
        "o": _model("OutputModel", outputs=[])}


def _small_course(root):
    (root / "README.md").write_text(
        "# A small course\n\n```bash\nmake lab\nmake test\n```\n\n"
        "Start with [lesson 01](course/01_one.ipynb), see [the numbers](BENCHMARKS.md#speed).\n")
    (root / "CONTRIBUTING.md").write_text("# Contributing\n\nRead [the README](README.md).\n")
    (root / "BENCHMARKS.md").write_text("# Benchmarks\n\n## Speed\n\nFast.\n")
    lesson = _notebook([
        _markdown("# 01 · One\n\nThe return $G_t = \\sum_k \\gamma^k r_{t+k}$ and\n\n"
                  "$$\\nabla J(\\theta) = \\mathbb E[\\hat A_t \\nabla \\log \\pi_\\theta(a_t \\mid s_t)]$$\n\n"
                  "Next: [lesson 02](02_two.ipynb)."),
        _code("plot()", [{"output_type": "display_data", "metadata": {},
                          "data": {"image/png": PNG, "text/plain": "<Figure>"}}]),
        _code("train()", [_widget("bar"), _widget("knobs")]),
    ], widgets=TQDM)
    two = _notebook([_markdown("# 02 · Two\n\nBack to [lesson 01](01_one.ipynb)."), _code("1 + 1")])
    exercise = _notebook([_markdown("# 01 · Exercises\n\nWrite $\\pi(a \\mid s)$."),
                          _code("def f():\n    raise NotImplementedError")])
    for rel, nb in (("course/01_one.ipynb", lesson), ("course/02_two.ipynb", two),
                    ("exercises/01_one.ipynb", exercise)):
        (root / rel).parent.mkdir(exist_ok=True)
        (root / rel).write_text(json.dumps(nb))
    return root


@pytest.fixture(scope="module")
def small_site(tmp_path_factory):
    root = _small_course(tmp_path_factory.mktemp("course"))
    return root, book.build(tmp_path_factory.mktemp("site"), root)


def test_a_small_course_builds_into_a_sound_site(small_site):
    root, html = small_site
    assert book.site_pages(root) == ["index", "course/01_one", "course/02_two", "exercises/01_one",
                                     "CONTRIBUTING", "BENCHMARKS"]
    assert book_check.check_site(html, root) == []
    lesson = BeautifulSoup((html / "course" / "01_one.html").read_text(), "html.parser").get_text()
    assert "train: 100%|████████████████████|40/40 [00:02<00:00, reward=0.5]" in lesson
    assert "in JupyterLab (make lab) you turn its knobs (β from 0 to 2; lr from 10^-5 to 10^-2)" in lesson
    assert "course/01_one.ipynb in the repository" in lesson


def _damaged(small_site, tmp_path, damage):
    """The small course's site, copied and damaged by ``damage(html_dir)``; its problems."""
    root, html = small_site
    copy = tmp_path / "html"
    shutil.copytree(html, copy)
    damage(copy)
    return "\n".join(book_check.check_site(copy, root))


def _edit(path, old, new):
    text = path.read_text()
    assert old in text, f"{old!r} not in {path.name}"
    path.write_text(text.replace(old, new, 1))


def _skip_lesson_one(html):
    index = html / "index.html"
    text, n = re.subn(r'(class="right-next"\s+href=")course/01_one', r"\1course/02_two", index.read_text())
    assert n == 1
    index.write_text(text)


@pytest.mark.parametrize("damage, problem", [
    (lambda h: (h / "course" / "02_two.html").unlink(), "missing page course/02_two.html"),
    (lambda h: shutil.rmtree(h / "_images"), "points at nothing"),
    (lambda h: _edit(h / "BENCHMARKS.html", 'id="speed"', 'id="pace"'), "names an anchor its page does not have"),
    (lambda h: _edit(h / "searchindex.js", '"course/02_two"', '"course/02_too"'), "search does not index course/02_two"),
    (_skip_lesson_one, "previous/next walks"),
    (lambda h: _edit(h / "course" / "01_one.html", "<img", "<span"), "shows 0 figures; its notebook has 1"),
    (lambda h: _edit(h / "course" / "01_one.html", "<p>Next:", "<p>costs $3 and $4. Next:"), "raw $...$ maths"),
    (lambda h: _edit(h / "course" / "01_one.html", "<p>Next:", "<p>\\frac{1}{2} Next:"), "a LaTeX macro outside maths"),
    (lambda h: _edit(h / "course" / "01_one.html", "\\gamma^k", "\\gammma^k"), "macros MathJax does not know: ['gammma']"),
    (lambda h: _edit(h / "course" / "02_two.html", "<p>Back", "<p>Traceback (most recent call last): Back"),
     "shows a Python traceback"),
], ids=["page", "image", "anchor", "search", "order", "figure", "dollars", "macro", "unknown-macro", "traceback"])
def test_each_defect_of_a_site_is_reported(small_site, tmp_path, damage, problem):
    assert problem in _damaged(small_site, tmp_path, damage)


def test_a_warning_fails_the_build(tmp_path):
    (tmp_path / "course").mkdir()
    root = _small_course(tmp_path / "course")
    _edit(root / "course" / "02_two.ipynb", "01_one.ipynb", "01_none.ipynb")  # a link to no page
    with pytest.raises(RuntimeError, match="01_none"):
        book.build(tmp_path / "site", root)


def test_the_repository_link_comes_from_the_environment_or_origin(monkeypatch, tmp_path):
    monkeypatch.setenv("RLCOURSE_REPO_URL", "git@github.com:someone/rlcourse.git")
    assert book.repo_url(tmp_path) == "https://github.com/someone/rlcourse"
    monkeypatch.delenv("RLCOURSE_REPO_URL")
    assert book.repo_url(tmp_path) is None  # not a git repository: no link, the download stays
    banner = book._banner(book.Path("course/01_one.ipynb"), "https://example.org/r")["source"]
    assert "(https://example.org/r/blob/main/course/01_one.ipynb)" in banner and "download it" in banner


# ----------------------------------------------------------------------------- in a browser

def _browse(html, **kwargs):
    if book_browser.chromium_path() is None:
        pytest.skip(book_browser.INSTALL_HINT + " (`make test` installs it where apt-get may run)")
    return book_browser.browse(html, **kwargs)


def test_the_book_reads_well_in_a_browser_at_a_laptop_and_a_phone(course_site):
    report = _browse(course_site)
    assert report.problems == []
    assert report.pages >= len(book.site_pages()) and report.images > 50 and report.links > 500
    assert report.display_formulas > 100 and report.inline_formulas > 1000
    assert report.widest_page == {1280: 1280, 390: 390}
    assert report.smallest_tick_px >= book_browser.MIN_TICK_PX


def _wide_figure(html):
    _edit(html / "course" / "01_one.html", "<img ", '<img style="width: 0.4px" ')


BROWSER_DAMAGE = {  # what is put into which page, and what the browser check must say of it
    "wide": ("course/02_two.html", "<p>Back", '<p><span style="display:inline-block;width:900px">x</span>Back',
             "course/02_two.html at 390 px: the page is"),
    "maths": ("course/01_one.html", "\\gamma^k", "\\gamma^k}}", "course/01_one.html at 1280 px: 1 formula(s) MathJax"),
    "image": ("exercises/01_one.html", "<p>Write", '<p><img src="gone.png">Write', "the image 'gone.png' does not load"),
    "console": ("CONTRIBUTING.html", "</body>", '<script>console.error("boom")</script></body>', "console error: boom"),
    "note": ("BENCHMARKS.html", "<p>Fast.", '<div class="cell_output"><p>A widget: below is the picture of its default '
             'setting.</p></div><p>Fast.', "BENCHMARKS.html at 1280 px: a widget's note promises its picture"),
    "code": ("CONTRIBUTING.html", "<p>Read", '<pre style="white-space: pre; overflow-x: auto">' + "x = 1; " * 80
             + "</pre><p>Read", "CONTRIBUTING.html at 1280 px: code or output cut"),
    "link": ("index.html", "<p>Start", '<p><a href="course/03_three.html">three</a> Start',
             "index.html: a link to 'course/03_three.html' points at nothing"),
}


def test_each_defect_a_reader_sees_is_reported_by_the_browser(small_site, tmp_path):
    root, html = small_site
    assert _browse(html, searches={"One": "course/01_one.html"}).problems == []
    copy = tmp_path / "html"
    shutil.copytree(html, copy)
    for page, old, new, _ in BROWSER_DAMAGE.values():
        _edit(copy / page, old, new)
    _wide_figure(copy)
    problems = "\n".join(_browse(copy, searches={"Two": "course/01_one.html"}).problems)
    for name, (*_, said) in BROWSER_DAMAGE.items():
        assert said in problems, name
    assert "course/01_one.html at 1280 px: the figure" in problems and "draw it narrower" in problems
    assert "search for 'Two' ranks course/02_two.html first, not course/01_one.html" in problems
    assert "at 390 px: the figure" not in problems  # legibility is judged at desktop widths
