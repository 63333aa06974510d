"""``python -m rlcourse.tools.book``: build the web book into ``_build/html``, then check it."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from rlcourse.tools.book.build import ROOT, build, repo_url, site_pages
from rlcourse.tools.book.check import check_site


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Build the course as a static website, then check it.")
    parser.add_argument("--out", type=Path, default=ROOT / "_build", help="build folder (default _build/)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    if repo_url() is None:
        print("warning: RLCOURSE_REPO_URL is not set and the origin remote is not a web address, so no "
              "page links to the repository: set it, e.g. RLCOURSE_REPO_URL=https://github.com/<owner>/"
              "rlcourse make book", file=sys.stderr)
    try:
        html_dir = build(args.out)
    except RuntimeError as error:
        print(error, file=sys.stderr)
        return 1
    problems = check_site(html_dir)
    for p in problems:
        print("PROBLEM:", p)
    print(f"built {len(site_pages())} pages into {html_dir} in {time.perf_counter() - start:.0f} s; "
          f"{len(problems)} problems. Open {html_dir / 'index.html'}, or publish the folder on any "
          "static host.")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
