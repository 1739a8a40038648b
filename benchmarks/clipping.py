"""Benchmark ``clip_update`` (clip + statistics) for every budget method.

Layouts: (a) the alpha-split paper's Table I (64 encoder groups of 30,720, 44 LLM groups of
16,384, 2 connector groups of 2,048; 2.69 M parameters) and (b) a 100 M-parameter layout of
1,000 groups (sizes spread 2x around 100,000). Updates are float32 Gaussian, scaled so every
group exceeds its budget (the worst case: every tensor is rewritten).

Reported per method: best-of-N time, its ratio to flat clipping measured in the same run, and the
effective bandwidth as a fraction of a plain torch copy of the same bytes (``dst.copy_(src)`` of
one contiguous, preallocated buffer of the update's size, i.e. ``time_copy / time_clip``) and
of ``tensor.clone()`` of every update tensor (which, like clipping, writes fresh memory). The
same methods are also timed with ``inplace=True`` (no new buffer: the path the engine's client
uses on its own delta; "vs flat" is then against flat in place), and on a *packed* update
(``pack_update``: views of one buffer, as the server decodes replies). Targets: per-group methods
<= 1.3x flat, >= 40 % of copy bandwidth.

Run::

    python benchmarks/clipping.py [--repeats 7] [--threads N] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import math
import os
import time

import torch

from speechbrain_fl.privacy import (
    METHODS,
    EMABudgetState,
    Group,
    Layout,
    clip_update,
    compute_budgets,
)
from speechbrain_fl.privacy.clipping.packing import pack_update


def table1_layout() -> Layout:
    groups = [Group(f"encoder.{i}", "encoder", 30720) for i in range(64)]
    groups += [Group(f"llm.{i}", "llm", 16384) for i in range(44)]
    groups += [Group(f"connector.{i}", "connector", 2048) for i in range(2)]
    return Layout(groups)


def big_layout(total: int = 100_000_000, n_groups: int = 1000) -> Layout:
    gen = torch.Generator().manual_seed(0)
    w = torch.rand(n_groups, generator=gen, dtype=torch.float64) + 0.5  # sizes within 3x
    sizes = (w / w.sum() * total).long()
    sizes[-1] += total - int(sizes.sum())
    comps = ["encoder"] * (n_groups // 2) + ["llm"] * (n_groups - n_groups // 2 - 2)
    comps += ["connector"] * 2
    return Layout(
        Group(f"g{i}", c, int(s))
        for i, (c, s) in enumerate(zip(comps, sizes.tolist(), strict=True))
    )


def budgets_for(layout: Layout, method: str):
    if method == "alpha_split":
        return compute_budgets(layout, method=method, clip=1.0, alpha=0.05)
    if method.endswith("_ema"):
        ema = EMABudgetState(layout, base="dim" if "dim" in method else "uniform", warmup_rounds=0)
        ema.update({g.name: 1.0 + (i % 7) for i, g in enumerate(layout)})
        return compute_budgets(layout, method=method, clip=1.0, ema_state=ema)
    return compute_budgets(layout, method=method, clip=1.0)


MODES = ("", "in place", "packed", "packed, in place")


def bench(name: str, layout: Layout, *, repeats: int, device: str) -> list[str]:
    """Time every (method, mode) and the two baselines, interleaved round-robin, best of N.

    Each timed call is preceded by an untimed restore of the update it scales in place, so every
    call clips a fully over-budget update, or, for a copying call, by the same allocation of an
    update-sized set of tensors (``fresh_memory_state``); interleaving makes machine load hit
    every variant and the ``copy_`` baseline alike (read the ratios).
    """
    gen = torch.Generator(device=device).manual_seed(0)
    update = {g.name: torch.randn(g.numel, generator=gen, device=device) * 10.0 for g in layout}
    tensors = list(update.values())
    total = sum(t.numel() for t in tensors)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    src = torch.empty(total, device=device)
    dst = torch.empty_like(src)
    own = {k: torch.empty_like(t) for k, t in update.items()}  # separate tensors, scaled in place
    own_list = list(own.values())
    packed_src = pack_update(update)  # views of one buffer, never written
    packed_own = pack_update(update)  # views of one buffer, scaled in place
    packed_own_list = list(packed_own.values())

    def nothing():
        return None

    variants = {
        "copy_": (nothing, lambda: dst.copy_(src)),
        "clone": (nothing, lambda: [t.clone() for t in tensors]),
    }

    def fresh_memory_state():
        """Allocate and free update-sized tensors, as the ``clone`` baseline does.

        A copying call writes fresh memory, whose cost depends on what the allocator holds
        (freed chunks it reuses, or pages the kernel must fault in). Preceding every copying
        call by the same allocation puts each in the state ``flat`` alone had when it ran
        right after ``clone``, so "vs flat" compares the methods, not the order.
        """
        clones = [t.clone() for t in tensors]
        del clones

    for method in METHODS:
        b = budgets_for(layout, method)
        variants[(method, "")] = (
            fresh_memory_state,
            lambda b=b: clip_update(update, b, layout=layout),
        )
        variants[(method, "in place")] = (
            lambda: torch._foreach_copy_(own_list, tensors),
            lambda b=b: clip_update(own, b, layout=layout, inplace=True),
        )
        variants[(method, "packed")] = (
            fresh_memory_state,
            lambda b=b: clip_update(packed_src, b, layout=layout),
        )
        variants[(method, "packed, in place")] = (
            lambda: torch._foreach_copy_(packed_own_list, tensors),
            lambda b=b: clip_update(packed_own, b, layout=layout, inplace=True),
        )
    best = {k: math.inf for k in variants}
    for _ in range(repeats + 1):  # the first pass is a warm-up like the others: best of N+1
        for key, (prepare, fn) in variants.items():
            prepare()
            sync()
            t0 = time.perf_counter()
            out = fn()
            sync()
            best[key] = min(best[key], time.perf_counter() - t0)
            del out
    t_copy, t_clone = best["copy_"], best["clone"]
    rows = []
    for mode in MODES:
        flat = best[("flat", mode)]
        for method in METHODS:
            t = best[(method, mode)]
            label = f"{method}, {mode}" if mode else method
            rows.append(
                f"| {name} | {label} | {t * 1e3:.2f} | {t / flat:.2f} | {t_copy / t:.0%} "
                f"| {t_clone / t:.0%} |"
            )
    rows.append(f"| {name} | *copy_ of {nbytes / 1e6:.0f} MB* | {t_copy * 1e3:.2f} | | 100% | |")
    rows.append(f"| {name} | *clone of each tensor* | {t_clone * 1e3:.2f} | | | 100% |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--skip-big", action="store_true", help="only the Table I layout")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__}, device {args.device}, threads {torch.get_num_threads()}, "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, cores {os.cpu_count()}, "
        f"best of {args.repeats}"
    )
    print()
    print("| layout | method | time (ms) | vs flat | vs copy_ bandwidth | vs clone bandwidth |")
    print("|---|---|---:|---:|---:|---:|")
    layouts = [("Table I (2.69 M, 110 groups)", table1_layout())]
    if not args.skip_big:
        layouts.append(("100 M, 1,000 groups", big_layout()))
    for name, layout in layouts:
        for row in bench(name, layout, repeats=args.repeats, device=args.device):
            print(row, flush=True)


if __name__ == "__main__":
    main()
