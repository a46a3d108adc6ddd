"""Medusa trees: choice paths as draft nodes, the best tree from measured per-rank
accuracies, and siblings drawn for sampled trees (see :mod:`specdec.proposers.medusa.proposer`)."""

from __future__ import annotations

import heapq

import torch

from specdec.decoders.engine.sampling import sample


def build_tree(choices: list[list[int]], num_heads: int) -> tuple[list[int], list[int], list[int]]:
    """Medusa choice paths -> (depths, ranks, parents) of the draft nodes.

    Paths are sorted by (length, ranks), so parents precede children and each
    node's first child is its rank-0 child: the all-0 path is the principal path.
    """
    paths = sorted((tuple(int(r) for r in path) for path in choices), key=lambda p: (len(p), p))
    index: dict[tuple[int, ...], int] = {}
    depths, ranks, parents = [], [], []
    for path in paths:
        if not path or min(path) < 0:
            raise ValueError(f"proposer.tree path {list(path)} must be a non-empty list of ranks >= 0")
        if len(path) > num_heads:
            raise ValueError(f"proposer.tree path {list(path)} is deeper than the {num_heads} heads in use")
        if path in index:
            raise ValueError(f"proposer.tree lists path {list(path)} twice")
        if len(path) > 1 and path[:-1] not in index:
            raise ValueError(f"proposer.tree path {list(path)} needs its prefix {list(path[:-1])} too")
        index[path] = len(depths)
        depths.append(len(path) - 1)
        ranks.append(path[-1])
        parents.append(index[path[:-1]] if len(path) > 1 else -1)
    return depths, ranks, parents


def best_tree(rank_accuracy: list[list[float]], num_nodes: int) -> list[list[int]]:
    """The ``num_nodes`` paths with the highest expected acceptance.

    rank_accuracy[k][r]: how often head k's rank-r token is the right one.
    Treating heads as independent, a path is accepted with the product of its
    ranks' accuracies, and tau = 1 + the sum of that over the tree's nodes; a
    path never beats its prefix, so taking the best paths one by one keeps the
    tree closed under prefixes.
    """
    chosen: list[list[int]] = []
    frontier = [(-acc, (rank,)) for rank, acc in enumerate(rank_accuracy[0])]
    heapq.heapify(frontier)
    while frontier and len(chosen) < num_nodes:
        negative_value, path = heapq.heappop(frontier)
        chosen.append(list(path))
        if len(path) < len(rank_accuracy):
            for rank, acc in enumerate(rank_accuracy[len(path)]):
                heapq.heappush(frontier, (negative_value * acc, path + (rank,)))
    return chosen


def draw_siblings(
    probs: torch.Tensor, owner: list[int], iid: bool, generator: torch.Generator
) -> list[tuple[int, torch.Tensor]]:
    """(token, the row it was drawn from) for each node of a tree level; node j's parent's
    distribution is ``probs[owner[j]]`` (probs: (P, rows)), siblings in draft order.

    i.i.d.: every sibling draws from its parent's row. Without replacement: each draws
    from its parent's row without the tokens its earlier siblings drew, renormalised (if
    they took all the mass, from the whole row again); every token is still drawn from
    the row recorded for it, which is what keeps the tree verifier lossless."""
    if iid:
        rows = probs[owner]  # (len(owner), rows)
        return list(zip(sample(rows, generator).tolist(), rows))
    remaining = probs.clone()
    drawn: list[tuple[int, torch.Tensor]] = []
    for parent in owner:
        left = remaining[parent]
        total = left.sum()
        row = left / total if total > 0 else probs[parent]
        token = int(sample(row, generator))
        remaining[parent, token] = 0.0
        drawn.append((token, row))
    return drawn
