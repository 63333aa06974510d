import importlib
import pkgutil
import sys

import rlcourse.bench as bench


def available() -> list[str]:
    return sorted(m.name.replace("_", "-") for m in pkgutil.iter_modules(bench.__path__)
                  if not m.name.startswith("_"))


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(bench.__doc__)
        print("available:", ", ".join(available()) or "(none yet)")
        return 0
    name = argv[0]
    if name not in available():
        print(f"unknown benchmark {name!r}; available: {', '.join(available())}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"rlcourse.bench.{name.replace('-', '_')}")
    return module.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
