"""rlcourse: tested reference implementations behind the course notebooks.

Import this package before torch. It sets ``OMP_WAIT_POLICY=PASSIVE`` first (unless already set):
on a busy 2-core machine, OpenMP threads that spin while waiting made torch 10-15x slower.
That is its only change to the process environment. The course stays offline without touching
the Hugging Face settings of the user's process: rlcourse loads its checkpoints from local
folders with ``local_files_only=True``, and ``make`` exports ``HF_HUB_OFFLINE=1`` for the lessons.
"""
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"


def _register_envs():
    # gymnasium.make("rlcourse/GridWorld-v0", layout="maze2x3") works after `import rlcourse`.
    import gymnasium

    if "rlcourse/GridWorld-v0" not in gymnasium.registry:
        gymnasium.register(id="rlcourse/GridWorld-v0", entry_point="rlcourse.envs.gridworld:GridWorld",
                           max_episode_steps=100)


_register_envs()
