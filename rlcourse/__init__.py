"""rlcourse: tested reference implementations behind the course notebooks.

Import this package before torch. It sets ``OMP_WAIT_POLICY=PASSIVE`` first: on a busy 2-core
machine, OpenMP threads that spin while waiting made torch 10-15x slower.
"""
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# The course never downloads anything: models are trained by rlcourse itself.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

__version__ = "0.1.0"


def _register_envs():
    # gymnasium.make("rlcourse/GridWorld-v0", layout="maze2x3") works after `import rlcourse`.
    import gymnasium

    if "rlcourse/GridWorld-v0" not in gymnasium.registry:
        gymnasium.register(id="rlcourse/GridWorld-v0", entry_point="rlcourse.envs.gridworld:GridWorld",
                           max_episode_steps=100)


_register_envs()
