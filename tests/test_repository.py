"""The repository's top level holds only what the README names (a stray file fails CI)."""
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
USUAL_DOTFILES = {".gitignore", ".gitattributes"}


def test_the_top_level_holds_only_what_the_readme_names():
    section = (ROOT / "README.md").read_text().split("## What is in the repository", 1)[1].split("\n## ", 1)[0]
    named = {name.rstrip("/") for row in section.splitlines() if row.startswith("| `")
             for name in re.findall(r"`([^`]+)`", row.split("|")[1])}
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    top = {path.split("/", 1)[0] for path in tracked}
    assert top - named - USUAL_DOTFILES == set(), "top-level entries the README's table does not name"
    assert named - top == set(), "entries the README's table names that the repository does not hold"
