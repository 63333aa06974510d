"""rlcourse's layout: folders by role, each small, layers that point one way, no import circle."""
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "rlcourse"
MAX_MODULES = 15
# A layer may import its own and the lower ones only (lazy imports inside functions count too).
LAYERS = ["maths", "rlcourse.lm", "rlcourse.tasks", "rlcourse.trainers", "rlcourse.measure", "rlcourse.interop"]
MATHS = {"rlcourse", "rlcourse.returns", "rlcourse.kl", "rlcourse.tabular", "rlcourse.regularised_optimum",
         "rlcourse.stats", "rlcourse.runtime"}
ABOVE_ALL = ("rlcourse.classic", "rlcourse.envs", "rlcourse.grading", "rlcourse.tools", "rlcourse.bench",
             "rlcourse.widgets", "rlcourse.viz")


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(path: Path, modules: dict) -> set[str]:
    """The rlcourse modules ``path`` imports, anywhere in it (``from pkg import sub`` is ``pkg.sub``)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                out.add(sub if sub in modules else node.module)
        elif isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
    return {m for m in out if m == "rlcourse" or m.startswith("rlcourse.")}


def _layer(module: str) -> int | None:
    if module in MATHS or module.startswith("rlcourse.losses"):
        return 0
    for i, prefix in enumerate(LAYERS[1:], 1):
        if module == prefix or module.startswith(prefix + "."):
            return i
    return None


def _one_per_lesson(modules: list[Path]) -> bool:
    """Every module is ``lessonNN.py`` for a lesson notebook of course/: the grader's checks, found by number."""
    lessons = {p.name.split("_")[0] for p in (ROOT.parent / "course").glob("*.ipynb")}
    return all(m.stem.startswith("lesson") and m.stem.removeprefix("lesson") in lessons for m in modules)


def test_no_folder_holds_more_than_fifteen_modules_and_each_says_what_it_holds():
    """A reader finds a module by its role; past fifteen a folder wants splitting. The exception is a
    folder of one module per lesson (``grading/llm/lessonNN.py``): it grows with the lesson map and a
    lesson's checks are found by its number."""
    for folder in [ROOT, *(p for p in ROOT.rglob("*") if p.is_dir() and (p / "__init__.py").exists())]:
        modules = [p for p in folder.glob("*.py") if p.name not in ("__init__.py", "__main__.py")]
        assert len(modules) <= MAX_MODULES or _one_per_lesson(modules), \
            f"{folder.relative_to(ROOT.parent)} holds {len(modules)} modules"
        doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text()))
        assert doc, f"{folder.relative_to(ROOT.parent)}/__init__.py says nothing of what lives there"


def test_layers_point_one_way():
    modules = _modules()
    wrong = []
    for name, path in modules.items():
        layer = _layer(name)
        if layer is None:
            continue
        for target in _imports(path, modules):
            above = target.startswith(ABOVE_ALL) or (_layer(target) or 0) > layer
            if above:
                wrong.append(f"{name} imports {target}")
    assert not wrong, "\n".join(wrong)


def test_no_import_circle():
    modules = _modules()
    graph = {m: _imports(p, modules) & set(modules) - {m} for m, p in modules.items()}
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    index, low, on_stack, stack, circles = {}, {}, set(), [], []

    def visit(v):       # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                circles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    assert not circles, f"import circles: {circles}"
