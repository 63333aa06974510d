"""Interop with TRL, verl and OpenRLHF: the same job on the frameworks a learner graduates to (lesson 13).

:mod:`~rlcourse.interop.trl_bridge` maps our settings to TRL's names, exports a checkpoint and a task
as TRL's model and dataset and reports a distributed run; :mod:`~rlcourse.interop.trl_parity` runs
TRL's own GRPO loss on our inputs (the parity tests); :mod:`~rlcourse.interop.trl_grpo` is the script
lesson 13 launches with ``accelerate`` on several processes, with the configs of ``configs/``;
:mod:`~rlcourse.interop.verl_rollout` is verl's sampler correction under its own conventions (lesson 10c);
:mod:`~rlcourse.interop.trl_tools` runs lesson 10e's environment on TRL's ``GRPOTrainer`` (``rollout_func``).
"""
