"""rlcourse: tested reference implementations behind the course notebooks.

Import this package before torch. It sets how OpenMP threads wait (:data:`OPENMP_DEFAULTS`, each
unless already set); that is its only change to the process environment. The course stays offline
without touching the Hugging Face settings of the user's process: rlcourse loads its checkpoints
from local folders with ``local_files_only=True``, and ``make`` exports ``HF_HUB_OFFLINE=1`` for
the lessons.
"""
import os

# How torch's OpenMP threads wait between parallel operations, measured on the 2-core course machine
# (`python -m rlcourse.bench openmp-wait`, BENCHMARKS.md). OpenMP's default, spinning for ~3 ms,
# made torch 4-15x slower whenever another process was busy: the spinning thread holds the core
# the other one needs. Sleeping at once (PASSIVE) makes every small parallel op wait for its helper
# thread to wake up (~50 us here): a GRPO step on the tiny GPT took 29.6 ms. A short spin first
# (GOMP_SPINCOUNT=1000, about 10 us) brought it to 18.5 ms alone; with two busy processes on the
# two cores it cost 34 ms against PASSIVE's 20 (a 3x longer spin: 56 ms).
OPENMP_DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "1000"}
for _name, _value in OPENMP_DEFAULTS.items():
    os.environ.setdefault(_name, _value)

__version__ = "0.1.0"


def _register_envs():
    # gymnasium.make("rlcourse/GridWorld-v0", layout="maze2x3") works after `import rlcourse`.
    import gymnasium

    if "rlcourse/GridWorld-v0" not in gymnasium.registry:
        gymnasium.register(id="rlcourse/GridWorld-v0", entry_point="rlcourse.envs.gridworld:GridWorld",
                           max_episode_steps=100)


_register_envs()
