"""Lesson 12b's checks pass right answers written in other ways and catch plausible wrong ones.

The right answers are written from the exercise texts, independently of the solution notebook."""
import numpy as np

import rlcourse  # noqa: F401  (before torch)
import torch

from rlcourse.grading.llm.lesson12b import check_forward_kl, check_lora_linear, check_pareto_front, check_rft_step
from grading_asserts import grading_tests


# ------------------------------------------------------------------------ exercise 1: the forward KL
def kl_softmax(base, logits, mask):
    p0, p = torch.softmax(base.double(), -1), torch.softmax(logits.double(), -1)
    kl = (p0 * (torch.log_softmax(base.double(), -1) - torch.log_softmax(logits.double(), -1))).sum(-1)
    return torch.where(mask.bool(), kl, torch.zeros_like(kl))


def kl_entropy_form(base, logits, mask):
    lp0, lp = torch.log_softmax(base, -1), torch.log_softmax(logits, -1)
    cross, ent = -(lp0.exp() * lp).sum(-1), -(lp0.exp() * lp0).sum(-1)
    return (cross - ent) * mask


def _kl_wrong(kind):
    def fn(base, logits, mask):
        lp0, lp = torch.log_softmax(base, -1), torch.log_softmax(logits, -1)
        p0, p = lp0.exp(), lp.exp()
        out = {"reverse": (p * (lp - lp0)).sum(-1), "sign": (p0 * (lp - lp0)).sum(-1),
               "no_mask": (p0 * (lp0 - lp)).sum(-1), "raw_logits": (p0 * (base - logits)).sum(-1),
               "cross_entropy": -(p0 * lp).sum(-1), "vocab_mean": (p0 * (lp0 - lp)).mean(-1),
               "unweighted": (lp0 - lp).sum(-1),
               "summed_over_time": ((p0 * (lp0 - lp)).sum(-1) * mask).sum(-1),
               "naive_log_softmax": (torch.softmax(base, -1) * (torch.log(torch.softmax(base, -1))
                                                                 - torch.log(torch.softmax(logits, -1)))).sum(-1)}[kind]
        return out if kind in ("no_mask", "summed_over_time") else out * mask
    fn.__name__ = f"kl_{kind}"
    return fn


# ----------------------------------------------------------------------- exercise 2: a LoRA linear layer
def lora_thin(x, weight, bias, lora_A, lora_B, alpha):
    y = torch.nn.functional.linear(x, weight, bias)
    return y + (alpha / lora_A.shape[0]) * torch.nn.functional.linear(torch.nn.functional.linear(x, lora_A), lora_B)


def lora_merged(x, weight, bias, lora_A, lora_B, alpha):
    w = weight + alpha / lora_A.shape[0] * lora_B @ lora_A
    return x @ w.T + (0 if bias is None else bias)


def _lora_wrong(kind):
    def fn(x, weight, bias, lora_A, lora_B, alpha):
        r = lora_A.shape[0]
        scale = {"alpha": alpha, "r_over_alpha": r / alpha, "rslora": alpha / r ** 0.5, "unscaled": 1.0}.get(kind, alpha / r)
        base = x @ weight.T + (0 if bias is None or kind == "no_bias" else bias)
        delta = scale * (x @ lora_A.T) @ lora_B.T
        if kind == "detached":
            delta = delta.detach()
        if kind == "subtracted":
            return base - delta
        if kind == "no_base":
            return delta + (0 if bias is None else bias)
        return base + delta
    fn.__name__ = f"lora_{kind}"
    return fn


# ---------------------------------------------------------------------- exercise 3: the Pareto front
def front_loops(points):
    pts = [tuple(map(float, p)) for p in points]
    return [not any(q != p and q[0] >= p[0] and q[1] >= p[1] for q in pts) for p in pts]


def front_sweep(points):
    pts = np.asarray(points, dtype=float)
    keep = np.zeros(len(pts), bool)
    best = -np.inf
    for i in sorted(range(len(pts)), key=lambda i: (-pts[i, 0], -pts[i, 1])):
        if pts[i, 1] >= best:
            keep[i], best = True, pts[i, 1]
    # a point equal in y to the last kept one but lower in x is dominated: drop it again
    for i in range(len(pts)):
        if keep[i] and any((pts[j] >= pts[i]).all() and (pts[j] > pts[i]).any() for j in range(len(pts))):
            keep[i] = False
    return keep


def _front_wrong(kind):
    def fn(points):
        p = np.asarray(points, dtype=float)
        n = len(p)
        ge, gt = (p[None] >= p[:, None]).all(-1), (p[None] > p[:, None]).any(-1)
        if kind == "minimise":
            ge, gt = (p[None] <= p[:, None]).all(-1), (p[None] < p[:, None]).any(-1)
            return ~(ge & gt).any(1)
        if kind == "equal_dominates":
            return ~(ge & ~np.eye(n, dtype=bool)).any(1)
        if kind == "strict_both":
            return ~(p[None] > p[:, None]).all(-1).any(1)
        if kind == "self":
            return ~ge.any(1)
        if kind == "x_only":
            return p[:, 0] == p[:, 0].max()
        if kind == "best_sum":
            return np.arange(n) == np.argmax(p.sum(1))
        if kind == "complement":
            return (ge & gt).any(1)
        if kind == "indices":
            return np.flatnonzero(~(ge & gt).any(1))
        best, keep = -np.inf, np.zeros(n, bool)           # "sweep_drops_ties"
        for i in sorted(range(n), key=lambda i: (-p[i, 0], -p[i, 1])):
            if p[i, 1] > best:
                keep[i], best = True, p[i, 1]
        return keep
    fn.__name__ = f"front_{kind}"
    return fn


RIGHT = [(check_forward_kl, kl_softmax), (check_forward_kl, kl_entropy_form),
         (check_lora_linear, lora_thin), (check_lora_linear, lora_merged),
         (check_pareto_front, front_loops), (check_pareto_front, front_sweep)]
WRONG = [(check_forward_kl, _kl_wrong("reverse"), "reverse KL"),
         (check_forward_kl, _kl_wrong("sign"), "the sign"),
         (check_forward_kl, _kl_wrong("no_mask"), "padding"),
         (check_forward_kl, _kl_wrong("raw_logits"), "not raw logits"),
         (check_forward_kl, _kl_wrong("cross_entropy"), "cross-entropy"),
         (check_forward_kl, _kl_wrong("vocab_mean"), "do not average"),
         (check_forward_kl, _kl_wrong("unweighted"), "base probability"),
         (check_forward_kl, _kl_wrong("summed_over_time"), "keep the time axis"),
         (check_forward_kl, _kl_wrong("naive_log_softmax"), "log_softmax"),
         (check_lora_linear, _lora_wrong("alpha"), "not alpha"),
         (check_lora_linear, _lora_wrong("r_over_alpha"), "not r / alpha"),
         (check_lora_linear, _lora_wrong("rslora"), "rsLoRA"),
         (check_lora_linear, _lora_wrong("unscaled"), "multiply the low-rank correction"),
         (check_lora_linear, _lora_wrong("subtracted"), "add the correction"),
         (check_lora_linear, _lora_wrong("no_base"), "keep the frozen layer"),
         (check_lora_linear, _lora_wrong("no_bias"), "bias"),
         (check_lora_linear, _lora_wrong("detached"), "lora_A and lora_B"),
         (check_pareto_front, _front_wrong("minimise"), "maximise"),
         (check_pareto_front, _front_wrong("equal_dominates"), "equal points"),
         (check_pareto_front, _front_wrong("strict_both"), ">= in both"),
         (check_pareto_front, _front_wrong("self"), "does not dominate itself"),
         (check_pareto_front, _front_wrong("x_only"), "both coordinates"),
         (check_pareto_front, _front_wrong("best_sum"), "best sum"),
         (check_pareto_front, _front_wrong("complement"), "return True"),
         (check_pareto_front, _front_wrong("indices"), "mask over the points"),
         (check_pareto_front, _front_wrong("sweep_drops_ties"), "ties stay")]

test_right_answers_pass, test_wrong_answers_fail_with_a_hint = grading_tests(RIGHT, WRONG)


# ------------------------------------------------------------------ exercise 4: one RFT step
def rft_encoded(model, optimizer, tokenizer, task, prompts, generator):
    """Written another way: the kept answers re-encoded as prompt + completion + <eos>, the NLL from the full logits."""
    from rlcourse.lm import sample
    from rlcourse.lm.logprobs import position_ids_from_mask

    roll = sample(model, tokenizer, prompts, task.max_new_tokens, generator=generator)
    rewards = task.reward(prompts, roll.completions)
    kept = [(p, c) for p, c, r in zip(prompts, roll.completions, rewards.tolist()) if r == 1.0]
    if not kept:
        return 0
    rows = [(tokenizer(p)["input_ids"], tokenizer(c, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id])
            for p, c in kept]
    width = max(len(a) + len(b) for a, b in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    attention, target = torch.zeros_like(ids), torch.zeros_like(ids)
    for i, (a, b) in enumerate(rows):
        ids[i, width - len(a) - len(b):] = torch.tensor(a + b)
        attention[i, width - len(a) - len(b):] = 1
        target[i, width - len(b):] = 1
    logits = model(input_ids=ids, attention_mask=attention, position_ids=position_ids_from_mask(attention)).logits
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    m = target[:, 1:].float()
    loss = -(logp * m).sum() / m.sum()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return len(kept)


def _rft_wrong(kind):
    def fn(model, optimizer, tokenizer, task, prompts, generator):
        from rlcourse.lm import sample, sequence_logprobs

        roll = sample(model, tokenizer, prompts, task.max_new_tokens, generator=generator)
        good = task.reward(prompts, roll.completions) >= 1.0
        keep = {"no_filter": torch.ones_like(good), "inverted": ~good}.get(kind, good)
        if not bool(keep.any()):
            return 0
        logp = sequence_logprobs(model, roll.prompt_ids[keep], roll.completion_ids[keep], roll.completion_mask[keep],
                                 roll.prompt_mask[keep])
        mask = roll.completion_mask[keep].float()
        if kind == "no_eos":
            mask = mask * (roll.completion_ids[keep] != tokenizer.eos_token_id).float()
        if kind == "with_prompt":
            ids = torch.cat([roll.prompt_ids[keep], roll.completion_ids[keep]], 1)
            attention = torch.cat([roll.prompt_mask[keep], roll.completion_mask[keep]], 1)
            from rlcourse.lm.logprobs import position_ids_from_mask
            logits = model(input_ids=ids, attention_mask=attention, position_ids=position_ids_from_mask(attention)).logits
            lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
            m = attention[:, 1:].float()
            loss = -(lp * m).sum() / m.sum()
        elif kind == "sum":
            loss = -(logp * mask).sum()
        elif kind == "ascent":
            loss = (logp * mask).sum() / mask.sum()
        else:
            loss = -(logp * mask).sum() / mask.sum()
        if kind != "no_zero_grad":
            optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return int(keep.sum()) if kind != "wrong_count" else len(prompts)
    fn.__name__ = f"rft_{kind}"
    return fn


RFT_WRONG = [(check_rft_step, _rft_wrong("no_filter"), "completions kept"),
             (check_rft_step, _rft_wrong("inverted"), "whose reward is 1"),
             (check_rft_step, _rft_wrong("wrong_count"), "return how many"),
             (check_rft_step, _rft_wrong("no_eos"), "gradient"),
             (check_rft_step, _rft_wrong("with_prompt"), "never on the prompt"),
             (check_rft_step, _rft_wrong("sum"), "not a sum"),
             (check_rft_step, _rft_wrong("ascent"), "other way"),
             (check_rft_step, _rft_wrong("no_zero_grad"), "zero them")]
test_rft_right_answers_pass, test_rft_wrong_answers_fail_with_a_hint = grading_tests(
    [(check_rft_step, rft_encoded)], RFT_WRONG)
