"""ipywidgets explorers: turn a knob, watch the numbers move."""
from __future__ import annotations

import ipywidgets as widgets
import matplotlib.pyplot as plt

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

    return widgets.interactive(
        show,
        gamma=widgets.FloatSlider(value=gamma, min=0.0, max=0.99, step=0.01, description="γ"),
        slip=widgets.FloatSlider(value=slip, min=0.0, max=0.6, step=0.05, description="slip"))


def next_token_explorer(model, tokenizer, prompt: str, temperature: float = 1.0, top: int = 12):
    """A temperature slider over a language model's next-token distribution after ``prompt``.

    Bars compare ``softmax(logits / T)`` with the ``T = 1`` policy on the ``top`` most likely
    tokens; the title gives the entropy at ``T`` and the exact ``KL(pi_T || pi_1)`` next to the
    mean of the k2 estimator. Lower ``T`` sharpens the policy (entropy falls), higher ``T``
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
        fig, ax = plt.subplots(figsize=(7, 3))
        x = np.arange(len(order))
        ax.bar(x - 0.2, base.exp()[order].numpy(), width=0.4, label="T = 1", color="#bbbbbb")
        ax.bar(x + 0.2, logp.exp()[order].numpy(), width=0.4, label=f"T = {temperature:.2f}")
        ax.set_xticks(x, labels)
        ax.set_ylabel("probability")
        ax.set_title(f"next token after {prompt!r}: entropy {kl.entropy(logp).item():.3f} nats, "
                     f"KL(π_T‖π_1) {kl.exact_kl(logp, base).item():.4f}, "
                     f"E[k2] {(logp.exp() * kl.kl_k2(logp, base)).sum().item():.4f}", fontsize=9)
        ax.legend()
        plt.show()

    return widgets.interactive(
        show, temperature=widgets.FloatLogSlider(value=temperature, base=10, min=-1, max=0.5, step=0.02,
                                                 description="T"))
