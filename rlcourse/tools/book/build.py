"""Building the course as a static website (``make book`` runs ``python -m rlcourse.tools.book``).

Built from the committed, executed notebooks without running them, and without the network:
Sphinx with MyST-NB and the Sphinx Book Theme; MathJax 3 comes from the ``django-static-mathjax``
wheel (MathJax's own files, no Django needed) and is copied next to the pages, so the maths also
renders where there is no network. Three steps:

1. :func:`stage`: the README becomes the landing page (with CONTRIBUTING.md and BENCHMARKS.md, which
   it links to), then every lesson of ``course/`` and every notebook of ``exercises/`` in course
   order. Each notebook gets a note under its title (where it lives, a download of it, how to run it)
   and its widgets become what they showed when the notebook ran: a static page has no kernel.
2. :func:`build`: ``sphinx-build`` into ``_build/html``; any warning fails the build.
3. :func:`rlcourse.tools.book.check.check_site`: every page exists, in course order along
   previous/next; every link, anchor and image resolves; every figure of a notebook is on its page;
   search indexes every page; no page shows raw ``$...$`` maths, a LaTeX macro outside maths, a
   macro MathJax does not know, or a Python traceback.

``_build/html`` is plain files: publish it on any static host. Set ``RLCOURSE_REPO_URL`` (e.g.
``https://github.com/<owner>/rlcourse``; by default the ``origin`` remote, when it is one) to link
every page to its notebook in the repository too, on branch ``RLCOURSE_REPO_BRANCH`` (``main``).
"""
from __future__ import annotations

import copy
import html
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from rlcourse.tools.make_exercises import lesson_notebooks

ROOT = Path(__file__).resolve().parents[3]
EXTRA_PAGES = ("CONTRIBUTING.md", "BENCHMARKS.md")  # the README links to them
ORIGINALS = "_notebooks"  # the committed notebooks, offered as downloads (not pages)

# The whole configuration of the site; the generated conf.py only imports it.
SPHINX_CONFIG = {
    "project": "rlcourse",
    "author": "the rlcourse authors",
    "copyright": "the rlcourse authors",
    "extensions": ["myst_nb", "sphinx.ext.mathjax"],
    "root_doc": "index",
    "exclude_patterns": ["_build", ORIGINALS],
    "nb_execution_mode": "off",  # the committed outputs are the page; nothing is re-run
    "nb_merge_streams": True,
    "nb_render_markdown_format": "myst",  # maths in a cell's Markdown output renders too
    "myst_enable_extensions": ["dollarmath", "amsmath", "colon_fence"],
    "myst_heading_anchors": 3,  # the README's links to BENCHMARKS.md#section resolve
    "html_theme": "sphinx_book_theme",
    "html_title": "rlcourse",
    "html_static_path": ["_static"],
    "html_copy_source": False,
    "html_show_sourcelink": False,
    "html_last_updated_fmt": None,
    "html_theme_options": {
        "home_page_in_toc": True,
        "show_toc_level": 2,
        "navigation_with_keys": True,
        "use_download_button": False,  # each notebook page links the committed notebook instead
        "navbar_persistent": [],  # one search box, in the sidebar (not a second one in a top bar)
    },
    "html_context": {"default_mode": "auto"},  # light or dark as the reader's system is (unset: a console error)
    "mathjax_path": "mathjax/tex-mml-chtml.js",  # copied by stage(): no CDN
    # \text{std\_floor} shows "std_floor", as in JupyterLab, not "std\_floor"
    "mathjax3_config": {"loader": {"load": ["[tex]/textmacros"]},
                        "tex": {"packages": {"[+]": ["textmacros"]}}},
    "html_js_files": ["fit_equations.js", "readable.js"],
    "html_css_files": ["wide_column.css", "readable.css"],
    "html_favicon": "favicon.svg",  # without one, every browser's request for /favicon.ico fails
}
# Between 1200 and 1500 px the theme's two sidebars leave the lesson a column narrower than at
# 800 px; there the page's contents fold into the button at the top right, as they do below 1200.
WIDE_COLUMN_CSS = """@media (min-width: 1200px) and (max-width: 1499.98px) {
  div.bd-sidebar-secondary { display: none; }
  button.sidebar-toggle.secondary-toggle { display: flex; }
  .bd-main .bd-content .bd-article-container { max-width: 60em; }
  dialog.bd-sidebar-secondary[open] { border: 0; height: 100dvh; margin: 0; position: fixed; left: auto; right: 0; top: 0;
    max-height: 100dvh; max-width: 350px; padding: 2rem 1rem; width: 75%; }
}
"""
# MathJax 3 cannot break a line. A display equation wider than the page's column (at 1280 px the
# column is narrower than at 800, between the two sidebars; on a phone it is 350 px) is scaled down
# to fit, to 60% at most (50% on a phone), then scrolls inside its own box (readable.css) rather than
# being cut at the column's edge. An inline formula wider than its line is scaled to 70% at most,
# then scrolls inside its own box too: the page itself never pans sideways.
FIT_EQUATIONS_JS = """window.addEventListener("load", function () {
  function room(eq) {  // the width of the block the formula sits in
    return eq.parentElement.closest("div, p, li, td, th, dd, h1, h2, h3, h4").clientWidth;
  }
  function shrink(eq, floor) {
    eq.dataset.size = eq.dataset.size || parseFloat(eq.style.fontSize) || 100;
    eq.style.fontSize = eq.dataset.size + "%";
    var width = eq.scrollWidth;
    if (width > room(eq)) eq.style.fontSize = eq.dataset.size * Math.max(floor, 0.98 * room(eq) / width) + "%";
  }
  function fit() {
    var phone = window.innerWidth < 600;
    document.querySelectorAll("mjx-container[display='true']").forEach(function (eq) {
      shrink(eq, phone ? 0.5 : 0.6);
    });
    document.querySelectorAll("mjx-container:not([display='true'])").forEach(function (eq) {
      eq.classList.remove("too-wide");
      shrink(eq, 0.7);
      if (eq.scrollWidth > room(eq)) eq.classList.add("too-wide");
    });
  }
  if (window.MathJax && MathJax.startup) MathJax.startup.promise.then(fit);
  window.addEventListener("resize", fit);
});
"""
# What keeps a page readable at any width, and search's excerpts free of the theme's buttons.
READABLE_CSS = """/* A long name in inline code wraps rather than pushing a phone's page sideways. */
code.literal, code.literal span.pre { white-space: pre-wrap; overflow-wrap: anywhere; }
/* Code and printed output wrap at the column's edge: the end of an assert or of a printed claim
   is never hidden behind a scroll bar. */
article pre { white-space: pre-wrap; overflow-wrap: anywhere; }
/* A table wider than a phone scrolls inside its own box. */
article table:not(.highlighttable) { display: block; max-width: 100%; overflow-x: auto; }
/* An equation too wide even when scaled down scrolls inside its own box, not the page. */
mjx-container[display="true"] { display: block; max-width: 100%; overflow-x: auto; overflow-y: hidden; }
mjx-container.too-wide { display: inline-block; max-width: 100%; overflow-x: auto; overflow-y: hidden;
  vertical-align: middle; }
/* A figure opens at its full size in a new tab (a small one is a column-wide multi-panel figure). */
div.cell_output a.full-size img { cursor: zoom-in; }
"""
READABLE_JS = """document.addEventListener("DOMContentLoaded", function () {
  // Each figure of a notebook links to its own file: a click shows it at the size it was drawn.
  document.querySelectorAll("div.cell_output img").forEach(function (img) {
    if (img.closest("a")) return;
    var link = document.createElement("a");
    link.href = img.getAttribute("src");
    link.target = "_blank";
    link.className = "full-size";
    link.title = "open the figure at full size";
    img.parentNode.insertBefore(link, img);
    link.appendChild(img);
  });
  // Search's excerpts: the page's text without the theme's buttons and navigation.
  if (typeof Search !== "undefined" && Search.htmlToText) {
    var toText = Search.htmlToText;
    Search.htmlToText = function (htmlString, anchor) {
      var doc = new DOMParser().parseFromString(htmlString, "text/html");
      doc.querySelectorAll(".bd-header-article, .header-article-items, .bd-sidebar-secondary, nav, "
        + ".prev-next-area, .bd-footer-article, footer, .theme-switch-button, .admonition.note, "
        + ".onlyprint, #jb-print-toc").forEach(function (el) { el.remove(); });
      return toText(doc.documentElement.outerHTML, anchor).replace(/\\s+/g, " ");
    };
  }
});
"""
# Sphinx's search gives every page with the word in any heading the same score, then sorts by name:
# "GRPO" found lesson 08 (a section heading) before lesson 10 (the page's title). Here a page whose
# own title or file name holds every word of the query comes first, and a lesson before its exercises.
SEARCH_SCORER_JS = """var Scorer = {
  score: function (result) {
    var words = (new URLSearchParams(window.location.search).get("q") || "").toLowerCase().split(/\\s+/)
      .filter(function (w) { return w; });
    var title = ((result[1] || "").split(" > ")[0] + " " + result[0]).toLowerCase(), score = result[4];
    if (words.length && words.every(function (w) { return title.includes(w); })) score += 10;
    return result[0].startsWith("course/") ? score + 5 : score;
  },
  objNameMatch: 11, objPartialMatch: 6,
  objPrio: {0: 15, 1: 5, 2: -5}, objPrioDefault: 0,
  title: 15, partialTitle: 7,
  term: 5, partialTerm: 2,
};
"""
FAVICON_SVG = ('<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 32 32"><rect width="32" height="32" '
               'rx="6" fill="#2a6db0"/><text x="16" y="22" font-size="15" font-family="sans-serif" '
               'text-anchor="middle" fill="white">RL</text></svg>')
MATHJAX_PARTS = ("tex-mml-chtml.js", "input", "output", "ui", "a11y", "adaptors", "sre")
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"


def mathjax_dir() -> Path:
    """MathJax 3's browser build, as the ``django-static-mathjax`` wheel ships it."""
    import mathjax
    return Path(mathjax.__file__).parent / "static" / "mathjax" / "es5"


def repo_url(root: Path = ROOT) -> str | None:
    """``RLCOURSE_REPO_URL``, else the ``origin`` remote as an https address (None when neither)."""
    url = os.environ.get("RLCOURSE_REPO_URL")
    if url is None:
        run = subprocess.run(["git", "-C", str(root), "remote", "get-url", "origin"],
                             capture_output=True, text=True)
        url = run.stdout.strip() if run.returncode == 0 else ""
    url = re.sub(r"^git@([^:]+):", r"https://\1/", url).removesuffix(".git").rstrip("/")
    return url if url.startswith(("https://", "http://")) else None


# ----------------------------------------------------------------------------- widgets, made static

def _widget_models(nb: dict, model_id: str) -> list[dict]:
    """The saved models of one displayed widget and of its children, depth first."""
    models = nb.get("metadata", {}).get("widgets", {}).get(WIDGET_STATE, {}).get("state", {})
    found, todo = [], [model_id]
    while todo:
        model = models.get(todo.pop(0))
        if model is not None:
            found.append(model)
            todo[:0] = [str(c).removeprefix("IPY_MODEL_") for c in model["state"].get("children", [])]
    return found


def _knob(model: dict) -> str | None:
    """'γ from 0 to 0.99' for a slider; the label of any other control; None for the rest."""
    name, state = model["model_name"], model["state"]
    if not name.endswith(("SliderModel", "DropdownModel", "ToggleButtonsModel", "CheckboxModel")):
        return None
    label = state.get("description") or "a knob"
    if "min" in state and "max" in state:
        lo, hi = state["min"], state["max"]
        if name.startswith("FloatLog"):
            return f"{label} from {state.get('base', 10):g}^{lo:g} to {state.get('base', 10):g}^{hi:g}"
        return f"{label} from {lo:g} to {hi:g}"
    return label


def _text(html_value: str) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", html_value)).replace("\u2007", " ").strip()


def is_picture(output: dict) -> bool:
    """Whether a notebook output is an image."""
    return bool({"image/png", "image/svg+xml", "image/jpeg"} & set(output.get("data", {})))


def static_outputs(nb: dict, outputs: list[dict]) -> list[dict]:
    """A cell's outputs with each widget replaced by what it showed when the notebook ran.

    A progress bar (tqdm: an HBox of HTML, FloatProgress, HTML) becomes its last line as text. An
    explorer (sliders and an Output in an ``interactive`` box) becomes a note naming its knobs and
    saying they turn in JupyterLab, then the picture of its default setting:
    :class:`rlcourse.widgets.Explorer` has put one among the next outputs; a plain ``interactive``
    keeps it in its Output widget's saved state, from where it is taken. Without a picture anywhere,
    the note promises none.
    """
    static = []
    for i, output in enumerate(outputs):
        if WIDGET_VIEW not in output.get("data", {}):
            static.append(output)
            continue
        models = _widget_models(nb, output["data"][WIDGET_VIEW]["model_id"])
        names = [m["model_name"] for m in models]
        knobs = [k for k in map(_knob, models) if k]
        if knobs:
            pictures = [o for m in models if m["model_name"] == "OutputModel"
                        for o in m["state"].get("outputs", []) if is_picture(o)]
            follows = any(is_picture(o) for o in outputs[i + 1:])
            text = ("**A widget:** in JupyterLab (`make lab`) you turn its knobs (" + "; ".join(knobs)
                    + "). A static page cannot run it" + (": below is the picture of its default setting."
                                                          if follows or pictures else "."))
            static.append({"output_type": "display_data", "metadata": {}, "data": {"text/markdown": text}})
            static += [] if follows else pictures[-1:]
            continue
        elif "FloatProgressModel" in names or "IntProgressModel" in names:
            parts = [_text(m["state"].get("value", "")) for m in models if m["model_name"] == "HTMLModel"]
            percent = re.search(r"(\d+)%$", parts[0]) if parts else None
            bar = "█" * round(int(percent.group(1)) / 5) if percent else ""
            static.append({"output_type": "display_data", "metadata": {}, "data": {
                "text/plain": f"{parts[0] if parts else ''}|{bar:<20}|{' '.join(parts[1:])}"}})
            continue
        elif "OutputModel" in names:
            static += [o for m in models if m["model_name"] == "OutputModel"
                       for o in m["state"].get("outputs", [])]
            continue
        else:
            text = "**A widget:** it runs in JupyterLab (`make lab`), not on a static page."
        static.append({"output_type": "display_data", "metadata": {}, "data": {"text/markdown": text}})
    return static


# ----------------------------------------------------------------------------- staging

def _banner(rel: Path, url: str | None) -> dict:
    download = f"{{download}}`download it <../{ORIGINALS}/{rel.as_posix()}>`"
    where = f"[`{rel.as_posix()}`]({url}/blob/{os.environ.get('RLCOURSE_REPO_BRANCH', 'main')}/" \
            f"{rel.as_posix()}) in the repository ({download})" if url else \
        f"`{rel.as_posix()}` in the repository ({download})"
    if rel.parts[0] == "exercises":
        what = (f"These exercises are the notebook {where}. Write each function in JupyterLab and "
                "run the check cell under it: here the cells are shown as you get them, unrun.")
    else:
        what = (f"This lesson is the notebook {where}, shown with the outputs of its committed run "
                "(widgets as a static picture of their default setting).")
    text = (f":::{{note}}\n{what} To run it: clone the repository, then `make lab` opens the course "
            "in JupyterLab and `make test` runs every test ([how to run it](../index.md)).\n:::")
    return {"cell_type": "markdown", "id": "book-banner", "metadata": {}, "source": text}


def stage_notebook(src: Path, dest: Path, rel: Path, url: str | None = None) -> None:
    """Copy one notebook for the site: the note under its title, widget outputs made static."""
    nb = json.loads(src.read_text())
    out = copy.deepcopy(nb)
    for cell in out["cells"]:
        if cell["cell_type"] == "code":
            cell["outputs"] = static_outputs(nb, cell.get("outputs", []))
    first_markdown = next((i for i, c in enumerate(out["cells"]) if c["cell_type"] == "markdown"), -1)
    out["cells"].insert(first_markdown + 1, _banner(rel, url))
    out["metadata"].pop("widgets", None)
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(out, indent=1, ensure_ascii=False))


def site_pages(root: Path = ROOT) -> list[str]:
    """The site's pages (Sphinx document names) in reading order, as previous/next walks them."""
    lessons = [f"course/{p.stem}" for p in lesson_notebooks(root / "course")]
    exercises = [f"exercises/{p.stem}" for p in lesson_notebooks(root / "exercises")]
    return ["index"] + lessons + exercises + [Path(p).stem for p in EXTRA_PAGES]


def stage(src_dir: Path, root: Path = ROOT, url: str | None = None) -> None:
    """Write the Sphinx source tree of the site into ``src_dir``."""
    if src_dir.exists():
        shutil.rmtree(src_dir)
    src_dir.mkdir(parents=True)
    pages = site_pages(root)
    notebooks = [Path(p + ".ipynb") for p in pages if p.startswith(("course/", "exercises/"))]
    for rel in notebooks:
        stage_notebook(root / rel, src_dir / rel, rel, url)
        (src_dir / ORIGINALS / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(root / rel, src_dir / ORIGINALS / rel)
    for page in EXTRA_PAGES:  # the README is the site's index page
        (src_dir / page).write_text((root / page).read_text().replace("](README.md", "](index.md"))

    def toctree(caption: str, folder: str) -> str:
        docs = [p for p in pages if p.startswith(folder)] if folder else \
            [Path(p).stem for p in EXTRA_PAGES]
        return f"\n```{{toctree}}\n:hidden:\n:caption: {caption}\n\n" + "\n".join(docs) + "\n```\n"
    (src_dir / "index.md").write_text((root / "README.md").read_text() + toctree("Lessons", "course/")
                                      + toctree("Exercises", "exercises/") + toctree("About", ""))
    (src_dir / "conf.py").write_text("# Generated by rlcourse.tools.book, where the configuration "
                                     "lives.\nimport os\n\nfrom rlcourse.tools.book.build import SPHINX_CONFIG\n\n"
                                     "globals().update(SPHINX_CONFIG)\n"
                                     "# Sphinx opens the scorer from its working directory: give it a full path.\n"
                                     "html_search_scorer = os.path.join(os.path.dirname(__file__), '_static', 'scorer.js')\n")
    (src_dir / "_static" / "mathjax").mkdir(parents=True)
    (src_dir / "_static" / "fit_equations.js").write_text(FIT_EQUATIONS_JS)
    (src_dir / "_static" / "wide_column.css").write_text(WIDE_COLUMN_CSS)
    (src_dir / "_static" / "readable.css").write_text(READABLE_CSS)
    (src_dir / "_static" / "readable.js").write_text(READABLE_JS)
    (src_dir / "_static" / "scorer.js").write_text(SEARCH_SCORER_JS)
    (src_dir / "favicon.svg").write_text(FAVICON_SVG)
    for part in MATHJAX_PARTS:
        copy_part = shutil.copytree if (mathjax_dir() / part).is_dir() else shutil.copy
        copy_part(mathjax_dir() / part, src_dir / "_static" / "mathjax" / part)


def build(out_dir: Path = ROOT / "_build", root: Path = ROOT) -> Path:
    """Stage and build the site; returns its html folder. Raises if Sphinx printed any warning."""
    src, html_dir = out_dir / "src", out_dir / "html"
    stage(src, root, repo_url(root))
    if html_dir.exists():
        shutil.rmtree(html_dir)
    cmd = [sys.executable, "-m", "sphinx", "-b", "html", "-W", "--keep-going", "-E", "-q",
           "-d", str(out_dir / "doctrees"), str(src), str(html_dir)]
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode or run.stderr.strip():
        raise RuntimeError(f"sphinx-build warned or failed (exit {run.returncode}):\n"
                           f"{run.stderr}{run.stdout[-3000:]}")
    return html_dir
