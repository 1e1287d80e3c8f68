#!/usr/bin/env python
r"""Speed and memory of :class:`pyro_mpt.adapters.MaskedLMScorer` on a real masked LM.

The model is AntiBERTy (BERT, 8 layers, hidden 512, 26M parameters), shipped in
``antiberty==0.1.3``; the data are antibody variable domains
(:mod:`pyro_mpt.adapters.antibodies`). In one run it times

1. a **full 99-rate MPT curve** (1 %..99 %, one mask per rate), and
2. the **pseudo-log-likelihood** (one masked copy per token),

with pyro_mpt (masked copies of equal-length sequences packed under a token
budget, LM head on the scored positions only, ``torch.inference_mode``)
against a **naive loop**: one ``model(input_ids).logits`` forward per masked
copy, same masks (replayed from :meth:`~MaskedLMScorer.curve_masks`), same
inference mode, same threads. Both must give the same numbers; the script
prints the largest difference. Both run on the same sequences (``--naive-seqs``
can restrict the naive loop to the first few, but then its rate is for other
lengths than pyro_mpt's and the speed-up is not like for like). The
two alternate for ``--repeats`` rounds and each keeps its best time, which
tames the noise of a shared machine.

3. **how close each runs to the machine's matrix-product peak**: the encoder
   FLOPs of each task (counted from the model config) over its best time,
   against a large float32 GEMM timed in the same run with the same threads.
   pyro_mpt does fewer FLOPs only where rates share a mask size (short
   sequences: one pass serves every rate with the same M); otherwise both do
   the same encoder passes. ``FLOP ratio x peak / naive rate`` is then the
   most any implementation of those passes can gain over the naive loop on
   this machine: when it is below the speed-up asked for, only less
   arithmetic, not better packing, could reach it.

4. **peak memory vs token budget**: each budget runs in a fresh process
   (peak resident memory above the loaded-model baseline, sampled every 2 ms, on CPU;
   ``torch.cuda.max_memory_allocated`` on GPU) on long sequences (heavy +
   light chain, ~230 tokens).

Usage::

    .venv/bin/python benchmarks/mlm_speed.py                  # ~10 minutes on 2 shared cores
    .venv/bin/python benchmarks/mlm_speed.py --quick          # short chains, < 1 min
    .venv/bin/python benchmarks/mlm_speed.py --threads 2 --device cuda
"""

import argparse
import gc
import multiprocessing as mp
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling harness
from harness import PeakRSS, gemm_gflops, timed  # noqa: E402


def _load():
    from pyro_mpt.adapters.loading import load_masked_lm

    return load_masked_lm("antiberty", quiet=True)


def _sequences(n, max_residues, long=False):
    from pyro_mpt.adapters.antibodies import HEAVY, LIGHT, spaced

    seqs = [h + l for h, l in zip(HEAVY, LIGHT)] if long else [s for pair in zip(HEAVY, LIGHT) for s in pair]
    return spaced(seqs[:n], max_residues)


def _naive_curve(model, tok, scorer, seqs, device):
    """One forward per masked copy, full logits, the masks pyro_mpt used."""
    from pyro_mpt.adapters import PAPER_MLM_RATES

    masks = scorer.curve_masks(seqs, rates=PAPER_MLM_RATES, num_masks=1)
    out = np.zeros((len(seqs), len(PAPER_MLM_RATES)))
    with torch.inference_mode():
        for i, s in enumerate(seqs):
            ids = torch.tensor(tok(s)["input_ids"], device=device)
            for k in range(len(PAPER_MLM_RATES)):
                m = masks[i][k, 0].to(device)
                x = ids.masked_fill(m, tok.mask_token_id)
                lp = model(input_ids=x[None]).logits[0].log_softmax(-1)
                out[i, k] = lp[m].gather(-1, ids[m][:, None]).mean().item()
    return out


def _naive_pll(model, tok, seqs, device):
    out = []
    with torch.inference_mode():
        for s in seqs:
            ids = torch.tensor(tok(s)["input_ids"], device=device)
            total = 0.0
            for j in range(1, ids.numel() - 1):
                x = ids.clone()
                x[j] = tok.mask_token_id
                total += model(input_ids=x[None]).logits[0, j].log_softmax(-1)[ids[j]].item()
            out.append(total)
    return np.array(out)


def _encoder_flops(cfg, tokens):
    """Multiply-add FLOPs (x2) of one BERT encoder pass over a sequence of ``tokens`` tokens."""
    d, f = cfg.hidden_size, cfg.intermediate_size
    dense = 2 * tokens * (4 * d * d + 2 * d * f)  # Q, K, V, output projections and the two FFN matrices
    attention = 2 * 2 * tokens * tokens * d  # scores and the weighted sum of values
    return cfg.num_hidden_layers * (dense + attention)


def _gemm_peak(cfg, threads, repeats=5):
    """GFLOP/s of a large float32 matrix product shaped like the FFN's (best of ``repeats``)."""
    return gemm_gflops(4096, cfg.hidden_size, cfg.intermediate_size, threads, repeats)


def _memory_child(budget, n, threads, device, queue):
    torch.set_num_threads(threads)
    from pyro_mpt.adapters import MaskedLMScorer
    from pyro_mpt.adapters.rates import rate_grid

    model, tok = _load()
    seqs = _sequences(n, None, long=True)
    scorer = MaskedLMScorer(model, tok, max_tokens=budget, device=device)
    scorer.pll([seqs[0][:9]])  # warm-up: allocator and kernels, tiny
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.max_memory_allocated()
    sampler = PeakRSS()
    base_rss = sampler.rss()
    sampler.start()
    _, sec = timed(lambda: scorer.curve(seqs, rates=rate_grid(0.02, 0.98, 0.02), num_masks=1))
    peak_rss = sampler.stop()
    if device.startswith("cuda"):
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    else:
        peak = (peak_rss - base_rss) / 2**20
    queue.put((budget, peak, sec, np.mean([len(s.split()) for s in seqs])))


def main(argv=None):
    p = argparse.ArgumentParser(description="MaskedLMScorer vs a naive loop on AntiBERTy")
    p.add_argument("--seqs", type=int, default=2, help="sequences for pyro_mpt (default 2)")
    p.add_argument("--naive-seqs", type=int, default=None,
                   help="sequences for the naive loop (default: the same as pyro_mpt, for a like-for-like speed-up)")
    p.add_argument("--max-residues", type=int, default=None, help="truncate chains (default: full, ~110-120)")
    p.add_argument("--max-tokens", type=int, default=8192, help="token budget of pyro_mpt (default 8192)")
    p.add_argument("--threads", type=int, default=1, help="torch threads for both (default 1)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=3, help="alternating timing rounds; best time kept (default 3)")
    p.add_argument("--memory-budgets", type=int, nargs="*", default=[512, 2048, 8192, 32768])
    p.add_argument("--memory-seqs", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="32-residue chains, one round, 2 budgets")
    args = p.parse_args(argv)
    if args.quick:
        args.max_residues, args.memory_budgets, args.repeats = args.max_residues or 32, args.memory_budgets[:2], 1
    torch.set_num_threads(args.threads)
    from pyro_mpt.adapters import PAPER_MLM_RATES, MaskedLMScorer
    from pyro_mpt.adapters.rates import mask_counts

    model, tok = _load()
    model.to(args.device)
    seqs = _sequences(args.seqs, args.max_residues)
    naive_seqs = seqs if args.naive_seqs is None else seqs[: args.naive_seqs]
    L = np.mean([len(s.split()) for s in seqs])
    print(f"AntiBERTy, {args.device}, {args.threads} thread(s); {len(seqs)} chains of mean length {L:.0f} "
          f"(+2 special tokens); token budget {args.max_tokens}")
    scorer = MaskedLMScorer(model, tok, max_tokens=args.max_tokens)
    scorer.pll([seqs[0]])  # warm-up

    rows = []
    lengths = [len(tok(s)["input_ids"]) for s in seqs]  # with the special tokens
    passes = mask_counts(PAPER_MLM_RATES, [t - 2 for t in lengths])
    flops = {  # encoder FLOPs per sequence, (pyro_mpt, naive): one pass per distinct mask vs one per rate
        "99-rate curve": [(len(torch.unique(m)) * _encoder_flops(model.config, t),
                           len(PAPER_MLM_RATES) * _encoder_flops(model.config, t)) for m, t in zip(passes, lengths)],
        "PLL": [((t - 2) * _encoder_flops(model.config, t),) * 2 for t in lengths],
    }
    # the machine is shared: alternate the two implementations and keep each one's best time
    tasks = {
        "99-rate curve": (lambda: scorer.curve(seqs, rates=PAPER_MLM_RATES, num_masks=1).per_item,
                          lambda: _naive_curve(model, tok, scorer, naive_seqs, args.device)),
        "PLL": (lambda: scorer.pll(seqs).numpy(), lambda: _naive_pll(model, tok, naive_seqs, args.device)),
    }
    for task, (fast_fn, naive_fn) in tasks.items():
        t_fast, t_naive = [], []
        for _ in range(args.repeats):
            fast, t = timed(fast_fn)
            t_fast.append(t)
            naive, t = timed(naive_fn)
            t_naive.append(t)
        diff = np.abs(naive - fast[: len(naive_seqs)]).max()
        fast_flops = sum(f for f, _ in flops[task])
        naive_flops = sum(f for _, f in flops[task][: len(naive_seqs)])
        # naive FLOPs per pyro_mpt FLOP on the same sequences
        ratio = naive_flops / sum(f for f, _ in flops[task][: len(naive_seqs)])
        rows.append((task, len(seqs) / min(t_fast), len(naive_seqs) / min(t_naive), diff,
                     fast_flops / min(t_fast) / 1e9, naive_flops / min(t_naive) / 1e9, ratio))

    print(f"\n{'task':15s} {'pyro_mpt seq/s':>15s} {'naive seq/s':>12s} {'speed-up':>9s} {'max |diff|':>11s}")
    for task, fast, slow, d, *_ in rows:
        print(f"{task:15s} {fast:15.4f} {slow:12.4f} {fast / slow:8.1f}x {d:11.2e}")

    if args.device == "cpu":
        peak = _gemm_peak(model.config, args.threads)
        print(f"\nencoder GFLOP/s against a 4096x{model.config.hidden_size}x{model.config.intermediate_size} "
              f"float32 GEMM ({peak:.1f} GFLOP/s, {args.threads} thread(s), same run)")
        print(f"{'task':15s} {'pyro_mpt':>9s} {'naive':>9s} {'pyro_mpt/peak':>14s} {'naive/peak':>11s} "
              f"{'FLOP ratio':>11s} {'ceiling':>8s}")
        for task, _, _, _, gf, gn, ratio in rows:
            print(f"{task:15s} {gf:9.1f} {gn:9.1f} {gf / peak:14.0%} {gn / peak:11.0%} {ratio:10.2f}x "
                  f"{ratio * peak / gn:7.1f}x")

    if args.memory_budgets:
        print(f"\npeak memory vs token budget ({args.memory_seqs} heavy+light chain(s), 49 rates, fresh process each)")
        print(f"{'max_tokens':>10s} {'peak MiB':>9s} {'seconds':>8s} {'tokens/s':>9s}")
        ctx = mp.get_context("spawn")
        for budget in args.memory_budgets:
            q = ctx.Queue()
            proc = ctx.Process(target=_memory_child, args=(budget, args.memory_seqs, args.threads, args.device, q))
            proc.start()
            budget, peak, sec, length = q.get()
            proc.join()
            tokens = args.memory_seqs * 49 * (length + 2)
            print(f"{budget:10d} {peak:9.1f} {sec:8.1f} {tokens / sec:9.0f}")
    return rows


if __name__ == "__main__":
    main()
