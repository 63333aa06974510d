"""ipywidgets explorers: turn a knob, watch the numbers move.

Each explorer is an :class:`Explorer`: displayed, it shows the live sliders and, below them, a
static picture of its default setting. Sliders need a running kernel; the static picture is saved
in the notebook, so a reader who has not run it yet (or reads it on GitHub) still sees the plot.
"""
from __future__ import annotations

import ipywidgets as widgets
import matplotlib.pyplot as plt


class Explorer(widgets.interactive):
    """``ipywidgets.interactive`` that also draws a static figure of its current setting below itself."""

    def _ipython_display_(self, **kwargs):
        from IPython.display import Markdown, display

        display(self._repr_mimebundle_(), raw=True)
        setting = ", ".join(f"{w.description} = {w.value:g}" for w in self.kwargs_widgets)
        display(Markdown(f"*Static picture at {setting} (the sliders above need a running kernel):*"))
        self.f(**self.kwargs)

from rlcourse import tabular
from rlcourse.envs import GridWorld
from rlcourse.viz import plot_gridworld_values


def gridworld_explorer(layout: str = "4x4", gamma: float = 0.9, slip: float = 0.0):
    """Sliders for the discount and the slip probability; shows ``V*`` and the optimal policy.

    Watch how a small gamma makes the agent short-sighted (values near the goal only) and how slip
    makes states next to a trap worth less, until the optimal route changes.
    """

    def show(gamma: float, slip: float):
        env = GridWorld(layout, slip=slip)
        result = tabular.value_iteration(env.mdp, gamma)
        start = int(env.start_distribution.argmax())
        fig, ax = plt.subplots(figsize=(4.5, 4.5))
        plot_gridworld_values(env, result.V, result.policy, ax=ax,
                              title=f"V* and the optimal policy\nγ={gamma:.2f}, slip={slip:.2f}, "
                                    f"V*(start)={result.V[start]:.2f}")
        plt.show()

    return Explorer(
        show,
        gamma=widgets.FloatSlider(value=gamma, min=0.0, max=0.99, step=0.01, description="γ"),
        slip=widgets.FloatSlider(value=slip, min=0.0, max=0.6, step=0.05, description="slip"))


def next_token_explorer(model, tokenizer, prompt: str, temperature: float = 1.0, top: int = 12):
    """A temperature slider over a language model's next-token distribution after ``prompt``.

    Bars compare ``softmax(logits / temp)`` with the ``temp = 1`` policy on the ``top`` most likely
    tokens; the title gives the entropy at ``temp`` and the exact ``KL(pi_temp || pi_1)`` next to the
    mean of the k2 estimator. Lower ``temp`` sharpens the policy (entropy falls), higher ``temp``
    flattens it; either way the KL to the ``T = 1`` policy grows, and k2 drifts away from it.
    """
    import numpy as np
    import torch

    from rlcourse import kl
    from rlcourse.lm.logprobs import position_ids_from_mask
    from rlcourse.lm.sampling import encode_prompts

    ids, mask = encode_prompts(tokenizer, [prompt], next(model.parameters()).device)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask,
                       position_ids=position_ids_from_mask(mask)).logits[0, -1].float().cpu()
    base = torch.log_softmax(logits, -1)
    order = base.argsort(descending=True)[:top]
    labels = [tokenizer.convert_ids_to_tokens(int(i)) for i in order]

    def show(temperature: float):
        logp = torch.log_softmax(logits / temperature, -1)
        fig, ax = plt.subplots(figsize=(9, 3.6))
        x = np.arange(len(order))
        ax.bar(x - 0.2, base.exp()[order].numpy(), width=0.4, label="temp = 1", color="#bbbbbb")
        ax.bar(x + 0.2, logp.exp()[order].numpy(), width=0.4, label=f"temp = {temperature:.2f}")
        ax.set_xticks(x, labels)
        ax.set_ylabel("probability")
        ax.set_title(f"next token after {prompt!r}: entropy {kl.entropy(logp).item():.3f} nats\n"
                     f"KL(π_temp‖π_1) {kl.exact_kl(logp, base).item():.4f}, "
                     f"E[k2] {(logp.exp() * kl.kl_k2(logp, base)).sum().item():.4f}", fontsize=12)
        ax.legend()
        plt.show()

    return Explorer(
        show, temperature=widgets.FloatLogSlider(value=temperature, base=10, min=-1, max=0.5, step=0.02,
                                                 description="temp"))


def ppo_clip_explorer(clip_coef: float = 0.2, advantage: float = 1.0):
    """Sliders for ε and the advantage A: PPO's clipped objective against the ratio ρ.

    Flip the sign of A and watch the flat, zero-gradient region move from the right of ``1 + ε``
    to the left of ``1 - ε``; widen ε and the region where the policy keeps learning grows.
    """
    from rlcourse.viz import plot_clip_objective

    def show(clip_coef: float, advantage: float):
        fig, ax = plt.subplots(figsize=(7, 4))
        plot_clip_objective(clip_coef, advantage, ax=ax)
        plt.show()

    return Explorer(
        show,
        clip_coef=widgets.FloatSlider(value=clip_coef, min=0.05, max=0.5, step=0.05, description="ε"),
        advantage=widgets.FloatSlider(value=advantage, min=-5.0, max=5.0, step=0.5, description="A"))


def gae_explorer(study, gae_lambda: float = 0.9, gamma: float = 0.9):
    """Sliders for λ and γ over a :class:`rlcourse.classic.gae_gridworld.GAEStudy`.

    Left: the weights ``(1 - λ) λ^(n-1)`` GAE puts on the n-step advantages. Right: squared bias,
    variance and their sum (the mean squared error against the exact advantage) over all λ, with
    the chosen λ marked. Changing γ changes the problem itself (exact A and the critic's targets).
    """
    import numpy as np

    def show(gae_lambda: float, gamma: float):
        lambdas = np.linspace(0, 1, 21)
        curves = study.bias_variance(lambdas, gamma)
        here = study.bias_variance([gae_lambda], gamma)
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
        n = np.arange(1, 16)
        ax1.bar(n, (1 - gae_lambda) * gae_lambda ** (n - 1), color="C0")
        ax1.set_xlabel("n (steps before bootstrapping)")
        ax1.set_ylabel("weight (1 − λ) λ^(n−1)")
        ax1.set_title(f"GAE's weights, λ={gae_lambda:.2f}")
        for key, style in (("bias2", "C3"), ("variance", "C2"), ("mse", "k")):
            ax2.plot(lambdas, curves[key], color=style, label=key)
            ax2.plot([gae_lambda], here[key], "o", color=style)
        ax2.set_xlabel("λ")
        ax2.set_ylabel("squared error of one sample")
        ax2.set_title(f"GAE vs the exact A (γ={gamma:.2f})")
        ax2.legend()
        plt.tight_layout()
        plt.show()

    return Explorer(
        show,
        gae_lambda=widgets.FloatSlider(value=gae_lambda, min=0.0, max=1.0, step=0.05, description="λ"),
        gamma=widgets.FloatSlider(value=gamma, min=0.5, max=0.99, step=0.01, description="γ"))


# >>> policy-gradient explorers (lessons 02-03)
def importance_weight_explorer(mdp, theta, batch, gamma: float, max_alpha: float = 6.0):
    """A slider for how far a new policy moves from the one that sampled ``batch`` (lesson 03).

    The new logits are ``theta + alpha * u``: a step of length ``alpha`` along ``u``, the unit
    exact-gradient direction. Shows the
    histogram of the trajectory importance weights ``rho`` (log scale), the effective sample size
    ``(sum rho)^2 / sum rho^2`` and how far the reweighted gradient estimate lands from the exact
    gradient at the new policy. Near ``alpha = 0`` old episodes are as good as new ones; far away
    a handful of episodes carry all the weight.
    """
    import numpy as np
    import torch

    from rlcourse import losses
    from rlcourse.classic import gradient_estimates as ge
    from rlcourse.returns import episode_returns

    theta = np.asarray(theta, dtype=float)
    direction = tabular.softmax_policy_gradient(mdp, theta, gamma)
    direction = direction / np.linalg.norm(direction)
    states, actions = torch.as_tensor(batch.states), torch.as_tensor(batch.actions)
    mask = torch.as_tensor(batch.mask)
    psi = episode_returns(batch.rewards, gamma, mask=batch.mask)[:, None]

    def logprobs(th):
        return torch.log_softmax(torch.as_tensor(th)[states], -1).gather(-1, actions[..., None]).squeeze(-1)

    old = logprobs(theta)

    def show(alpha: float):
        theta_new = theta + alpha * direction
        rho = losses.trajectory_importance_weight(logprobs(theta_new), old, mask).numpy()
        ess = rho.sum() ** 2 / (rho ** 2).sum() / len(rho)
        g = (ge.softmax_score_gradients(theta_new, batch, psi) * rho[:, None, None]).mean(0)
        error = ge.relative_error(g, tabular.softmax_policy_gradient(mdp, theta_new, gamma))
        fig, ax = plt.subplots(figsize=(8, 3.4))
        ax.hist(np.log10(rho), bins=60, color="tab:purple")
        ax.set_xlabel(r"$\log_{10} \rho(\tau)$")
        ax.set_ylabel("episodes")
        ax.set_title(f"α = {alpha:.2f}: effective sample size {100 * ess:.1f}% · "
                     f"IS gradient off by {100 * error:.1f}%", fontsize=10)
        plt.show()

    return Explorer(show, alpha=widgets.FloatSlider(value=1.0, min=0.0, max=max_alpha, step=0.25,
                                                    description="α"))

def gradient_estimate_explorer(g_per_episode, exact, n_max: int | None = None, seed: int = 0):
    """A slider for the number of episodes N behind a Monte-Carlo policy gradient (lesson 02).

    ``g_per_episode`` holds one gradient estimate per episode (``(n, S, A)`` or ``(n, d)``) and
    ``exact`` the true gradient. For each N the plot shows the average of N randomly chosen
    episodes' estimates next to the exact gradient, entry by entry, with the relative error and
    the cosine similarity in the title. Small N: the bars jump around; large N: they settle on
    the exact ones, at a rate of 1/sqrt(N).
    """
    import numpy as np

    from rlcourse.classic.gradient_estimates import cosine_similarity, relative_error

    g = np.asarray(g_per_episode, dtype=float).reshape(len(g_per_episode), -1)
    exact = np.asarray(exact, dtype=float).ravel()
    live = np.flatnonzero(np.abs(exact) > 0)  # skip entries that are exactly 0 (terminal states)
    order = np.random.default_rng(seed).permutation(len(g))
    n_max = n_max or len(g)

    def show(log2_n: int):
        n = min(2 ** log2_n, n_max)
        estimate = g[order[:n]].mean(0)
        fig, ax = plt.subplots(figsize=(9, 3.4))
        x = np.arange(len(live))
        ax.bar(x - 0.2, exact[live], width=0.4, label="exact", color="k")
        ax.bar(x + 0.2, estimate[live], width=0.4, label=f"mean of {n} episodes", color="tab:orange")
        ax.set_xlabel("entry (s, a) of the gradient")
        ax.set_xticks([])
        ax.legend(fontsize=8)
        ax.set_title(f"N = {n}: relative error {relative_error(estimate, exact):.2f}, "
                     f"cosine {cosine_similarity(estimate, exact):.3f}", fontsize=10)
        plt.show()

    top = int(np.log2(n_max))
    return Explorer(show, log2_n=widgets.IntSlider(value=min(6, top), min=0, max=top,
                                                              description="log2 N"))
# <<< policy-gradient explorers (lessons 02-03)


def kl_estimator_explorer(logits, tokens, mask, t_ref: float = 1.5):
    """A slider for the reference's temperature: histograms of k1, k2 and k3 against the exact KL.

    ``logits`` (B, T, V) are the policy's logits at the positions of ``tokens`` (B, T), which were
    sampled from ``softmax(logits)``; ``mask`` (B, T) marks the real tokens. The reference is the
    same model at temperature ``temp_ref``. Each panel shows one estimator's per-token values, the
    exact KL (mean of ``KL_t`` over the visited states) and the estimator's sample mean. Push
    ``temp_ref`` above 1 and watch k3's tail stretch to the right while k1 stays put.
    """
    import numpy as np
    import torch

    from rlcourse import kl

    logits = logits.detach().float().cpu()
    tokens, keep = tokens.cpu(), mask.cpu().bool()
    if logits.shape[:2] != tokens.shape or tokens.shape != keep.shape:
        raise ValueError(f"logits (B, T, V), tokens and mask (B, T) must agree, got "
                         f"{tuple(logits.shape)}, {tuple(tokens.shape)}, {tuple(keep.shape)}")
    logp_full = torch.log_softmax(logits, -1)
    logp = logp_full.gather(-1, tokens.unsqueeze(-1))[..., 0]

    def show(t_ref: float):
        logq_full = torch.log_softmax(logits / t_ref, -1)
        logq = logq_full.gather(-1, tokens.unsqueeze(-1))[..., 0]
        exact = kl.exact_kl(logp_full, logq_full)[keep]
        fig, axes = plt.subplots(1, 3, figsize=(10, 3.6), sharey=True)
        for ax, (name, estimator) in zip(axes, kl.KL_ESTIMATORS.items()):
            values = estimator(logp, logq)[keep]
            errors = values - exact
            stderr = errors.std().item() / np.sqrt(len(errors))
            ax.hist(values.numpy(), bins=50, color="#4c72b0")
            ax.axvline(exact.mean().item(), color="k", linestyle="--", label="exact KL")
            ax.axvline(values.mean().item(), color="#dd8452", label=f"mean of {name}")
            ax.set_yscale("log")
            ax.set_title(f"{name}: mean − KL\n{errors.mean().item():+.4f} ± {stderr:.4f}", fontsize=11)
            ax.set_xlabel("per-token estimate (nats)")
        axes[0].set_ylabel("tokens")
        axes[0].legend(fontsize=8)
        fig.suptitle(f"reference = policy at temp_ref = {t_ref:.2f}: exact KL per token "
                     f"{exact.mean().item():.4f}", fontsize=12, y=1.08)
        plt.show()

    return Explorer(
        show, t_ref=widgets.FloatLogSlider(value=t_ref, base=10, min=-0.4, max=0.5, step=0.02,
                                           description="temp_ref"))
