"""Lesson 13's checks pass reference answers and catch plausible wrong ones."""
import dataclasses

import pytest

import rlcourse  # noqa: F401

from rlcourse.grading import CheckFailed
from rlcourse.grading.llm.lesson13 import check_grpo_kwargs, check_really_distributed, check_reward_func
from rlcourse.interop.trl_bridge import OURS_ONLY, grpo_config_kwargs, task_reward_func


# ---------------------------------------------------------------- check_grpo_kwargs
def kwargs_by_hand(config, task):
    out = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if f.name in ("std_floor", "advantage_estimator", "baseline_decay", "kl_in_reward", "dynamic_sampling",
                      "max_num_gen_batches", "overlong_buffer_len", "overlong_penalty_factor", "ratio_against_sampler"):
            if f.name not in ("baseline_decay", "max_num_gen_batches", "overlong_penalty_factor") and value != f.default:
                raise ValueError(f"{f.name} has no GRPOConfig equivalent")
            continue
        out[f.name] = value
    out["max_completion_length"] = config.max_completion_length or task.max_new_tokens
    out["lr_scheduler_type"] = "constant"
    out["max_steps"] = config.max_steps * config.num_iterations
    return out


def kwargs_max_steps_unchanged(config, task):
    out = grpo_config_kwargs(config, task)
    out["max_steps"] = config.max_steps      # TRL counts optimiser steps: half the batches at num_iterations=2
    return out


def kwargs_everything(config, task):
    return {**dataclasses.asdict(config), "max_completion_length": config.max_completion_length or task.max_new_tokens,
            "lr_scheduler_type": "constant", "max_steps": config.max_steps * config.num_iterations}


def kwargs_unresolved_length(config, task):
    out = grpo_config_kwargs(config, task)
    out["max_completion_length"] = config.max_completion_length
    return out


def kwargs_default_schedule(config, task):
    out = grpo_config_kwargs(config, task)
    del out["lr_scheduler_type"]
    return out


def kwargs_silent(config, task):
    return grpo_config_kwargs(dataclasses.replace(config, **{k: v for k, v in OURS_ONLY.items() if v is not None}), task)


def kwargs_drops_beta(config, task):
    out = grpo_config_kwargs(config, task)
    out.pop("beta")
    return out


def kwargs_mutates(config, task):
    config.max_completion_length = config.max_completion_length or task.max_new_tokens
    return grpo_config_kwargs(config, task)


def test_grpo_kwargs_check_passes_references(capsys):
    check_grpo_kwargs(grpo_config_kwargs)
    check_grpo_kwargs(kwargs_by_hand)
    assert "check_grpo_kwargs: all 9 cases passed" in capsys.readouterr().out


def test_grpo_kwargs_check_names_the_step_count_mapping():
    with pytest.raises(CheckFailed, match="optimiser steps"):
        check_grpo_kwargs(kwargs_max_steps_unchanged)


@pytest.mark.parametrize("wrong", [kwargs_everything, kwargs_unresolved_length, kwargs_default_schedule,
                                   kwargs_silent, kwargs_drops_beta, kwargs_mutates, kwargs_max_steps_unchanged])
def test_grpo_kwargs_check_catches(wrong):
    with pytest.raises(CheckFailed):
        check_grpo_kwargs(wrong)


def test_grpo_kwargs_lets_not_implemented_through():
    def todo(config, task):
        raise NotImplementedError
    with pytest.raises(NotImplementedError):
        check_grpo_kwargs(todo)


# ---------------------------------------------------------------- check_reward_func
def reward_by_hand(task):
    def reward(prompts, completions, **kwargs):
        return task.reward(prompts, completions).tolist()
    reward.__name__ = type(task).__name__ + "_reward"
    return reward


def reward_no_kwargs(task):
    def reward(prompts, completions):
        return [float(x) for x in task.reward(prompts, completions)]
    reward.__name__ = type(task).__name__ + "_reward"
    return reward


def reward_tensor(task):
    def reward(prompts, completions, **kwargs):
        return task.reward(prompts, completions)
    reward.__name__ = type(task).__name__ + "_reward"
    return reward


def reward_lambda(task):
    return lambda prompts, completions, **kwargs: [float(x) for x in task.reward(prompts, completions)]


def reward_binary(task):
    def reward(prompts, completions, **kwargs):
        return [float(x > 0) for x in task.reward(prompts, completions)]
    reward.__name__ = type(task).__name__ + "_reward"
    return reward


def reward_stripped_prompts(task):
    def reward(prompts, completions, **kwargs):
        return [float(x) for x in task.reward(prompts, [c.strip() for c in completions])]
    reward.__name__ = type(task).__name__ + "_reward"
    return reward


def reward_result_not_function(task):
    return [0.0]


def reward_numpy_floats(task):          # right: TRL builds a tensor from the list, NumPy numbers included
    def reward(prompts, completions, **kwargs):
        return list(task.reward(prompts, completions).double().numpy())
    reward.__name__ = f"{type(task).__name__}_reward"
    return reward


def test_reward_func_check_passes_references(capsys):
    check_reward_func(task_reward_func)
    check_reward_func(reward_by_hand)
    check_reward_func(reward_numpy_floats)
    assert "check_reward_func: all 3 cases passed" in capsys.readouterr().out


@pytest.mark.parametrize("wrong", [reward_no_kwargs, reward_tensor, reward_lambda, reward_binary,
                                   reward_stripped_prompts, reward_result_not_function])
def test_reward_func_check_catches(wrong):
    with pytest.raises(CheckFailed):
        check_reward_func(wrong)


# ---------------------------------------------------------------- check_really_distributed
def distributed_ok(report, requested_processes):
    sums = report["checksums"]
    return report["world_size"] == requested_processes == len(sums) and len(set(sums)) == 1


def distributed_world_only(report, requested_processes):
    return report["world_size"] == requested_processes


def distributed_flag_only(report, requested_processes):
    return bool(report["replicas_identical"])


def distributed_more_than_one(report, requested_processes):
    return report["world_size"] > 1 and len(set(report["checksums"])) == 1


def distributed_first_two(report, requested_processes):
    return report["world_size"] == requested_processes and report["checksums"][0] == report["checksums"][-1]


def distributed_truthy(report, requested_processes):
    return int(distributed_ok(report, requested_processes))


def distributed_trusts_the_flag(report, requested_processes):   # the report's summary, not its evidence
    return report["world_size"] == requested_processes == len(report["checksums"]) and report["replicas_identical"]


def test_a_check_of_the_distributed_run_that_trusts_the_summary_flag_is_told_why():
    with pytest.raises(CheckFailed, match="compare the checksums themselves"):
        check_really_distributed(distributed_trusts_the_flag)


def distributed_pops(report, requested_processes):
    sums = report.pop("checksums")
    return report["world_size"] == requested_processes == len(sums) and len(set(sums)) == 1


def test_really_distributed_check_passes_reference(capsys):
    check_really_distributed(distributed_ok)
    assert "check_really_distributed: all 10 cases passed" in capsys.readouterr().out


@pytest.mark.parametrize("wrong", [distributed_world_only, distributed_flag_only, distributed_more_than_one,
                                   distributed_first_two, distributed_truthy, distributed_pops,
                                   distributed_trusts_the_flag])
def test_really_distributed_check_catches(wrong):
    with pytest.raises(CheckFailed):
        check_really_distributed(wrong)


# ---------------------------------------------------------------- the bridge functions the checks rely on
def test_bridge_kwargs_build_trl_configs_that_hold_our_values(tmp_path):
    import trl

    from rlcourse.tasks import AdditionTask
    from rlcourse.trainers.dpo import DPOConfig
    from rlcourse.trainers.policy_gradient import PolicyGradientConfig
    from rlcourse.interop.trl_bridge import dpo_config_kwargs

    ours = PolicyGradientConfig(beta=0.04, epsilon_high=0.28, loss_type="dr_grpo", learning_rate=3e-5)
    kwargs = grpo_config_kwargs(ours, AdditionTask())
    theirs = trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[], **kwargs)
    for key in ("beta", "epsilon_high", "loss_type", "learning_rate", "num_generations", "temperature"):
        assert getattr(theirs, key) == getattr(ours, key), key
    assert theirs.max_completion_length == AdditionTask().max_new_tokens
    assert getattr(theirs.lr_scheduler_type, "value", theirs.lr_scheduler_type) == "constant"
    with pytest.raises(ValueError, match="advantage_estimator"):
        grpo_config_kwargs(PolicyGradientConfig(advantage_estimator="rloo"), AdditionTask())
    with pytest.raises(ValueError, match="task"):
        grpo_config_kwargs(PolicyGradientConfig())
    dpo = DPOConfig(beta=0.5, loss_type="ipo", max_steps=7)
    trl_dpo = trl.DPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[], **dpo_config_kwargs(dpo))
    assert (trl_dpo.beta, trl_dpo.max_steps, trl_dpo.warmup_steps) == (0.5, 7, 0)
    for other in ("simpo", "orpo", "kto"):     # other trainers in TRL: refused, not silently run as DPO
        with pytest.raises(ValueError, match=other):
            dpo_config_kwargs(DPOConfig(loss_type=other))
    with pytest.raises(ValueError, match="rdpo_alpha"):
        dpo_config_kwargs(DPOConfig(rdpo_alpha=0.1))


def test_preference_dataset_keeps_the_three_columns_and_rejects_others():
    from rlcourse.interop.trl_bridge import preference_dataset

    data = preference_dataset([{"prompt": "a", "chosen": "b", "rejected": "c", "extra": 1}])
    assert data.column_names == ["prompt", "chosen", "rejected"] and data[0]["chosen"] == "b"
    with pytest.raises(ValueError, match="rejected"):
        preference_dataset([{"prompt": "a", "chosen": "b"}])
    with pytest.raises(ValueError):
        preference_dataset([])
