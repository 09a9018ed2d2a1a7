"""Speculative decoding over a token tree, lossless: the drafter proposes a tree, one target forward scores every
node (:meth:`CachedLM.forward_tree`), the round keeps the longest path the target agrees with plus the target's
own next token, and the cache keeps that path's entries only (:meth:`CachedLM.keep_path`). A chain is a tree of
width 1, and then this is plain SD token for token (greedy and, with the same seed, sampling)."""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from .common import (
    FULL,
    GREEDY,
    CachedLM,
    Result,
    Round,
    RoundHook,
    Sampling,
    Sequence,
    draft_budget,
    probs_from_logits,
    residual,
    run_rounds,
)
from .tree import Tree


class TreeDrafter(Protocol):
    """Proposes a tree each round (and counts it in ``stats.drafted``); sees the target's logits of every node
    afterwards (``observe``: token recycling learns from them, a draft model keeps its accepted entries)."""

    kind: str

    def tree(self, seq: Sequence, depth: int) -> Tree: ...

    def observe(self, seq: Sequence, tree: Tree, logits: torch.Tensor, path: list[int]) -> None: ...

    def rollback(self, length: int, floor: int) -> None: ...


def verify_tree(
    logits: torch.Tensor, tree: Tree, sampling: Sampling, gen: torch.Generator | None
) -> tuple[list[int], int]:
    """The accepted path (node indices, root to leaf) and the target's token after it, from the target's logits
    ``[1 + n, V]`` (row 0 after the sequence, row ``1 + i`` after node ``i``).

    Greedy: from the root, follow the child whose token is the target's argmax; stop where no child is; the
    argmax there is the next token. One host read.

    Sampling (multi-candidate speculative sampling, SpecInfer's recursive rejection): at a node with target
    distribution p, test its children in node order against a running target r (first r = p). A child x drawn
    from q (a sampled node) is accepted with probability min(1, r(x)/q(x)); a deterministic child with
    probability r(x) (q one-hot on x). Accepted: descend into it. Rejected: r ← norm(max(r − q, 0)) and try the
    next sibling. No sibling left: the next token is drawn from r (from p at a leaf: the bonus token).

    Why it is exact: one test is the standard speculative-sampling step, whose output (the candidate, or else a
    draw from the residual) is distributed as r whenever x ~ q. Replacing "a draw from the residual" by "the
    same step for the next sibling against the residual" therefore keeps the output distributed as r, by
    induction over the siblings, provided each sampled sibling is a fresh draw from its q whose presence was
    decided before it was drawn (never dropped for its value). Deterministic siblings need nothing: whatever set
    of them follows, testing them one by one is sampling without replacement from r (accept x₁ w.p. r(x₁), else
    x₂ w.p. r(x₂)/(1 − r(x₁)), …), whose output is distributed as r, so they may depend on anything drawn before
    the verification (other nodes' draws included), only not on its uniforms. So the first token is distributed
    as p; given it was an accepted child, the walk continues at that child with fresh uniforms: the same argument
    one level down. One uniform is drawn per node up front, as the chain rule draws one per draft, so a width-1
    tree repeats the chain rule's draws exactly.
    """
    kids = tree.children()
    if sampling.greedy:
        choice = logits.argmax(-1).tolist()
        node, path = -1, []
        while True:
            token = choice[node + 1]
            nxt = next((c for c in kids[node] if tree.tokens[c] == token), None)
            if nxt is None:
                return path, token
            path.append(nxt)
            node = nxt
    p = probs_from_logits(logits, sampling)
    q = None if tree.q_logits is None else probs_from_logits(tree.q_logits, sampling)
    u = torch.rand(tree.n, device=logits.device, generator=gen)
    node, path = -1, []
    while True:
        r = p[node + 1]
        for c in kids[node]:
            x = tree.tokens[c]
            q_row = q[c] if tree.is_sampled(c) and q is not None else None
            q_x = torch.ones((), device=r.device) if q_row is None else q_row[x]
            if bool(u[c] * q_x < r[x]):  # u < r/q without dividing by a zero q
                break
            r = residual(
                r,
                F.one_hot(torch.tensor(x, device=r.device), r.numel()).to(r.dtype)
                if q_row is None
                else q_row,
            )
        else:
            return path, int(torch.multinomial(r, 1, generator=gen))
        path.append(c)
        node = c


def generate(
    full: CachedLM,
    drafter: TreeDrafter,
    seq: Sequence,
    max_new_tokens: int,
    eos_ids: set[int],
    gamma: int,
    sampling: Sampling = GREEDY,
    gen: torch.Generator | None = None,
    on_round: RoundHook | None = None,
) -> Result:
    """``full``: the target over its cache; ``drafter`` proposes a tree each round, no deeper than γ or than what
    max_new_tokens still leaves (besides the target's own token). ``on_round``: see :func:`run_rounds` (every
    emitted token is final: the target verified it)."""
    stats = full.stats

    def one_round(seq: Sequence) -> Round:
        tree = drafter.tree(seq, draft_budget(gamma, max_new_tokens, seq.length - seq.prompt_len))
        logits = full.forward_tree(seq.ids, tree)
        path, last = verify_tree(logits, tree, sampling, gen)
        full.keep_path(tree.n, path)
        drafter.observe(seq, tree, logits, path)
        stats.tree_nodes_verified += tree.n
        stats.tree_depth_accepted += len(path)
        tokens = [tree.tokens[i] for i in path] + [last]
        return Round(seq.length, tokens, [FULL] * len(tokens))

    return run_rounds(one_round, seq, max_new_tokens, eos_ids, full, drafter, on_round=on_round)
