"""rlcourse.viz.wrap: printed lines that fit JupyterLab's column, intervals kept whole."""
import rlcourse  # noqa: F401
from rlcourse.viz import wrap


def test_wrap_keeps_lines_short_and_intervals_whole():
    text = "; ".join(f"method {i} minus baseline +0.{i}23 +- 0.0{i}5" for i in range(1, 9))
    lines = wrap(text).splitlines()
    assert len(lines) > 1 and all(len(line) <= 100 for line in lines)
    assert all(line.startswith("    ") for line in lines[1:])
    assert all("+-" not in (line.strip()[:2], line.strip()[-2:]) for line in lines)  # never split at the sign
    assert " ".join(line.strip() for line in lines) == text
    assert wrap("short") == "short" and wrap("a ± b " * 30, width=40).count("±") == 30
