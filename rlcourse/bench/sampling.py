"""sampling: tokens/s of rlcourse's sampler against ``model.generate`` and a no-cache loop.

    python -m rlcourse.bench sampling [--size tiny|small|demo] [--batch 64] [--new 8] [--repeats 15]

All three sample the same model (a GPT-2 of the named size, fixed random weights: an untrained
model almost never ends early, so every method produces ``batch x new`` tokens) on the same batch
of left-padded, variable-length prompts, at temperature 1 with no top-k, in one process:

* ``rlcourse.lm.sample`` - KV cache, plus the per-token log-probs and masks that RL needs; on a GPU
  its decoding step is a CUDA-graph replay, and the eager ``engine="lean"`` is timed beside it; on
  a CPU, where a small batch decodes on one thread (``rlcourse.lm.sampling.decode_threads``), the
  sampler on every thread is timed beside it;
* ``model.generate(use_cache=True, do_sample=True)`` - transformers' generation loop;
* a no-cache loop - a full forward pass over the whole sequence for every new token.

Each is timed ``repeats`` times in interleaved order after a warm-up; the median is reported.
Target: rlcourse's sampler at least 1.25x the tokens/s of ``generate`` on a CPU, 2x on a GPU.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import rlcourse  # noqa: F401  (before torch)
import torch

from rlcourse.tasks import AdditionTask
from rlcourse.lm import build_char_tokenizer, make_model, sample, sequence_logprobs
from rlcourse.lm.logprobs import position_ids_from_mask
from rlcourse.lm.sampling import decode_threads, encode_prompts
from rlcourse.runtime import describe, device, synchronize


@torch.no_grad()
def sample_without_cache(model, input_ids, attention_mask, new_tokens, generator=None):
    """The peer without a KV cache: re-run the whole sequence to get each next token."""
    for _ in range(new_tokens):
        logits = model(input_ids=input_ids, attention_mask=attention_mask,
                       position_ids=position_ids_from_mask(attention_mask), use_cache=False).logits[:, -1]
        token = torch.multinomial(torch.softmax(logits.float(), -1), 1, generator=generator)
        input_ids = torch.cat([input_ids, token], 1)
        attention_mask = torch.cat([attention_mask, torch.ones_like(token)], 1)
    return input_ids


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlcourse.bench sampling", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="tiny", help="model size name (tiny, small, demo)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--new", type=int, default=8, help="new tokens per prompt")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    dev = device()

    tokenizer = build_char_tokenizer()
    model = make_model(args.size, tokenizer, seed=0).to(dev).eval()
    prompts = AdditionTask().prompts(args.batch, rng=0)        # "7+35=", "12+34=": lengths differ
    input_ids, attention_mask = encode_prompts(tokenizer, prompts, dev)
    gen = torch.Generator(device=dev).manual_seed(0)

    def ours():
        return sample(model, tokenizer, prompts, args.new, temperature=1.0, generator=gen).completion_mask.numel()

    def generate():
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, use_cache=True,
                             do_sample=True, temperature=1.0, top_k=None, top_p=None,
                             max_new_tokens=args.new, min_new_tokens=0,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        return (out.shape[1] - input_ids.shape[1]) * out.shape[0]

    def no_cache():
        out = sample_without_cache(model, input_ids, attention_mask, args.new, gen)
        return (out.shape[1] - input_ids.shape[1]) * out.shape[0]

    methods = {"rlcourse sample (KV cache)": ours, "transformers generate(use_cache=True)": generate,
               "no-cache loop": no_cache}
    if dev.type == "cuda":
        methods["rlcourse sample, engine='lean' (no graph)"] = lambda: sample(
            model, tokenizer, prompts, args.new, generator=gen, engine="lean").completion_mask.numel()
    if dev.type == "cpu" and decode_threads(model, args.batch) < args.threads:
        methods[f"rlcourse sample, cpu_threads={args.threads}"] = lambda: sample(
            model, tokenizer, prompts, args.new, generator=gen, cpu_threads=args.threads).completion_mask.numel()
    times = {name: [] for name in methods}
    tokens = {}
    load_before = os.getloadavg()[0]
    for fn in methods.values():                              # warm-up
        fn()
    for _ in range(args.repeats):
        for name, fn in methods.items():
            synchronize(dev)
            t0 = time.perf_counter()
            tokens[name] = fn()
            synchronize(dev)
            times[name].append(time.perf_counter() - t0)

    # Sanity: the sampler's log-probs equal a fresh full forward pass.
    roll = sample(model, tokenizer, prompts, args.new, generator=gen)
    fresh = sequence_logprobs(model, roll.prompt_ids, roll.completion_ids, roll.completion_mask, roll.prompt_mask)
    err = (fresh - roll.logprobs).abs().max().item()

    print(describe(), f"| model {args.size} ({sum(p.numel() for p in model.parameters()):,} parameters)"
          f" | batch {args.batch} x {args.new} new tokens | load average {load_before:.2f} -> "
          f"{os.getloadavg()[0]:.2f}")
    rate = {name: tokens[name] / statistics.median(t) for name, t in times.items()}
    for name in methods:
        print(f"  {name:40s} {statistics.median(times[name]) * 1e3:8.2f} ms   {rate[name]:10,.0f} tokens/s"
              f"   ({tokens[name]} tokens)")
    names = list(methods)
    vs_generate = rate[names[0]] / rate[names[1]]
    vs_nocache = rate[names[0]] / rate[names[2]]
    print(f"  ratio: {vs_generate:.2f}x generate, {vs_nocache:.2f}x no-cache; "
          f"sampler log-probs vs full forward: max |diff| {err:.1e}")
    target = 2.0 if dev.type == "cuda" else 1.25
    print(f"target (>= {target}x generate on {dev.type}): {'PASS' if vs_generate >= target else 'FAIL'}")
    return 0 if vs_generate >= target else 1
