"""FPTAS for balanced micro-group assignment (Infinite Sampling, Alg. 2).

Problem (P||Cmax): split samples with estimated lengths c_i into `num_bins` bins (decode slots; each slot runs its
bin's samples one after another) so that the largest bin total — the decode steps of the plan — is minimal.

Like Alg. 2, lengths are rounded to a grid of K tokens; unlike Alg. 2's capacity-bounded first fit (which can fail
to place a sample), the rounded problem is then solved *exactly* by a dynamic program over sorted bin-load vectors
(Sahni-style state space, items in descending order, states above the rounded LPT makespan pruned). With
K = eps * LB / n (LB = max(sum/m, max c) <= OPT, n items) each bin's rounding error is below n * K = eps * LB, so

    makespan(plan) <= OPT + eps * LB <= (1 + eps) * OPT.

Only "large" items (c_i >= eps * LB) go through the DP; small ones are then added to the least-loaded bin, which
keeps the bound (a bin that ends on a small item had load <= LB before it). The result is never worse than LPT.

If the state space would exceed `max_states`, K is doubled until it fits and the returned bound says so
(`eps_effective`); tests check the bound against brute force.
"""

from __future__ import annotations

import math


def lpt(costs: list[float], num_bins: int) -> list[list[int]]:
    """Longest processing time first: each item to the currently least-loaded bin (a 4/3-approximation)."""
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    loads = [0.0] * num_bins
    for i in sorted(range(len(costs)), key=lambda i: -costs[i]):
        b = min(range(num_bins), key=lambda j: loads[j])
        bins[b].append(i)
        loads[b] += costs[i]
    return bins


def makespan(costs: list[float], bins: list[list[int]]) -> float:
    return max((sum(costs[i] for i in b) for b in bins), default=0.0)


def fptas_partition(costs: list[float], num_bins: int, eps: float = 0.1,
                    max_states: int = 20000) -> tuple[list[list[int]], float]:
    """Bins of item indices (each bin in descending cost order) and the guaranteed relative bound eps_effective:
    makespan <= (1 + eps_effective) * optimum."""
    if not 0.0 < eps <= 1.0:
        raise ValueError(f"`fptas_epsilon` must be in (0, 1], got {eps!r}.")
    if num_bins < 1:
        raise ValueError(f"the number of bins must be >= 1, got {num_bins!r}.")
    n = len(costs)
    if n <= num_bins:
        return [[i] for i in range(n)] + [[] for _ in range(num_bins - n)], 0.0
    lb = max(sum(costs) / num_bins, max(costs))
    if lb <= 0:
        return lpt(costs, num_bins), 0.0
    large = [i for i in range(n) if costs[i] >= eps * lb]
    grid = eps * lb / max(1, len(large))
    while True:
        plan = _solve_rounded([costs[i] for i in large], num_bins, grid, max_states)
        if plan is not None:
            break
        grid *= 2.0
    bins = [[large[i] for i in b] for b in plan]
    loads = [sum(costs[i] for i in b) for b in bins]
    for i in sorted(set(range(n)) - set(large), key=lambda i: -costs[i]):  # small items: least-loaded bin
        b = min(range(num_bins), key=lambda j: loads[j])
        bins[b].append(i)
        loads[b] += costs[i]
    bound = max(eps, grid * max(1, len(large)) / lb)
    greedy = lpt(costs, num_bins)
    return (greedy if makespan(costs, greedy) < max(loads) else bins), bound


def _solve_rounded(costs, num_bins, grid, max_states):
    order = sorted(range(len(costs)), key=lambda i: -costs[i])
    r = [math.floor(costs[i] / grid) for i in order]  # [n] rounded-down lengths, descending
    upper = makespan([float(x) for x in r], lpt([float(x) for x in r], num_bins))  # rounded LPT makespan
    start = (0,) * num_bins
    layers: list[dict[tuple, tuple[tuple, int]]] = []  # per item: state -> (parent state, sorted position)
    states = {start: (None, -1)}
    for ri in r:
        nxt: dict[tuple, tuple[tuple, int]] = {}
        for s in states:
            prev = None
            for j, load in enumerate(s):
                if load == prev:
                    continue  # equal loads are interchangeable
                prev = load
                if load + ri > upper:
                    continue
                t = tuple(sorted(s[:j] + (load + ri,) + s[j + 1 :]))
                if t not in nxt:
                    nxt[t] = (s, j)
        if len(nxt) > max_states:
            return None
        layers.append(nxt)
        states = nxt
    best = min(states, key=max)
    return _reconstruct(layers, best, order, r, num_bins)


def _reconstruct(layers, final, order, r, num_bins):
    path = []
    s = final
    for layer in reversed(layers):
        parent, j = layer[s]
        path.append(j)
        s = parent
    path.reverse()
    loads = [(0, b) for b in range(num_bins)]  # (rounded load, bin id), kept sorted by load like the DP states
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    for item, ri, j in zip(order, r, path):
        load, b = loads[j]  # bins of equal load are interchangeable, as in the DP
        bins[b].append(item)
        loads[j] = (load + ri, b)
        loads.sort(key=lambda x: x[0])
    return bins
