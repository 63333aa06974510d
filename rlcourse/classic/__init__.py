"""Classic policy-gradient algorithms on small gymnasium environments.

Lessons 02-03 (REINFORCE and variance reduction):

* :mod:`~rlcourse.classic.gradient_estimates` - per-episode Monte-Carlo gradients of a tabular
  softmax policy, to set against the exact gradient of :mod:`rlcourse.tabular`;
* :mod:`~rlcourse.classic.baselines` - batch-mean, moving-average and Monte-Carlo state-value baselines;
* :mod:`~rlcourse.classic.policies` - a tabular softmax policy and a small MLP, with value networks;
* :mod:`~rlcourse.classic.reinforce` - the REINFORCE trainer with four baselines.

Lesson 01 also runs :mod:`~rlcourse.classic.dqn`: Q-learning with a network, experience replay and
a target network, on the gridworld.

Lessons 04-06 build on them: :mod:`~rlcourse.classic.gae_gridworld`,
:mod:`~rlcourse.classic.actor_critic`, :mod:`~rlcourse.classic.trpo` and :mod:`~rlcourse.classic.ppo`.
"""
