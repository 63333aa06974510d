"""The course's plotting style and the widgets' static pictures (rlcourse.viz, rlcourse.widgets)."""
import numpy as np

import rlcourse  # noqa: F401  (before torch)
from rlcourse import viz, widgets


def test_use_course_style_sets_readable_defaults():
    import matplotlib.pyplot as plt
    with plt.rc_context():
        viz.use_course_style()
        assert plt.rcParams["font.size"] >= 12
        width_px = plt.rcParams["figure.figsize"][0] * plt.rcParams["figure.dpi"]
        assert width_px <= viz.MAX_FIGURE_WIDTH * plt.rcParams["figure.dpi"] <= 850


def test_moving_average_divides_partial_windows_by_their_length():
    np.testing.assert_allclose(viz.moving_average([2.0, 4.0, 6.0, 8.0], 3), [2.0, 3.0, 4.0, 6.0])


def test_explorer_draws_a_static_picture_of_its_default_setting(monkeypatch):
    import matplotlib.pyplot as plt
    from IPython.core.interactiveshell import InteractiveShell
    shown = []
    monkeypatch.setattr(plt, "show", lambda: (shown.append(plt.gcf().axes[0].get_title()), plt.close("all")))
    w = widgets.ppo_clip_explorer(clip_coef=0.3, advantage=-2.0)
    shown.clear()                       # the live widget drew once when it was built
    shell = InteractiveShell.instance()
    shell.display_formatter.format(w)   # what displaying it in a notebook does
    assert len(shown) == 1 and "ε = 0.3" in shown[0] and "A = -2" in shown[0], shown
