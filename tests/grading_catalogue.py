"""A catalogue of plausible wrong answers that only the probes added for the families below catch.

Each entry is ``(family, check name, wrong answer)``. tests/test_grading_families.py asserts that
every one fails its check; run this file (``python tests/grading_catalogue.py``) against another
copy of ``rlcourse`` to count how many of them that copy's checks catch.
"""
import numpy as np

import rlcourse  # noqa: F401  (before torch)
import torch


def _softmax(x):
    z = np.exp(x - x.max())
    return z / z.sum()


# ------------------------------------------------------------------ extreme magnitudes
def score_no_shift(theta, s, a):
    theta = np.asarray(theta, dtype=float)
    z = np.exp(theta[s])
    g = np.zeros(theta.shape)
    g[s] = -z / z.sum()
    g[s, a] += 1
    return g


def importance_weight_ratio_of_probs(new, old, mask):
    ratio = torch.exp(new) / torch.exp(old)
    return torch.where(mask.bool(), ratio, torch.ones_like(ratio)).prod(dim=1)


def k3_ratio_of_probs(logp, logq):
    r = torch.exp(logq) / torch.exp(logp)
    return r - 1 - torch.log(r)


# ------------------------------------------------------------------ integer inputs
def rtg_zeros_like(rewards, gamma):
    G = np.zeros_like(rewards)
    running = 0.0
    for t in reversed(range(len(rewards))):
        running = rewards[t] + gamma * running
        G[t] = running
    return G


def q_update_keeps_dtype(Q, s, a, r, s_next, terminated, alpha, gamma):
    target = r if terminated else r + gamma * np.max(Q[s_next])
    Q = Q.copy()
    Q[s, a] += alpha * (target - Q[s, a])
    return Q


def score_zeros_like(theta, s, a):
    g = np.zeros_like(theta)
    g[s] = -_softmax(np.asarray(theta[s], dtype=float))
    g[s, a] += 1
    return g


def moving_average_zeros_like(means, decay):
    out = np.zeros_like(means)
    for k in range(1, len(means)):
        out[k] = means[0] if k == 1 else decay * out[k - 1] + (1 - decay) * means[k - 1]
    return out


def value_iteration_int_values(P, R, gamma, tol=1e-8):
    V = np.zeros_like(R[:, 0])
    for _ in range(10_000):
        V[:] = (R + gamma * P @ V).max(axis=1)    # written into an integer array: truncated every sweep
    return V


# ------------------------------------------------------------------ iterations stopped before convergence
def value_iteration_fixed_sweeps(P, R, gamma, tol=1e-8):
    V = np.zeros(P.shape[0])
    for _ in range(1000):                 # converged for gamma <= 0.95, 63% of the way at gamma = 0.999
        V = (R + gamma * P @ V).max(axis=1)
    return V


# ------------------------------------------------------------------ long episodes (float32 drift)
def discounted_return_float32(rewards, gamma):
    G = np.float32(0.0)
    for r in np.asarray(rewards, dtype=np.float32)[::-1]:
        G = np.float32(r + np.float32(gamma) * G)
    return float(G)


def rtg_float32(rewards, gamma):
    r = torch.tensor(np.asarray(rewards), dtype=torch.float32)
    G = torch.zeros_like(r)
    running = torch.tensor(0.0)
    for t in reversed(range(len(r))):
        running = r[t] + gamma * running
        G[t] = running
    return G.numpy()


def gae_float32(rewards, values, next_values, terminated, dones, gamma, lam):
    f = lambda x: np.asarray(x, dtype=np.float32)
    delta = f(rewards) + np.float32(gamma) * (1 - f(terminated)) * f(next_values) - f(values)
    adv, running = np.zeros(len(delta), np.float32), np.float32(0)
    for t in reversed(range(len(delta))):
        running = delta[t] + np.float32(gamma * lam) * (1 - f(dones)[t]) * running
        adv[t] = running
    return adv


# ------------------------------------------------------------------ one parameter value everywhere
def n_step_gamma_09(rewards, next_values, terminated, dones, gamma, n):
    from test_grading_lesson04 import n_step_returns

    return n_step_returns(rewards, next_values, terminated, dones, 0.9, n)   # the argument ignored


def q_update_gamma_09(Q, s, a, r, s_next, terminated, alpha, gamma):
    target = r if terminated else r + 0.9 * np.max(Q[s_next])
    Q = np.array(Q, dtype=float)
    Q[s, a] += alpha * (target - Q[s, a])
    return Q


# ------------------------------------------------------------------ structural edge cases
def q_update_decay_first(Q, s, a, r, s_next, terminated, alpha, gamma):
    Q = np.array(Q, dtype=float)
    Q[s, a] *= 1 - alpha                      # then the target reads the already-changed entry when s_next == s
    Q[s, a] += alpha * (r if terminated else r + gamma * np.max(Q[s_next]))
    return Q


def cg_no_early_stop(Avp, b, iters):
    x = torch.zeros_like(b)
    r, p = b.clone(), b.clone()
    rr = r @ r
    for _ in range(iters):
        Ap = Avp(p)
        alpha = rr / (p @ Ap)
        x = x + alpha * p
        r = r - alpha * Ap
        rr_new = r @ r
        p = r + (rr_new / rr) * p
        rr = rr_new
    return x


def adaptive_beta_inclusive(beta, kl, kl_target):
    if kl <= kl_target / 1.5:
        return beta / 2
    if kl >= kl_target * 1.5:
        return beta * 2
    return beta


# ------------------------------------------------------------------ padding holding non-zero values
def batch_mean_trusts_zero_padding(returns, mask):
    return float(returns.sum() / mask.sum())


def value_baseline_trusts_zero_padding(returns, states, actions, mask, n_states):
    V = np.zeros(n_states)
    for s in range(n_states):
        here = states == s                     # padded steps counted: fine only if their returns were 0...
        seen = here & mask
        if seen.any():
            V[s] = returns[here].sum() / seen.sum()
    return V[states] * mask


# ------------------------------------------------------------------ gradients that do not really flow
def reinforce_loss_rebuilt(logprobs, psi, mask):
    value = -(logprobs * psi.detach() * mask).sum() / logprobs.shape[0]
    return torch.tensor(value.item(), dtype=logprobs.dtype, requires_grad=True)


def surrogate_rebuilt(logprobs, old_logprobs, advantages):
    value = (torch.exp(logprobs - old_logprobs) * advantages).mean()
    return torch.tensor(value.item(), requires_grad=True)


def ppo_loss_rebuilt(logprobs, old_logprobs, advantages, clip_coef):
    ratio = torch.exp(logprobs - old_logprobs)
    value = -torch.minimum(ratio * advantages, torch.clamp(ratio, 1 - clip_coef, 1 + clip_coef) * advantages).mean()
    return value.detach().requires_grad_(True)


def entropy_detached(logits, temperature=1.0):
    logp = torch.log_softmax(logits.detach() / temperature, dim=-1)
    return (-(logp.exp() * logp).sum(-1)).requires_grad_(True)


# ------------------------------------------------------------------ inputs modified in place
def reinforce_loss_masks_psi_in_place(logprobs, psi, mask):
    weights = psi.detach()                     # shares memory with the caller's psi
    weights *= mask
    return -(logprobs * weights).sum() / logprobs.shape[0]


def cg_overwrites_b(Avp, b, iters):
    from test_grading_lesson05 import conjugate_gradient

    x = conjugate_gradient(Avp, b, iters)
    b -= Avp(x)                                # "the residual", computed into the caller's b
    return x


def natural_step_scales_in_place(direction, Fd, max_kl):
    scale = torch.sqrt(2 * max_kl / (direction @ Fd))
    direction *= scale
    return direction


def entropy_divides_in_place(logits, temperature=1.0):
    logits = logits.detach() if logits.requires_grad else logits
    logits /= temperature
    logp = torch.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp).sum(-1)


def k3_in_place(logp, logq):
    log_r = logq.sub_(logp)
    return torch.exp(log_r) - 1 - log_r


# ------------------------------------------------------------------ ratio regions beyond those sampled
def ppo_dual_clip(logprobs, old_logprobs, advantages, clip_coef):
    ratio = torch.exp(logprobs - old_logprobs)
    surrogate = torch.minimum(ratio * advantages, torch.clamp(ratio, 1 - clip_coef, 1 + clip_coef) * advantages)
    surrogate = torch.where(advantages < 0, torch.maximum(surrogate, 3.0 * advantages), surrogate)
    return -surrogate.mean()


# ------------------------------------------------------------------ off-by-one in returns
def rtg_whole_return_everywhere(rewards, gamma):  # sum_{i=0}^{T-1} gamma^i r_i written for every t
    whole = sum(gamma ** i * r for i, r in enumerate(np.asarray(rewards, dtype=float)))
    return np.full(len(rewards), whole)


def discounted_return_discounts_first(rewards, gamma):  # gamma^(t+1) r_t
    return float(sum(gamma ** (t + 1) * r for t, r in enumerate(np.asarray(rewards, dtype=float))))


# ------------------------------------------------------------------ off-policy samples not importance-weighted
def surrogate_on_policy(logprobs, old_logprobs, advantages):
    return (logprobs * advantages).mean()


# ------------------------------------------------------------------ misstated paper constants
def adaptive_beta_thresholds_two(beta, kl, kl_target):
    return beta / 2 if kl < kl_target / 2 else beta * 2 if kl > kl_target * 2 else beta


def adaptive_beta_factor_one_and_a_half(beta, kl, kl_target):
    return beta / 1.5 if kl < kl_target / 1.5 else beta * 1.5 if kl > kl_target * 1.5 else beta


# ------------------------------------------------------------------ padding on one side only
def gather_assumes_right_padding(logits, tokens, mask, temperature=1.0):
    taken = torch.log_softmax(logits / temperature, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return taken * (torch.arange(mask.shape[-1]) < mask.sum(-1, keepdim=True))


# ------------------------------------------------------------------ seed ignored
def _entropy_sampled(logits, temperatures, n_samples, generator):
    out = {}
    for temp in temperatures:
        logp = torch.log_softmax(logits / temp, -1)
        y = torch.multinomial(logp.exp(), n_samples, replacement=True, generator=generator)
        out[temp] = (float(-logp[y].mean()), float(logp[y].std()))
    return out


def _q_learning_run(env, episodes, alpha, gamma, epsilon, seed, rng):
    from rlcourse import tabular

    Q = np.zeros((env.observation_space.n, env.action_space.n))
    env.reset(seed=seed)
    for _ in range(episodes):
        s, _ = env.reset()
        for _ in range(100):
            ties = np.flatnonzero(Q[s] == Q[s].max())
            a = int(rng.integers(4)) if rng.random() < epsilon else int(rng.choice(ties))
            s_next, r, terminated, truncated, _ = env.step(a)
            Q = tabular.q_learning_update(Q, s, a, r, s_next, terminated, alpha, gamma)
            s = s_next
            if terminated or truncated:
                break
    return Q


def q_run_unseeded(env, episodes, alpha, gamma, epsilon, seed):
    return _q_learning_run(env, episodes, alpha, gamma, epsilon, seed, np.random.default_rng())


def q_run_constant_seed(env, episodes, alpha, gamma, epsilon, seed):
    return _q_learning_run(env, episodes, alpha, gamma, epsilon, 0, np.random.default_rng(0))


def entropy_global_rng(logits, temperatures, n_samples, seed):
    return _entropy_sampled(logits, temperatures, n_samples, None)


def entropy_constant_seed(logits, temperatures, n_samples, seed):
    return _entropy_sampled(logits, temperatures, n_samples, torch.Generator().manual_seed(0))


CATALOGUE = [
    ("extreme magnitudes", "check_softmax_score", score_no_shift),
    ("extreme magnitudes", "check_importance_weight", importance_weight_ratio_of_probs),
    ("extreme magnitudes", "check_kl_k3", k3_ratio_of_probs),
    ("integer inputs", "check_reward_to_go", rtg_zeros_like),
    ("integer inputs", "check_q_learning_update", q_update_keeps_dtype),
    ("integer inputs", "check_softmax_score", score_zeros_like),
    ("integer inputs", "check_moving_average_baselines", moving_average_zeros_like),
    ("integer inputs", "check_value_iteration", value_iteration_int_values),
    ("stopped before convergence", "check_value_iteration", value_iteration_fixed_sweeps),
    ("float32 drift on long episodes", "check_discounted_return", discounted_return_float32),
    ("float32 drift on long episodes", "check_reward_to_go", rtg_float32),
    ("float32 drift on long episodes", "check_gae", gae_float32),
    ("one parameter value everywhere", "check_n_step_returns", n_step_gamma_09),
    ("one parameter value everywhere", "check_q_learning_update", q_update_gamma_09),
    ("structural edge cases", "check_q_learning_update", q_update_decay_first),
    ("structural edge cases", "check_conjugate_gradient", cg_no_early_stop),
    ("structural edge cases", "check_adaptive_kl_beta", adaptive_beta_inclusive),
    ("padding holding non-zero values", "check_batch_mean_baseline", batch_mean_trusts_zero_padding),
    ("padding holding non-zero values", "check_value_baseline", value_baseline_trusts_zero_padding),
    ("gradients that do not flow", "check_reinforce_loss", reinforce_loss_rebuilt),
    ("gradients that do not flow", "check_surrogate_objective", surrogate_rebuilt),
    ("gradients that do not flow", "check_ppo_clip_loss", ppo_loss_rebuilt),
    ("gradients that do not flow", "check_token_entropy", entropy_detached),
    ("inputs modified in place", "check_reinforce_loss", reinforce_loss_masks_psi_in_place),
    ("inputs modified in place", "check_conjugate_gradient", cg_overwrites_b),
    ("inputs modified in place", "check_natural_step", natural_step_scales_in_place),
    ("inputs modified in place", "check_token_entropy", entropy_divides_in_place),
    ("inputs modified in place", "check_kl_k3", k3_in_place),
    ("ratio regions beyond those sampled", "check_ppo_clip_loss", ppo_dual_clip),
    ("off-by-one in returns", "check_reward_to_go", rtg_whole_return_everywhere),
    ("off-by-one in returns", "check_discounted_return", discounted_return_discounts_first),
    ("off-policy samples not importance-weighted", "check_surrogate_objective", surrogate_on_policy),
    ("misstated paper constants", "check_adaptive_kl_beta", adaptive_beta_thresholds_two),
    ("misstated paper constants", "check_adaptive_kl_beta", adaptive_beta_factor_one_and_a_half),
    ("padding on one side only", "check_gather_token_logprobs", gather_assumes_right_padding),
    ("seed ignored", "check_q_learning_run", q_run_unseeded),
    ("seed ignored", "check_q_learning_run", q_run_constant_seed),
    ("seed ignored", "check_entropy_by_sampling", entropy_global_rng),
    ("seed ignored", "check_entropy_by_sampling", entropy_constant_seed),
]


def caught(check, wrong) -> bool:
    """A wrong answer is caught when its check raises anything but NotImplementedError."""
    import contextlib
    import io

    try:
        with contextlib.redirect_stdout(io.StringIO()):
            check(wrong)
    except NotImplementedError:
        return False
    except Exception:
        return True
    return False


if __name__ == "__main__":
    import rlcourse.grading as grading

    hits = [caught(getattr(grading, check), wrong) for _, check, wrong in CATALOGUE]
    for (family, check, wrong), hit in zip(CATALOGUE, hits):
        print(f"{'caught' if hit else 'MISSED'}  {family:<36} {check:<32} {wrong.__name__}")
    print(f"{sum(hits)} / {len(hits)} caught by {grading.__file__}")


FAMILIES = {"extreme magnitudes", "integer inputs", "stopped before convergence", "float32 drift on long episodes", "one parameter value everywhere",
            "structural edge cases", "padding holding non-zero values", "gradients that do not flow",
            "inputs modified in place", "ratio regions beyond those sampled", "off-by-one in returns",
            "off-policy samples not importance-weighted", "misstated paper constants", "seed ignored",
            "padding on one side only"}
