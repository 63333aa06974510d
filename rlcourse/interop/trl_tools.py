"""Lesson 10e's environment on TRL's ``GRPOTrainer``, and the names verl and OpenRLHF give its pieces.

TRL 1.16 trains agents two ways:

* ``GRPOTrainer(tools=[...])`` or ``environment_factory=``: TRL renders the tools into the prompt
  with the tokenizer's chat template, parses tool calls out of the generated text, runs them, and
  appends the results (``max_tool_calling_iterations`` rounds at most). It refuses a tokenizer whose
  chat template cannot render ``user -> assistant with tool_calls -> tool`` (``supports_tool_calling``):
  the course's character tokenizer has no chat template at all;
* ``GRPOTrainer(rollout_func=...)``: the caller rolls out and returns ``prompt_ids``,
  ``completion_ids``, ``logprobs`` and, for multi-turn episodes, ``env_mask`` (1 on the policy's
  tokens, 0 on the environment's), which TRL multiplies into its loss mask exactly as its own
  ``tool_mask``. This runs with any tokenizer: :func:`trl_rollout_func` wraps
  :func:`rlcourse.lm.multi_turn.rollout` for it.

:class:`TRLCalculatorEnv` is the calculator in the shape ``environment_factory`` expects (a
``reset`` and one public method per tool, with type hints and a Google-style docstring, from which
``transformers`` builds the tool's JSON schema). :func:`grpo_tool_config_kwargs` maps a
:class:`~rlcourse.trainers.multi_turn.MultiTurnConfig` to ``trl.GRPOConfig`` keywords, and
:data:`MULTI_TURN_NAME_MAP` lists the names of the same pieces in TRL, verl and OpenRLHF.
"""
from __future__ import annotations

import torch

from rlcourse.lm.multi_turn import rollout

__all__ = ["MULTI_TURN_NAME_MAP", "TRLCalculatorEnv", "trl_rollout_func", "env_reward", "grpo_tool_config_kwargs"]

# ours -> (TRL 1.16, verl's agent loop, OpenRLHF's agent executor). verl: keys under
# actor_rollout_ref.rollout.multi_turn and the AgentLoop's outputs; OpenRLHF: --agent_func_path's
# AgentInstanceBase (reset, step) and its executor's bookkeeping.
MULTI_TURN_NAME_MAP = {
    "policy_mask": ("tool_mask (0 on tool results; env_mask from a rollout_func)", "response_mask (0 on tool responses)",
                    "action_ranges (the token spans the policy wrote)"),
    "max_turns": ("max_tool_calling_iterations + 1", "multi_turn.max_assistant_turns", "max_steps of the executor"),
    "max_completion_length": ("max_completion_length (tool tokens count)", "rollout.response_length (tool tokens "
                              "count)", "max_length of the executor"),
    "env_factory": ("environment_factory (or tools=[...])", "tool_config_path (BaseTool classes) or an AgentLoop",
                    "--agent_func_path (an AgentInstanceBase)"),
    "env.step": ("a tool method called with parsed arguments", "BaseTool.execute",
                 "AgentInstanceBase.step -> rewards, environment_feedback, done"),
    "logprobs on observations": ("0.0 (tool tokens)", "response_logprobs += 0.0", "not recorded"),
    "response length": ("sum(tool_mask) (completions/mean_length)", "response_mask.sum()",
                        "action_mask.sum() (the span until pull request #1252)"),
}


class TRLCalculatorEnv:
    """The calculator as TRL's ``environment_factory`` expects it: ``reset`` and a ``calc`` tool."""

    def reset(self, **kwargs) -> str | None:
        """Start an episode (TRL passes the dataset row's columns); nothing is appended to the prompt."""
        self.calls = 0
        return None

    def calc(self, a: int, b: int) -> str:
        """Add two non-negative integers.

        Args:
            a: The first number.
            b: The second number.

        Returns:
            The sum of a and b, as text.
        """
        self.calls += 1
        return str(int(a) + int(b))


def env_reward(completions, env_reward, **_columns) -> list[float]:
    """TRL reward function for :func:`trl_rollout_func`: the environment's final reward, forwarded as a column."""
    return [float(r) for r in env_reward]


def trl_rollout_func(task, *, max_turns: int = 4, max_turn_tokens: int = 8, max_completion_length: int = 32,
                     temperature: float = 1.0, seed: int = 0):
    """A ``rollout_func(prompts, trainer) -> dict`` for ``trl.GRPOTrainer`` that runs :func:`rlcourse.lm.multi_turn.rollout`.

    It rolls out one episode per prompt it is handed (in TRL 1.16 the batch holds each prompt
    ``num_generations`` times in a row, as its ``RepeatSampler`` draws it) with ``trainer.model`` and
    ``trainer.processing_class``, and returns lists, one per episode: ``prompt_ids`` (with ``<bos>``, no padding), ``completion_ids`` (policy and environment
    tokens), ``logprobs`` (the sampler's, 0.0 on environment tokens), ``env_mask`` (TRL's name: 1 on
    the policy's tokens) and ``env_reward`` (forwarded to the reward functions: use :func:`env_reward`).
    ``seed`` seeds the sampling stream, which advances call after call.
    """
    generator = torch.Generator().manual_seed(seed)

    def rollout_func(prompts, trainer):
        model = trainer.accelerator.unwrap_model(trainer.model) if hasattr(trainer, "accelerator") else trainer.model
        rows = list(prompts)     # TRL's batch already holds each prompt num_generations times, in a row
        was_training = model.training
        ep = rollout(model, trainer.processing_class, rows, task.make_env, max_turns=max_turns,
                     max_turn_tokens=max_turn_tokens, max_completion_length=max_completion_length,
                     temperature=temperature, generator=generator if next(model.parameters()).device.type == "cpu"
                     else None)
        model.train(was_training)
        out = {"prompt_ids": [], "completion_ids": [], "logprobs": [], "env_mask": [],
               "env_reward": [float(r) for r in ep.rewards]}
        for b in range(len(rows)):
            p, c = ep.prompt_mask[b].bool(), ep.completion_mask[b].bool()
            out["prompt_ids"].append(ep.prompt_ids[b][p].tolist())
            out["completion_ids"].append(ep.completion_ids[b][c].tolist())
            out["logprobs"].append(ep.logprobs[b][c].tolist())
            out["env_mask"].append(ep.policy_mask[b][c].tolist())
        return out

    return rollout_func


def grpo_tool_config_kwargs(config) -> dict:
    """A :class:`~rlcourse.trainers.multi_turn.MultiTurnConfig` as ``trl.GRPOConfig`` keyword arguments.

    Shared names pass as they are (``learning_rate``, ``per_device_train_batch_size``,
    ``num_generations``, ``temperature``, ``epsilon``, ``epsilon_high``, ``loss_type``,
    ``max_completion_length``, ``max_tool_calling_iterations``, ``scale_rewards``, ``max_grad_norm``,
    ``max_steps``, ``seed``), with ``beta=0`` and ``num_iterations=1`` as ours and a constant learning
    rate. Settings TRL 1.16 cannot express raise ``ValueError``: ``mask_observations=False`` (TRL always
    masks tool tokens), ``observation_loss_weight > 0`` and ``reward_mode="per_turn"`` (no such
    options); ``max_turn_tokens`` has no TRL name (a turn may run to the completion budget) and is left out.
    """
    if not config.mask_observations or config.observation_loss_weight or config.reward_mode != "final":
        raise ValueError("TRL 1.16's GRPOTrainer always masks tool tokens, has no loss weight on them and one reward "
                         "per completion: mask_observations=True, observation_loss_weight=0 and reward_mode='final' "
                         f"are needed, got {config.mask_observations!r}, {config.observation_loss_weight!r}, "
                         f"{config.reward_mode!r}")
    shared = ("learning_rate", "per_device_train_batch_size", "num_generations", "temperature", "epsilon",
              "epsilon_high", "loss_type", "max_completion_length", "max_tool_calling_iterations", "scale_rewards",
              "max_grad_norm", "max_steps", "seed")
    kwargs = {name: getattr(config, name) for name in shared}
    kwargs.update(beta=0.0, num_iterations=1, lr_scheduler_type="constant")
    return kwargs
