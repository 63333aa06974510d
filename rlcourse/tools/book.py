"""The course as a static website: ``make book`` (``python -m rlcourse.tools.book``).

The site is built from the committed, executed notebooks, without running them, and without the
network: Sphinx with MyST-NB and the Sphinx Book Theme, and MathJax 2 from the
``jupyter-server-mathjax`` package copied next to the pages (so the maths renders offline too).

1. ``stage``: copy the README (the landing page), CONTRIBUTING.md, BENCHMARKS.md, ``course/*.ipynb``
   and ``exercises/*.ipynb`` into ``_build/src``. Each notebook gets a banner under its title (where it
   lives, how to run it), and its widget outputs are replaced by what they showed when the notebook
   was run: a static page cannot run a kernel.
2. ``build``: ``sphinx-build`` into ``_build/html``; any Sphinx warning fails the build.
3. ``check_site``: every page exists, every internal link, anchor and image resolves, no text shows
   raw ``$...$`` maths or an unrendered LaTeX macro, and no page carries a Python traceback.

Publish ``_build/html`` on any static host (it is plain files; ``index.html`` is the landing page).
Set ``RLCOURSE_REPO_URL`` (e.g. ``https://github.com/<owner>/rlcourse``) to add a repository button
and a link from every page to its notebook in the repository.
"""
from __future__ import annotations

import argparse
import copy
import html
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"

# Pages besides the notebooks, copied as they are (the README's links point at them).
EXTRA_PAGES = ("CONTRIBUTING.md", "BENCHMARKS.md")

# The whole Sphinx configuration; the generated conf.py only imports it.
SPHINX_CONFIG = {
    "project": "rlcourse",
    "author": "the rlcourse authors",
    "copyright": "the rlcourse authors",
    "extensions": ["myst_nb", "sphinx.ext.mathjax"],
    "root_doc": "index",
    "exclude_patterns": ["_build"],
    "nb_execution_mode": "off",  # the committed outputs are the page; nothing is re-run
    "nb_merge_streams": True,
    "myst_enable_extensions": ["dollarmath", "amsmath", "colon_fence"],
    "myst_heading_anchors": 3,
    "html_theme": "sphinx_book_theme",
    "html_title": "rlcourse",
    "html_static_path": ["_static"],
    "html_theme_options": {
        "home_page_in_toc": True,
        "use_download_button": True,
        "show_toc_level": 2,
        "navigation_with_keys": True,
    },
    "html_last_updated_fmt": None,
    # MathJax 2 from the jupyter-server-mathjax package, copied into _static/mathjax by `build`.
    "mathjax_path": "mathjax/MathJax.js?config=TeX-AMS-MML_HTMLorMML-full",
    "mathjax2_config": {
        "tex2jax": {"inlineMath": [["\\(", "\\)"]], "displayMath": [["\\[", "\\]"]],
                    "processEscapes": True, "processRefs": False, "processEnvironments": True,
                    # MyST-NB marks notebook pages "ignore" and the maths in them "math".
                    "processClass": "math|output_area|tex2jax_process|mathjax_process",
                    "ignoreClass": "tex2jax_ignore|mathjax_ignore"},
        "HTML-CSS": {"availableFonts": [], "webFont": "STIX-Web", "imageFont": None},
        "SVG": {"font": "STIX-Web"},
        "messageStyle": "none",
    },
}


def lesson_notebooks(root: Path = ROOT) -> list[Path]:
    return sorted((root / "course").glob("*.ipynb"))


def exercise_notebooks(root: Path = ROOT) -> list[Path]:
    return sorted((root / "exercises").glob("*.ipynb"))


# ----------------------------------------------------------------------------- widgets, made static

def _strip_tags(text: str) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", text)).replace("\u2007", " ").strip()


def _models(nb: dict) -> dict:
    return nb.get("metadata", {}).get("widgets", {}).get(WIDGET_STATE, {}).get("state", {})


def _walk(models: dict, model_id: str):
    """The widget models of one displayed widget, depth first."""
    model = models.get(model_id)
    if model is None:
        return
    yield model
    for child in model.get("state", {}).get("children", []):
        yield from _walk(models, str(child).removeprefix("IPY_MODEL_"))


def _knob(model: dict) -> str | None:
    name, state = model["model_name"], model.get("state", {})
    if not name.endswith(("SliderModel", "DropdownModel", "ToggleButtonsModel", "CheckboxModel")):
        return None
    label = state.get("description") or "knob"
    if "min" in state and "max" in state:
        lo, hi = state["min"], state["max"]
        if name.startswith("FloatLog"):
            base = state.get("base", 10)
            lo, hi = f"{base}^{lo:g}", f"{base}^{hi:g}"
            return f"{label} from {lo} to {hi}"
        return f"{label} from {lo:g} to {hi:g}"
    return label


def static_widget_outputs(nb: dict, output: dict) -> list[dict]:
    """What one widget output showed when the notebook ran, as ordinary outputs.

    A progress bar (tqdm: an HBox of HTML, FloatProgress, HTML) becomes its final line of text. An
    explorer (an ``interactive`` VBox of sliders and an Output) becomes a note naming its knobs;
    the static picture of its default setting is already the next output of its cell
    (:class:`rlcourse.widgets.Explorer` draws it).
    """
    model_id = output["data"][WIDGET_VIEW]["model_id"]
    models = list(_walk(_models(nb), model_id))
    if not models:
        return [_markdown("*An interactive widget: it runs in JupyterLab (`make lab`).*")]
    knobs = [k for k in map(_knob, models) if k]
    if knobs:
        return [_markdown("*Interactive in JupyterLab (`make lab`): " + "; ".join(knobs)
                          + ". A static page cannot turn them; the picture below is the default setting.*")]
    if any(m["model_name"] in ("FloatProgressModel", "IntProgressModel") for m in models):
        texts = [_strip_tags(m["state"].get("value", "")) for m in models if m["model_name"] == "HTMLModel"]
        return [{"output_type": "stream", "name": "stderr", "text": " ".join(t for t in texts if t) + "\n"}]
    outputs = [o for m in models if m["model_name"] == "OutputModel" for o in m["state"].get("outputs", [])]
    return outputs or [_markdown("*An interactive widget: it runs in JupyterLab (`make lab`).*")]


def _markdown(text: str) -> dict:
    return {"output_type": "display_data", "metadata": {}, "data": {"text/markdown": text}}


# ----------------------------------------------------------------------------- staging

def _banner(rel: Path, repo_url: str | None) -> dict:
    where = f"[in the repository]({repo_url}/blob/main/{rel.as_posix()})" if repo_url else \
        f"{{download}}`download it <{rel.name}>`"
    kind = "exercise notebook" if rel.parts[0] == "exercises" else "lesson"
    text = (":::{note}\n"
            f"This {kind} is the notebook `{rel.as_posix()}` ({where}), shown with the outputs of its "
            "committed run. To run it yourself, turn its widgets and grade the exercises, clone the "
            "repository and run `make lab`; `make test` runs every test "
            "(see [the two commands](../index.md)).\n:::")
    return {"cell_type": "markdown", "id": "book-banner", "metadata": {}, "source": text}


def stage_notebook(src: Path, dest: Path, rel: Path, repo_url: str | None = None) -> None:
    """Copy one notebook for the site: a banner under its title, widget outputs made static."""
    nb = json.loads(src.read_text())
    out = copy.deepcopy(nb)
    for cell in out["cells"]:
        if cell["cell_type"] != "code":
            continue
        outputs = []
        for o in cell.get("outputs", []):
            if WIDGET_VIEW in o.get("data", {}):
                outputs.extend(static_widget_outputs(nb, o))
            else:
                outputs.append(o)
        cell["outputs"] = outputs
    first_title = next((i for i, c in enumerate(out["cells"]) if c["cell_type"] == "markdown"), -1)
    out["cells"].insert(first_title + 1, _banner(rel, repo_url))
    out["metadata"].pop("widgets", None)
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(out, indent=1, ensure_ascii=False))


def _index_page(readme: str, lessons: list[Path], exercises: list[Path]) -> str:
    def toctree(caption: str, paths: list[str]) -> str:
        return "\n```{toctree}\n:hidden:\n:caption: " + caption + "\n\n" + "\n".join(paths) + "\n```\n"
    return (readme
            + toctree("Lessons", [f"course/{p.stem}" for p in lessons])
            + toctree("Exercises", [f"exercises/{p.stem}" for p in exercises])
            + toctree("About", [Path(p).stem for p in EXTRA_PAGES]))


def stage(src_dir: Path, root: Path = ROOT, repo_url: str | None = None) -> None:
    """Write the Sphinx source tree of the site into ``src_dir``."""
    if src_dir.exists():
        shutil.rmtree(src_dir)
    src_dir.mkdir(parents=True)
    lessons, exercises = lesson_notebooks(root), exercise_notebooks(root)
    for nb in lessons + exercises:
        rel = nb.relative_to(root)
        stage_notebook(nb, src_dir / rel, rel, repo_url)
    for page in EXTRA_PAGES:
        shutil.copy(root / page, src_dir / page)
    (src_dir / "index.md").write_text(_index_page((root / "README.md").read_text(), lessons, exercises))
    (src_dir / "conf.py").write_text(
        "# Generated by rlcourse.tools.book: the configuration lives there.\n"
        "from rlcourse.tools.book import sphinx_config\n\nglobals().update(sphinx_config())\n")
    mathjax = Path(__import__("jupyter_server_mathjax").__file__).parent / "static"
    shutil.copytree(mathjax, src_dir / "_static" / "mathjax")


def sphinx_config() -> dict:
    config = copy.deepcopy(SPHINX_CONFIG)
    repo_url = os.environ.get("RLCOURSE_REPO_URL")
    if repo_url:
        config["html_theme_options"].update(repository_url=repo_url, use_repository_button=True)
    return config


def build(out_dir: Path = ROOT / "_build", root: Path = ROOT, quiet: bool = True) -> Path:
    """Stage and build the site; returns the html folder. Raises if Sphinx printed any warning."""
    src, html_dir = out_dir / "src", out_dir / "html"
    stage(src, root, os.environ.get("RLCOURSE_REPO_URL"))
    if html_dir.exists():
        shutil.rmtree(html_dir)
    cmd = [sys.executable, "-m", "sphinx", "-b", "html", "-W", "--keep-going", "-E",
           "-d", str(out_dir / "doctrees"), str(src), str(html_dir)] + (["-q"] if quiet else [])
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode or run.stderr.strip():
        raise RuntimeError(f"sphinx-build failed or warned (exit {run.returncode}):\n{run.stderr}{run.stdout[-3000:]}")
    return html_dir


# ----------------------------------------------------------------------------- checks

_MATH_CLASSES = ("math",)
_RAW_DOLLAR = re.compile(r"(?<![\\\w])\$[^$\s][^$\n]*\$")
_MACRO = re.compile(r"\\(frac|sum|mathbb|mathcal|hat|theta|pi|log|nabla|mathbb|text|left|right|begin|end|cdot|sqrt)\b")


def _page_text(soup) -> str:
    """The prose a reader sees, without code, maths, scripts and styles."""
    for tag in soup(["script", "style", "pre", "code", "textarea"]):
        tag.decompose()
    for tag in soup.select(".math, .MathJax, .MathJax_Preview"):
        tag.decompose()
    return soup.get_text(" ")


def check_site(html_dir: Path, root: Path = ROOT) -> list[str]:
    """Every problem found in the built site, as sentences (empty when the site is sound)."""
    from bs4 import BeautifulSoup

    problems = []
    expected = [html_dir / "index.html"]
    expected += [html_dir / "course" / f"{p.stem}.html" for p in lesson_notebooks(root)]
    expected += [html_dir / "exercises" / f"{p.stem}.html" for p in exercise_notebooks(root)]
    expected += [html_dir / f"{Path(p).stem}.html" for p in EXTRA_PAGES]
    problems += [f"missing page {p.relative_to(html_dir)}" for p in expected if not p.exists()]
    pages = [p for p in html_dir.rglob("*.html") if "_static" not in p.parts]
    ids: dict[Path, set] = {}
    soups = {}
    for page in pages:
        soups[page] = BeautifulSoup(page.read_text(), "html.parser")
        ids[page] = {t.get("id") for t in soups[page].find_all(id=True)}
    for page in pages:
        soup, name = soups[page], page.relative_to(html_dir)
        for tag, attr in (("a", "href"), ("img", "src"), ("link", "href"), ("script", "src")):
            for t in soup.find_all(tag):
                url = t.get(attr)
                if not url or re.match(r"^(https?:|mailto:|javascript:|data:)", url):
                    continue
                path, _, fragment = url.partition("#")
                target = (page.parent / path.split("?")[0]).resolve() if path else page.resolve()
                if not target.exists():
                    problems.append(f"{name}: <{tag} {attr}={url!r}> points at nothing")
                elif fragment and target.suffix == ".html" and target in ids and fragment not in ids[target]:
                    problems.append(f"{name}: link {url!r} names an anchor its page does not have")
        if "Traceback (most recent call last)" in page.read_text() or soup.select(".output.traceback"):
            problems.append(f"{name}: shows a Python traceback")
        text = _page_text(BeautifulSoup(page.read_text(), "html.parser"))
        for pattern, what in ((_RAW_DOLLAR, "raw $...$ maths"), (_MACRO, "an unrendered LaTeX macro")):
            hit = pattern.search(text)
            if hit:
                problems.append(f"{name}: shows {what}: {text[max(0, hit.start() - 40):hit.end() + 40]!r}")
    return problems


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "_build", help="build folder (default _build/)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    html_dir = build(args.out, quiet=True)
    problems = check_site(html_dir)
    for p in problems:
        print("PROBLEM:", p)
    pages = sum(1 for _ in html_dir.rglob("*.html"))
    print(f"built {html_dir} ({pages} html files) in {time.perf_counter() - start:.0f} s; "
          f"{len(problems)} problems. Open {html_dir / 'index.html'} or publish the folder on any static host.")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
