"""Tasks, and the rewards that score them: what a policy is asked, and how its answer is judged.

The verifiable tasks on the tiny GPT (:mod:`~rlcourse.tasks.arithmetic`: addition, addition with
thinking dots, digit sums; lessons 07, 09-10c, 12), the preference task and its raters
(:mod:`~rlcourse.tasks.preference`, lessons 08-08b, 11-11b), verifiers and weighted reward functions
(:mod:`~rlcourse.tasks.verifiers`, lesson 10b), reward models trained on preference pairs
(:mod:`~rlcourse.tasks.reward_model`, lessons 08-08b) and a calculator environment with the task it
helps on (:mod:`~rlcourse.tasks.tool_env`, lesson 10e), and a generative judge with its rubric, ensemble and
mined-negative helpers (:mod:`~rlcourse.tasks.judge`, lesson 10d). A task is ``prompts(n, rng)``,
``test_prompts(n)``, ``reward(prompts, completions)`` and ``max_new_tokens``: every trainer of
:mod:`rlcourse.trainers` takes one.
"""
from rlcourse.tasks.arithmetic import AdditionTask, DigitSumTask, FillerAdditionTask
from rlcourse.tasks.preference import PreferenceTask

__all__ = ["AdditionTask", "DigitSumTask", "FillerAdditionTask", "PreferenceTask"]
