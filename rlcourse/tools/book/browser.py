"""The built book as a reader's browser shows it: every page at a desktop and at a phone width.

:func:`browse` serves a site built by :mod:`rlcourse.tools.book` on localhost, opens every page in
headless Chromium (driven by Playwright, using the system's Chromium: Playwright's own browser
download needs a network the course does not assume) at each width, waits for MathJax, and lists
what a reader would trip over:

- a console error, a script error, or a request that fails;
- a link to a page or anchor that does not exist, an image that does not load;
- a formula MathJax could not typeset;
- a page wider than the window (it pans sideways on a phone), a display equation or an inline
  formula cut at the column's edge (one that scrolls inside its own box is counted, not a problem),
  code or printed output cut at the column's edge;
- a widget's note promising "the picture of its default setting" with no picture after it;
- a search for a lesson's topic (:data:`SEARCHES`) that does not rank the lesson first, or whose
  excerpts show the theme's buttons instead of the lesson's text;
- at a desktop width, a figure shown so small that its tick labels (10 pt, matplotlib's smallest
  default) are under :data:`MIN_TICK_PX` pixels tall on the screen.

``python -m rlcourse.tools.book.browser [_build/html]`` prints the report; ``tests/test_book.py``
runs it on the course's own book.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import http.server
import os
import shutil
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urlsplit

WIDTHS = (1280, 390)  # a laptop and a phone (an iPhone 12-15 is 390 CSS pixels wide)
DESKTOP = 1000  # at this width and wider, figures must be legible as shown
MIN_TICK_PX = 9.0
TICK_PT = 10.0  # matplotlib's default tick label size; the course style uses 11
INSTALL_HINT = ("no Chromium found: install Debian's package (`sudo apt-get install chromium`) or "
                "point RLCOURSE_CHROMIUM at a Chromium or Chrome binary")
WIDGET_NOTE = "below is the picture of its default setting"
# Search, offline: the lesson on a topic is the first hit for its name.
SEARCHES = {"GRPO": "course/10_grpo.html", "DPO": "course/11_dpo.html", "TRPO": "course/05_trpo.html"}
SEARCH_CHROME = ("System Settings", "Light Dark", "Contents")  # the theme's buttons, not the lesson
# Flags for a headless Chromium on a machine without a network or a screen (no background traffic).
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic",
                 "--no-first-run", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync"]


def chromium_path() -> str | None:
    """``RLCOURSE_CHROMIUM``, else a Chromium or Chrome on the PATH; None when there is none."""
    if os.environ.get("RLCOURSE_CHROMIUM"):
        return os.environ["RLCOURSE_CHROMIUM"]
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        if shutil.which(name):
            return shutil.which(name)
    return None


@dataclass
class Report:
    """What :func:`browse` measured, and the problems it found (empty when the book is sound)."""
    pages: int = 0
    links: int = 0
    images: int = 0
    display_formulas: int = 0
    inline_formulas: int = 0
    scrolling_formulas: dict = field(default_factory=dict)  # width -> formulas that scroll in their box
    widest_page: dict = field(default_factory=dict)  # width -> widest page's width in CSS px
    smallest_tick_px: float = float("inf")
    problems: list = field(default_factory=list)


@contextlib.contextmanager
def serve(html_dir: Path):
    """The folder on a local web server for the duration; yields its base address."""
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0),
                                             functools.partial(Quiet, directory=str(html_dir)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/"
    finally:
        server.shutdown()
        server.server_close()


def _png_dpi(path: Path) -> float:
    """The dots per inch a PNG was drawn at (its pHYs chunk; 100 when it has none)."""
    from PIL import Image
    with Image.open(path) as image:
        return float(image.info.get("dpi", (100.0, 100.0))[0])


# Run in each page once MathJax is done: everything measured there, as one plain object.
_MEASURE = """() => {
  const vw = window.innerWidth, article = document.querySelector("article") || document.body;
  // the sidebars and the page's contents, folded away at narrow widths, are not the page
  const outside = (el) => el.closest(".bd-sidebar-primary, .bd-sidebar-secondary, dialog, .bd-header");
  const r = {width: document.documentElement.scrollWidth, wide: [], cut_display: [], scroll_display: 0,
             cut_inline: [], scroll_inline: 0, cut_pre: [], broken_images: [], figures: [], notes: 0,
             notes_without_picture: 0, merror: document.querySelectorAll("mjx-merror").length};
  if (r.width > vw) {
    r.wide = [...article.querySelectorAll("*")].filter(e => !outside(e) && e.getBoundingClientRect().right > vw + 1
      && ![...e.children].some(c => c.getBoundingClientRect().right > vw + 1))
      .slice(0, 3).map(e => e.tagName.toLowerCase() + ": " + (e.textContent || "").trim().slice(0, 60));
  }
  const scrolls = (el) => ["auto", "scroll"].includes(getComputedStyle(el).overflowX);
  // inside a box that scrolls sideways (a wide table, a long equation), the reader reaches it
  const scrolled = (el) => { for (let a = el.parentElement; a && a !== document.body; a = a.parentElement)
    if (scrolls(a) && a.scrollWidth > a.clientWidth + 1) return true; return false; };
  const display = [...document.querySelectorAll('mjx-container[display="true"]')].filter(e => !outside(e));
  const inline = [...document.querySelectorAll('mjx-container:not([display="true"])')].filter(e => !outside(e));
  r.display = display.length; r.inline = inline.length;
  for (const eq of display) {
    if (eq.scrollWidth <= eq.clientWidth + 1) continue;
    if (scrolls(eq) || scrolled(eq)) r.scroll_display += 1; else r.cut_display.push(eq.textContent.slice(0, 50));
  }
  for (const eq of inline) {
    const line = (eq.closest("p, li, td, th, dd, h1, h2, h3, h4") || eq.parentElement).getBoundingClientRect();
    const box = eq.getBoundingClientRect();
    if ((scrolls(eq) && eq.scrollWidth > eq.clientWidth + 1) || scrolled(eq)) r.scroll_inline += 1;
    else if (box.right > Math.min(line.right, vw) + 1) r.cut_inline.push(eq.textContent.slice(0, 50));
  }
  for (const pre of article.querySelectorAll("pre")) {
    if (!outside(pre) && !scrolled(pre) && pre.scrollWidth > pre.clientWidth + 1) r.cut_pre.push(pre.textContent.trim().slice(0, 50));
  }
  const images = [...document.querySelectorAll("img")].filter(i => !outside(i));
  r.images = images.length;
  r.broken_images = images.filter(i => !(i.complete && i.naturalWidth > 0)).map(i => i.getAttribute("src"));
  r.figures = [...document.querySelectorAll("div.cell_output img")]
    .map(i => ({src: i.src, shown: i.getBoundingClientRect().width, natural: i.naturalWidth}));
  for (const out of document.querySelectorAll("div.cell_output")) {
    for (const el of out.querySelectorAll("p")) {
      if (!el.textContent.includes("%NOTE%")) continue;
      r.notes += 1;
      const after = [...out.querySelectorAll("img")].filter(i => el.compareDocumentPosition(i) & Node.DOCUMENT_POSITION_FOLLOWING);
      if (!after.length) r.notes_without_picture += 1;
    }
  }
  r.links = [...document.querySelectorAll("a[href]")].filter(a => !outside(a)).map(a => a.href);
  r.ids = [...document.querySelectorAll("[id]")].map(e => e.id);
  return r;
}""".replace("%NOTE%", WIDGET_NOTE)


def _page_problems(name: str, width: int, m: dict, html_dir: Path, report: Report) -> list[str]:
    at = f"{name} at {width} px"
    problems = []
    if m["width"] > width:
        problems.append(f"{at}: the page is {m['width']} px wide and pans sideways ({m['wide']})")
    if m["merror"]:
        problems.append(f"{at}: {m['merror']} formula(s) MathJax could not typeset")
    problems += [f"{at}: a display equation is cut at the column's edge: {t!r}" for t in m["cut_display"]]
    problems += [f"{at}: an inline formula runs past its line: {t!r}" for t in m["cut_inline"]]
    problems += [f"{at}: code or output cut at the column's edge: {t!r}" for t in m["cut_pre"]]
    problems += [f"{at}: the image {src!r} does not load" for src in m["broken_images"]]
    if m["notes_without_picture"]:
        problems.append(f"{at}: a widget's note promises its picture and none follows")
    if width >= DESKTOP:
        for fig in m["figures"]:
            if not fig["natural"]:
                continue
            path = html_dir / unquote(urlsplit(fig["src"]).path.lstrip("/"))
            tick_px = TICK_PT / 72 * _png_dpi(path) * fig["shown"] / fig["natural"]
            report.smallest_tick_px = min(report.smallest_tick_px, tick_px)
            if tick_px < MIN_TICK_PX:
                problems.append(f"{at}: the figure {path.name} is shown at {fig['shown']:.0f} of its "
                                f"{fig['natural']} px: 10-pt labels are {tick_px:.1f} px tall "
                                f"(under {MIN_TICK_PX:g}); draw it narrower or with fewer panels per row")
    return problems


def _search_problems(page, base: str, searches: dict) -> list[str]:
    """Run each query on the search page: its lesson first, excerpts without the theme's chrome."""
    problems = []
    for query, expected in searches.items():
        page.goto(f"{base}search.html?q={query}", wait_until="load")
        try:
            # results appear one by one, each with its excerpt, then the search says it has finished
            page.wait_for_function("() => /Search finished|did not match/.test(document.body.innerText)",
                                   timeout=30_000)
        except Exception:  # noqa: BLE001 (Playwright's TimeoutError): reported as a problem below
            problems.append(f"search for {query!r} did not finish within 30 s")
            continue
        hits = page.evaluate("""() => [...document.querySelectorAll('#search-results li')].map(li =>
            [li.querySelector('a').getAttribute('href'), (li.querySelector('p.context') || {}).textContent || ''])""")
        if not hits or hits[0][0].split("#")[0] != expected:
            problems.append(f"search for {query!r} ranks {hits[0][0] if hits else 'nothing'} first, not {expected}")
        chrome = [h for h in hits if any(c in h[1] for c in SEARCH_CHROME)]
        if chrome:
            problems.append(f"search for {query!r}: the excerpt of {chrome[0][0]} shows the theme's "
                            f"buttons: {chrome[0][1][:80]!r}")
    return problems


def browse(html_dir: Path, widths=WIDTHS, executable: str | None = None, searches=None) -> Report:
    """Open every page of the built site at each width in headless Chromium; see the module doc.

    ``searches`` maps a query to the page search must rank first (default :data:`SEARCHES`).
    """
    from playwright.sync_api import sync_playwright

    html_dir = Path(html_dir).resolve()
    executable = executable or chromium_path()
    if executable is None:
        raise RuntimeError(INSTALL_HINT)
    pages = sorted(p.relative_to(html_dir).as_posix() for p in html_dir.rglob("*.html")
                   if not p.relative_to(html_dir).parts[0].startswith("_"))
    report, links, ids = Report(pages=len(pages)), {}, {}
    with serve(html_dir) as base, sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        try:
            for width in widths:
                context = browser.new_context(viewport={"width": width, "height": 900})
                page, events = context.new_page(), []
                page.on("console", lambda msg: events.append(f"console error: {msg.text}")
                        if msg.type == "error" else None)
                page.on("pageerror", lambda error: events.append(f"script error: {error}"))
                # a request cut short by the next page's navigation (the favicon, often) is no failure
                page.on("requestfailed", lambda req: events.append(f"request failed: {req.url}")
                        if "ERR_ABORTED" not in (req.failure or "") else None)
                page.on("response", lambda res: events.append(f"HTTP {res.status}: {res.url}")
                        if res.status >= 400 else None)
                widest = 0
                for name in pages:
                    events.clear()
                    page.goto(base + name, wait_until="load")
                    page.evaluate("() => window.MathJax && MathJax.startup ? MathJax.startup.promise : null")
                    page.wait_for_timeout(30)  # fit_equations.js scales equations on the same event
                    m = page.evaluate(_MEASURE)
                    report.problems += [f"{name} at {width} px: {e}" for e in events]
                    report.problems += _page_problems(name, width, m, html_dir, report)
                    widest = max(widest, m["width"])
                    report.scrolling_formulas[width] = report.scrolling_formulas.get(width, 0) \
                        + m["scroll_display"] + m["scroll_inline"]
                    if width == widths[0]:
                        report.images += m["images"]
                        report.display_formulas += m["display"]
                        report.inline_formulas += m["inline"]
                        ids[name] = set(m["ids"])
                        links[name] = [u for u in m["links"] if u.startswith(base)]
                report.widest_page[width] = widest
                if width == widths[0]:
                    report.problems += _search_problems(page, base, SEARCHES if searches is None else searches)
                context.close()
        finally:
            browser.close()
    for name, urls in links.items():
        report.links += len(urls)
        for url in urls:
            parts = urlsplit(url)
            target = unquote(parts.path.removeprefix(urlsplit(base).path))
            file = html_dir / target if target else html_dir / "index.html"
            if file.is_dir():
                file = file / "index.html"
            if not file.exists():
                report.problems.append(f"{name}: a link to {target!r} points at nothing")
            elif parts.fragment and target in ids and unquote(parts.fragment) not in ids[target]:
                report.problems.append(f"{name}: a link to {target}#{parts.fragment} names no anchor there")
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Check the built book in headless Chromium.")
    parser.add_argument("html", nargs="?", type=Path, default=Path("_build/html"))
    args = parser.parse_args(argv)
    report = browse(args.html)
    for problem in report.problems:
        print("PROBLEM:", problem)
    print(f"{report.pages} pages at {', '.join(map(str, WIDTHS))} px: {report.links} internal links, "
          f"{report.images} images, {report.display_formulas} display and {report.inline_formulas} "
          f"inline formulas; widest page {report.widest_page}; formulas scrolling in their own box "
          f"{report.scrolling_formulas}; smallest tick label as shown {report.smallest_tick_px:.1f} px; "
          f"{len(report.problems)} problems")
    return 1 if report.problems else 0


if __name__ == "__main__":
    sys.exit(main())
