"""The grader runs the learner's function in a worker process and judges it where no learner code ran.

Two layers: :mod:`rlcourse.tools.grade_wire` (what crosses between the processes: values,
in-place changes, identity, gradients; nothing from the worker unpickled as code), then whole
checks through :func:`rlcourse.tools.grade_runner.run_one`, with honest answers (they must still
pass), wrong ones (they must still fail) and the cheats a learner could try.
"""
import copy
import dataclasses
import pickle
import sys

import numpy as np
import pytest

import rlcourse  # noqa: F401  (before torch)
import cloudpickle
import torch
import torch.nn.functional as F

from rlcourse.measure.capstone import CapstoneConfig
from rlcourse.losses.dpo import _check_beta, dpo_logratio_margin   # what a pasted reference imports
from rlcourse.tools import grade_runner
from rlcourse.tools import grade_wire as wire

cloudpickle.register_pickle_by_value(sys.modules[__name__])   # the answers below travel by value


# --------------------------------------------------------------------------------- the wire
def round_trip(value, args=(), kwargs=None):
    """Encode in 'the worker', decode in 'the judge' (both here), with the given call's arguments."""
    kwargs = kwargs or {}
    value, worker_args, worker_kwargs = copy.deepcopy((value, args, kwargs))   # the worker's copies
    paths = {id(obj): path for path, obj in wire.object_paths(worker_args, worker_kwargs)}
    tree = wire.loads(wire.dumps(wire.Encoder(paths).encode(value)))
    return wire.Decoder(None, dict(wire.object_paths(args, kwargs))).decode(tree)


@dataclasses.dataclass
class Report:
    world_size: int
    checksums: list


class LearnerThing:
    def __init__(self):
        self.x = np.arange(3)


def test_values_come_back_equal_and_typed():
    value = {"a": [1, 2.5, "s", None, True], "t": torch.arange(4.0), "n": np.float64(0.25), "i": np.int32(3),
             "arr": np.linspace(0, 1, 5, dtype=np.float32), "u": np.array([1, 2], dtype=np.uint32),
             "nested": ((1, 2), {3, 4}), "dtype": torch.float64, "shape": torch.Size([2, 3]),
             "report": Report(2, ["x", "y"]), "strs": np.array(["a", "b"]), "config": CapstoneConfig(budget=3)}
    got = round_trip(value)
    assert got["a"] == value["a"] and torch.equal(got["t"], value["t"])
    assert type(got["n"]) is np.float64 and got["n"] == 0.25 and type(got["i"]) is np.int32
    assert got["arr"].dtype == np.float32 and np.array_equal(got["arr"], value["arr"])
    assert got["u"].dtype == np.uint32 and got["strs"].tolist() == ["a", "b"]
    assert got["nested"] == ((1, 2), {3, 4}) and got["dtype"] is torch.float64 and got["shape"] == torch.Size([2, 3])
    assert got["config"] == CapstoneConfig(budget=3)                     # a class of the course: rebuilt
    assert isinstance(got["report"], wire.Opaque) and got["report"].checksums == ["x", "y"]   # the notebook's: read-only


def test_shared_and_cyclic_structures_survive():
    inner = [1, 2]
    outer = [inner, inner]
    outer.append(outer)
    got = round_trip(outer)
    assert got[0] is got[1] and got[2] is got


def test_an_object_of_the_notebooks_own_class_comes_back_read_only():
    got = round_trip(LearnerThing())
    assert isinstance(got, wire.Opaque) and got.x.tolist() == [0, 1, 2]


def test_an_argument_returned_comes_back_as_the_judges_own_object():
    model = torch.nn.Linear(2, 2)
    target = [np.zeros(3), model]
    assert round_trip(target, args=(target,)) is target
    got = round_trip([target[1].weight, target[1], torch.zeros(1)], args=(target,))
    assert got[0] is model.weight and got[1] is model and got[2] is not None


def test_nothing_from_the_worker_is_unpickled_as_code():
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))
    with pytest.raises(wire.WireError):
        wire.loads(pickle.dumps(("return", Evil()), protocol=2))


def test_in_place_changes_are_copied_onto_the_judges_objects():
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Dropout(0.1))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(0)
    rng = np.random.default_rng(0)
    judge = (model, opt, gen, rng, [1, 2], {"k": np.zeros(2)}, torch.zeros(2), Report(1, []))
    worker = copy.deepcopy(judge)
    m, o, g, r, lst, d, t, rep = worker
    m(torch.ones(1, 3)).sum().backward()
    o.step()
    m.eval()
    torch.rand(3, generator=g)
    r.random()
    lst.append(3)
    d["k"][0] = 7.0
    t += 1
    rep.world_size = 4
    tree = wire.loads(wire.dumps(wire.Encoder().encode((worker, {}))))
    mirror = wire.Decoder(None, dict(wire.object_paths(judge, {})))
    for target, node in zip(judge, tree[1][0][1]):
        mirror.mirror(target, node)
    assert torch.equal(model[0].weight, m[0].weight) and torch.equal(model[0].weight.grad, m[0].weight.grad)
    assert not model.training and not model[1].training
    assert opt.state_dict()["state"][0]["step"] == 1
    assert torch.equal(torch.rand(3, generator=gen), torch.rand(3, generator=g))
    assert rng.random() == r.random()
    assert judge[4] == [1, 2, 3] and judge[5]["k"][0] == 7.0 and judge[6].tolist() == [1.0, 1.0]
    assert judge[7].world_size == 4


def test_an_untouched_tensor_holding_nan_is_left_alone():
    t = torch.tensor([float("nan"), 1.0])
    version = t._version
    wire.Decoder(None).mirror(t, wire.loads(wire.dumps(wire.Encoder().encode(t.clone()))))
    assert t._version == version


# --------------------------------------------------------------------------------- whole checks
def run(check: str, answer, tmp_path) -> dict:
    path = tmp_path / f"{answer.__name__}.pkl"
    with open(path, "wb") as f:
        cloudpickle.dump(((answer,), {}), f)
    return grade_runner.run_one({"check": check, "file": str(path)}, timeout=120)


def dpo_ok(cw, cl, rw, rl, beta):
    return -F.logsigmoid(beta * ((cw - rw) - (cl - rl)))


def dpo_no_beta(cw, cl, rw, rl, beta):
    return -F.logsigmoid((cw - rw) - (cl - rl))


def dpo_calls_the_reference(cw, cl, rw, rl, beta):
    from rlcourse.losses import dpo_sigmoid_loss
    return dpo_sigmoid_loss(cw, cl, rw, rl, beta)


def dpo_reference_in_a_thread(cw, cl, rw, rl, beta):
    import threading
    from rlcourse.losses import dpo_sigmoid_loss
    out = []
    worker = threading.Thread(target=lambda: out.append(dpo_sigmoid_loss(cw, cl, rw, rl, beta)))
    worker.start()
    worker.join()
    return out[0] if out else dpo_ok(cw, cl, rw, rl, beta)


def dpo_reference_unprofiled(cw, cl, rw, rl, beta):
    import sys
    from rlcourse.losses import dpo_sigmoid_loss
    sys.setprofile(None)
    return dpo_sigmoid_loss(cw, cl, rw, rl, beta)


def dpo_patches_the_grader(cw, cl, rw, rl, beta):
    import sys
    for name, module in list(sys.modules.items()):
        if name.startswith("rlcourse.grading"):
            for helper in ("fail", "assert_close", "fail_if_mistake", "passed"):
                if hasattr(module, helper):
                    setattr(module, helper, lambda *a, **k: None)
    return cw * 0


def dpo_reloads_the_reference(cw, cl, rw, rl, beta):
    import importlib
    import rlcourse.losses.dpo as dpo
    importlib.reload(dpo)
    return dpo.dpo_sigmoid_loss(cw, cl, rw, rl, beta)


def _pasted(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, beta):
    _check_beta(beta)
    h = dpo_logratio_margin(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps)
    return -F.logsigmoid(beta * h)


def dpo_with_a_pasted_helper(cw, cl, rw, rl, beta):
    return _pasted(cw, cl, rw, rl, beta)


def dpo_through_the_robust_loss(cw, cl, rw, rl, beta):      # label_smoothing=0 is DPO itself
    from rlcourse.losses.dpo import robust_dpo_loss
    return robust_dpo_loss(cw, cl, rw, rl, beta, 0.0)


def fit_with_the_library_trainer(bandit, pairs, beta):
    from rlcourse.measure.categorical_bandit import train_tabular_policy
    return train_tabular_policy(bandit, pairs, beta)["logprobs"]


def fit_by_returning_the_closed_form(bandit, pairs, beta):
    return bandit.optimal_logprobs(beta)


@pytest.mark.parametrize("check, answer, says", [
    ("check_dpo_loss", dpo_through_the_robust_loss, "rlcourse.losses.dpo:robust_dpo_loss"),
    ("check_fit_dpo_policy", fit_with_the_library_trainer, "rlcourse.measure.categorical_bandit:train_tabular_policy"),
    ("check_fit_dpo_policy", fit_by_returning_the_closed_form, "CategoricalBandit.optimal_logprobs"),
], ids=lambda x: getattr(x, "__name__", None) if callable(x) else None)
def test_a_library_function_that_computes_the_answer_is_a_reference(check, answer, says, tmp_path):
    result = run(check, answer, tmp_path)
    assert result["outcome"] == "reference" and says in result["message"], result


@pytest.mark.parametrize("answer, outcome, says", [
    (dpo_ok, "passed", "✔ check_dpo_loss"),
    (dpo_no_beta, "failed", "beta is missing"),
    (dpo_calls_the_reference, "reference", "calls the reference rlcourse.losses.dpo:dpo_sigmoid_loss"),
    (dpo_reference_in_a_thread, "reference", "calls the reference"),
    (dpo_reference_unprofiled, "reference", "calls the reference"),
    (dpo_patches_the_grader, "failed", "expected"),
    (dpo_reloads_the_reference, "reference", "executed again"),
    (dpo_with_a_pasted_helper, "reference", "copy of the reference implementation rlcourse.losses.dpo:dpo_sigmoid_loss"),
], ids=lambda x: getattr(x, "__name__", None) if callable(x) else None)
def test_the_verdict_is_the_judges(answer, outcome, says, tmp_path):
    result = run("check_dpo_loss", answer, tmp_path)
    assert result["outcome"] == outcome and says in result["message"], result


def entropy_ok(logits, temperature):
    logp = torch.log_softmax(logits / temperature, -1)
    return -(logp.exp() * logp).sum(-1)


def entropy_detached(logits, temperature):
    return entropy_ok(logits.detach(), temperature)


def q_update_in_place(Q, s, a, r, s_next, terminated, alpha, gamma):
    target = r if terminated else r + gamma * np.max(Q[s_next])
    Q[s, a] += alpha * (target - Q[s, a])
    return Q


def cg_ok(Avp, b, iters):
    x = torch.zeros_like(b)
    r, p = b.clone(), b.clone()
    rr = r @ r
    for _ in range(iters):
        if rr == 0:
            break
        Ap = Avp(p)
        alpha = rr / (p @ Ap)
        x, r = x + alpha * p, r - alpha * Ap
        rr_new = r @ r
        p, rr = r + (rr_new / rr) * p, rr_new
    return x


def cg_two_products(Avp, b, iters):
    x = cg_ok(Avp, b, iters)
    Avp(x)
    return x


def reward_func_ok(task):
    def reward(prompts, completions, **columns):
        return [float(r) for r in task.reward(list(prompts), list(completions))]
    reward.__name__ = f"{type(task).__name__}_reward"
    return reward


def grpo_kwargs_never_refuses(config, task):
    from rlcourse.interop.trl_bridge import OURS_ONLY
    return {k: v for k, v in dataclasses.asdict(config).items() if k not in OURS_ONLY}


@pytest.mark.parametrize("check, answer, outcome, says", [
    ("check_token_entropy", entropy_ok, "passed", "✔"),                      # gradients come back
    ("check_token_entropy", entropy_detached, "failed", "a result computed from the inputs by autograd"),
    ("check_q_learning_update", q_update_in_place, "failed", "in place"),      # in-place changes come back
    ("check_conjugate_gradient", cg_ok, "passed", "✔"),                       # the judge's callback, counted
    ("check_conjugate_gradient", cg_two_products, "failed", "matrix-vector products"),
    ("check_reward_func", reward_func_ok, "passed", "✔"),                     # a returned function, called back
    ("check_grpo_kwargs", grpo_kwargs_never_refuses, "failed", ""),           # the learner's errors keep their type
])
def test_a_call_in_the_worker_looks_like_a_call_here(check, answer, outcome, says, tmp_path):
    result = run(check, answer, tmp_path)
    assert result["outcome"] == outcome and says in result["message"], result


def test_a_learner_function_copied_is_the_same_function(tmp_path):
    """A trainer that copies its reward once per seed (the seed-batched one) copies the learner's function as
    Python copies a plain function: the copy is the function, and calls the worker's."""
    path = tmp_path / "answer.pkl"
    with open(path, "wb") as f:
        cloudpickle.dump(((dpo_ok,), {}), f)
    session = grade_runner.Session(str(path), {}, timeout=60)
    try:
        answer = session.answer
        assert copy.deepcopy(answer) is answer and copy.copy(answer) is answer
        assert copy.deepcopy({"reward": [answer]})["reward"][0] is answer
        x = torch.zeros(2)
        assert torch.allclose(copy.deepcopy(answer)(x, x, x, x, 0.1), torch.full((2,), 0.6931), atol=1e-4)
    finally:
        session.close()


def not_done(*args):
    raise NotImplementedError("write this function")


def crashes(*args):
    return [][1]


def exits(*args):
    import os
    os._exit(3)


@pytest.mark.parametrize("answer, outcome, says", [
    (not_done, "not implemented", "write this function"),
    (crashes, "error", "IndexError"),
    (exits, "error", "stopped"),
])
def test_unfinished_crashing_and_dying_answers(answer, outcome, says, tmp_path):
    result = run("check_dpo_loss", answer, tmp_path)
    assert result["outcome"] == outcome and says in result["message"], result
