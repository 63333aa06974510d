"""The experiment checks (one per lesson): a working loop or measurement passes, plausible wrong ones fail.

The right answers here are written from the exercise's text, independently of the solution notebooks.
"""
import numpy as np
import pytest

import rlcourse  # noqa: F401  (before torch)
import torch

import rlcourse.grading as grading
from rlcourse import losses, returns, tabular
from rlcourse.classic import baselines, trpo
from rlcourse.classic.gradient_estimates import sample_episodes, softmax_score_gradients
from rlcourse.grading._core import CheckFailed


def q_learning_run(env, episodes, alpha, gamma, epsilon, seed, explore=True, keep=True):
    rng = np.random.default_rng(seed)
    Q = np.zeros((env.observation_space.n, env.action_space.n))
    env.reset(seed=seed)
    for _ in range(episodes):
        s, _ = env.reset()
        for _ in range(100):
            ties = np.flatnonzero(Q[s] == Q[s].max())
            a = int(rng.integers(4)) if explore and rng.random() < epsilon else int(rng.choice(ties) if explore else ties[0])
            s_next, r, terminated, truncated, _ = env.step(a)
            updated = tabular.q_learning_update(Q, s, a, r, s_next, terminated, alpha, gamma)
            Q = updated if keep else Q
            s = s_next
            if terminated or truncated:
                break
    return Q


def reinforce_gridworld(env, iterations, episodes_per_update, lr, seed, sign=1.0):
    rng, mdp = np.random.default_rng(seed), env.mdp
    theta = np.zeros((mdp.n_states, mdp.n_actions))
    for _ in range(iterations):
        batch = sample_episodes(mdp, tabular.softmax_policy(theta), episodes_per_update, rng, reward_table=env.reward_table)
        G = returns.reward_to_go(batch.rewards, 0.9, mask=batch.mask)
        g = softmax_score_gradients(theta, batch, G * returns.discount_weights(batch.mask, 0.9)).mean(0)
        theta = theta + sign * lr * g
    return theta


def baseline_variance(env, theta, n_episodes, use_baseline, seed, of_the_mean=False):
    batch = sample_episodes(env.mdp, tabular.softmax_policy(theta), n_episodes, np.random.default_rng(seed),
                            reward_table=env.reward_table)
    G = returns.reward_to_go(batch.rewards, 0.9, mask=batch.mask)
    if use_baseline:
        G = (G - baselines.batch_mean_baseline(G, batch.mask)) * batch.mask
    g = softmax_score_gradients(theta, batch, G * returns.discount_weights(batch.mask, 0.9))
    return g.mean(0), g.var(0).sum() / (n_episodes if of_the_mean else 1)


def batch_td_critic(V0, states, rewards, next_states, terminated, gamma, lr, sweeps, bootstrap_terminal=False, total=False):
    V = np.array(V0, dtype=float)
    counts = 1 if total else np.maximum(np.bincount(states, minlength=len(V)), 1)
    alive = 1.0 if bootstrap_terminal else 1.0 - terminated
    for _ in range(sweeps):
        delta = rewards + gamma * alive * V[next_states] - V[states]
        V = V + lr * np.bincount(states, weights=delta, minlength=len(V)) / counts
    return V


def cg_residual_curve(A, b, max_iters, first=0, relative=False):
    norms = [float(torch.linalg.norm(b))] + [
        float(torch.linalg.norm(b - A @ trpo.conjugate_gradient(lambda v: A @ v, b, k, tol=0.0))) for k in range(1, max_iters + 1)]
    return [n / (norms[0] if relative else 1.0) for n in norms][first:]


def update_kl(old_logits, states, actions, advantages, clip_coef, epochs, lr, optimizer=torch.optim.Adam, reverse=False):
    theta = old_logits.clone().requires_grad_(True)
    opt = optimizer([theta], lr=lr)
    old_logp = torch.log_softmax(old_logits, -1)[states, actions]
    for _ in range(epochs):
        loss = losses.ppo_clip_loss(torch.log_softmax(theta, -1)[states, actions], old_logp, advantages, clip_coef=clip_coef)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        a, b = torch.log_softmax(old_logits, -1), torch.log_softmax(theta, -1)
        a, b = (b, a) if reverse else (a, b)
        return float((a.exp() * (a - b)).sum(-1)[states].mean())


def kl_estimators(logits_p, logits_q, n_samples, seed, uniform=False):
    g = torch.Generator().manual_seed(seed)
    logp_all, logq_all = torch.log_softmax(logits_p, -1), torch.log_softmax(logits_q, -1)
    weights = torch.ones_like(logp_all) if uniform else logp_all.exp()
    x = torch.multinomial(weights, n_samples, replacement=True, generator=g)
    log_r = logq_all[x] - logp_all[x]
    k1, k3 = -log_r, log_r.exp() - 1 - log_r
    return {"k1": (k1.mean(), k1.std()), "k3": (k3.mean(), k3.std())}


def with_(fn, **options):
    def wrong(*args):
        return fn(*args, **options)
    wrong.__name__ = f"{fn.__name__}({', '.join(f'{k}={v!r}' for k, v in options.items())})"
    return wrong


RIGHT = {"check_q_learning_run": q_learning_run, "check_reinforce_gridworld": reinforce_gridworld,
         "check_baseline_variance": baseline_variance, "check_batch_td_critic": batch_td_critic,
         "check_cg_residual_curve": cg_residual_curve, "check_update_kl": update_kl,
         "check_kl_estimators": kl_estimators}
WRONG = [("check_q_learning_run", with_(q_learning_run, explore=False), "suboptimal"),
         ("check_q_learning_run", with_(q_learning_run, keep=False), "suboptimal"),
         ("check_reinforce_gridworld", with_(reinforce_gridworld, sign=-1.0), "J\\(theta\\)"),
         ("check_baseline_variance", with_(baseline_variance, of_the_mean=True), "total variance"),
         ("check_batch_td_critic", with_(batch_td_critic, bootstrap_terminal=True), "terminated"),
         ("check_batch_td_critic", with_(batch_td_critic, total=True), "mean of delta"),
         ("check_cg_residual_curve", with_(cg_residual_curve, first=1), "shape"),
         ("check_cg_residual_curve", with_(cg_residual_curve, relative=True), "residuals"),
         ("check_update_kl", with_(update_kl, optimizer=torch.optim.SGD), "Adam"),
         ("check_update_kl", with_(update_kl, reverse=True), "KL"),
         ("check_kl_estimators", with_(kl_estimators, uniform=True), "standard errors")]


def test_every_experiment_check_is_covered():
    assert set(RIGHT) <= set(grading.__all__) and {w[0] for w in WRONG} == set(RIGHT)


@pytest.mark.parametrize("check", sorted(RIGHT))
def test_a_working_experiment_passes(check, capsys):
    getattr(grading, check)(RIGHT[check])
    assert capsys.readouterr().out.startswith(f"✔ {check}")


@pytest.mark.parametrize("check, wrong, message", WRONG, ids=[w.__name__ for _, w, _ in WRONG])
def test_a_wrong_experiment_fails(check, wrong, message):
    with pytest.raises(CheckFailed, match=message):
        getattr(grading, check)(wrong)
