"""Losses as pure functions on torch tensors, one family per module.

* :mod:`~rlcourse.losses.policy_gradient` - REINFORCE and its weights Psi_t, importance ratios,
  PPO's clipped and penalised surrogates, the value loss, the entropy bonus (lessons 02-08);
* :mod:`~rlcourse.losses.reward_model` - the Bradley-Terry loss of a reward model (lesson 08);
* :mod:`~rlcourse.losses.grpo` - group advantages and the GRPO family's ratios and aggregations
  (lessons 09-10);
* :mod:`~rlcourse.losses.dpo` - DPO and its relatives on preference pairs (lesson 11);
* :mod:`~rlcourse.losses.multi_turn` - multi-turn episodes: the policy mask, per-turn advantages and
  GRPO's loss with the environment's tokens masked or not (lesson 10e);
* :mod:`~rlcourse.losses.distillation` - the per-token reverse KL to a frozen teacher and GKD's
  generalised JSD, exact over the vocabulary (lesson 11c).

Every name is re-exported here, so ``from rlcourse.losses import ppo_clip_loss`` works whatever
module holds it.
"""
from rlcourse.losses.policy_gradient import *  # noqa: F401,F403
from rlcourse.losses.policy_gradient import __all__ as _policy_gradient
from rlcourse.losses.reward_model import *  # noqa: F401,F403
from rlcourse.losses.reward_model import __all__ as _reward_model
from rlcourse.losses.grpo import *  # noqa: F401,F403
from rlcourse.losses.grpo import __all__ as _grpo
from rlcourse.losses.dpo import *  # noqa: F401,F403
from rlcourse.losses.dpo import __all__ as _dpo
from rlcourse.losses.off_policy import *  # noqa: F401,F403
from rlcourse.losses.off_policy import __all__ as _off_policy

__all__ = [*_policy_gradient, *_reward_model, *_grpo, *_dpo, *_off_policy]
from rlcourse.losses.beyond_dpo import *  # noqa: F401,F403,E402  (lesson 11b: SimPO, ORPO, KTO, R-DPO, online DPO)
from rlcourse.losses.beyond_dpo import __all__ as _beyond_dpo  # noqa: E402
__all__ += _beyond_dpo
from rlcourse.losses.multi_turn import *  # noqa: F401,F403,E402  (lesson 10e: multi-turn episodes with a tool)
from rlcourse.losses.multi_turn import __all__ as _multi_turn  # noqa: E402
__all__ += _multi_turn
from rlcourse.losses.distillation import *  # noqa: F401,F403,E402  (lesson 11c: on-policy distillation, GKD's JSD)
from rlcourse.losses.distillation import __all__ as _distillation  # noqa: E402
__all__ += _distillation
# A name exported by two modules would silently mean the later one here (it happened: LOSS_TYPES).
_twice = {name for name in __all__ if __all__.count(name) > 1}
if _twice:
    raise ImportError(f"rlcourse.losses: names exported by two modules: {sorted(_twice)}")
