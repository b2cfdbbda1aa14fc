"""Decode speed: fmeg's generate vs transformers' generate on the same model, in one run (CPU or
GPU).

    # GPT-2 shape: 6 layers, hidden 512, 8 heads, vocab 50257
    python bench/generate.py
    python bench/generate.py --batches 1 --new 16   # a quicker look
    python bench/generate.py --device cuda --dtype bfloat16

Both sides generate greedily from the same weights (fmeg's exported with interop.hf.to_hf) and the
same prompts, with no end-of-document stop, so they do the same work; the tokens are checked equal.
Decode time is the time of a run with --new + 1 new tokens less that of a run with 1 (the prefill
and the first token), so the figure is tokens per second of pure decode steps: batch * new / time.
Rounds alternate between the two sides; medians are printed, with the ratio fmeg / transformers
(above 1: fmeg is faster).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

import torch


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    p.add_argument("--new", type=int, default=64, help="decode steps timed")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    return p.parse_args()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main() -> None:
    import transformers

    from fmeg.inference import SamplingParams, generate
    from fmeg.interop.hf import to_hf
    from fmeg.models import gpt

    logging.getLogger("transformers").setLevel(logging.ERROR)
    a = parse_args()
    dtype = getattr(torch, a.dtype)
    config = gpt.GPTConfig.gpt2(
        vocab_size=a.vocab,
        max_seq_len=a.prompt + a.new + 1,
        num_layers=a.layers,
        hidden_size=a.hidden,
        num_heads=a.heads,
    )
    params = gpt.init(config, 0)
    model = to_hf(params, config).to(device=a.device, dtype=dtype).eval()
    params = torch.utils._pytree.tree_map(lambda t: t.to(device=a.device, dtype=dtype), params)
    greedy = SamplingParams(temperature=0.0)
    print(
        f"{transformers.__version__=} {torch.__version__=} device {a.device} {a.dtype}, threads "
        f"{torch.get_num_threads()}; GPT-2 shape {a.layers} layers, hidden {a.hidden}, vocab "
        f"{a.vocab}; prompt {a.prompt} tokens, {a.new} decode steps timed"
    )

    for batch in a.batches:
        prompts = torch.randint(
            0, a.vocab, (batch, a.prompt), generator=torch.Generator().manual_seed(batch)
        )

        def ours(new: int) -> list[list[int]]:
            return generate(
                params, prompts.tolist(), config, max_new_tokens=new, sampling=greedy
            ).tokens

        def theirs(new: int) -> list[list[int]]:
            ids = prompts.to(a.device)
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            return out[:, a.prompt :].tolist()

        def timed(fn, new: int) -> float:
            sync(a.device)
            start = time.perf_counter()
            fn(new)
            sync(a.device)
            return time.perf_counter() - start

        with torch.no_grad():
            same = ours(a.new + 1) == theirs(a.new + 1)
            times = {"fmeg": [], "transformers": []}
            for _ in range(a.rounds):
                for name, fn in (("fmeg", ours), ("transformers", theirs)):
                    times[name].append(timed(fn, a.new + 1) - timed(fn, 1))
        rate = {name: batch * a.new / statistics.median(t) for name, t in times.items()}
        print(
            f"batch {batch:3d}: fmeg {rate['fmeg']:8.1f} tok/s, transformers "
            f"{rate['transformers']:8.1f} tok/s, ratio {rate['fmeg'] / rate['transformers']:.2f}x; "
            f"same tokens: {same}",
            flush=True,
        )


if __name__ == "__main__":
    main()
