"""Classic policy-gradient algorithms on small gymnasium environments.

* :mod:`~rlcourse.classic.gradient_estimates` - per-episode Monte-Carlo gradients of a tabular
  softmax policy, to compare with the exact gradient of :mod:`rlcourse.tabular`;
* :mod:`~rlcourse.classic.policies` - a tabular softmax policy and a small MLP, with value baselines;
* :mod:`~rlcourse.classic.reinforce` - the REINFORCE trainer with four baselines.
"""
