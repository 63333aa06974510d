"""``python -m rlcourse <command>``: the course's command line.

Commands:
    grade [PATH ...]   grade exercise notebooks (default: exercises/) and print a score table;
                       `grade --help` lists its options (--csv, --manifests, --solutions)
    info               where the course runs: device, threads, profile
"""
import sys


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv.pop(0) if argv else "help"
    if command == "grade":
        from rlcourse.tools.grade import main as grade

        return grade(argv)
    if command == "info":
        from rlcourse import runtime

        print(runtime.describe())
        return 0
    print(__doc__)
    return 0 if command in ("help", "-h", "--help") else 2


if __name__ == "__main__":
    sys.exit(main())
