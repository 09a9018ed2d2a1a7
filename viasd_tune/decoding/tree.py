"""Token trees: the type and the attention mask that lets one forward score every node (the cache keeps the
accepted path's entries afterwards: ``SharedKVCache.keep_path``).

A tree hangs below the sequence's last token (the root, not a node). Node ``i`` has a token and a parent index
(``-1``: the root; otherwise an earlier node), so node order is topological and a chain of γ drafts is the tree
with parents ``-1, 0, 1, …``. In one forward each node sees the committed prefix and its own ancestors, at
position prefix length + depth, so its logits and its KV entries are exactly those of the sequence extended by its
path: a node's output depends on its path only.

Masks are additive floats (0 = attend, the dtype's minimum = masked) in the model's dtype: eager attention adds
the mask to the scores, so a boolean one would be read as 0/1 and silently attend everywhere; SDPA takes either.
The minimum is the model dtype's own (fp32's minimum is -inf in bf16). Every row attends at least to its own
token, so no row is fully masked (SDPA returns NaN for those).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch

from ..errors import UserError

# Attention implementations that take a custom 4-D mask as given (flash attention ignores it, flex wants a BlockMask).
TREE_ATTENTION = ("sdpa", "eager")


@dataclass
class Tree:
    """Draft tokens below the sequence's last token, one parent index per node (``-1``: the root).

    ``q_logits`` (``[n, V]``, sampling only) holds, for each node the drafter *sampled*, the logits it was drawn
    from; ``sampled`` marks those nodes. Every other node is a deterministic (one-hot) proposal. Among siblings,
    sampled nodes come first: verification tests siblings in node order, and a deterministic proposal may depend
    on (e.g. be deduplicated against) the sampled ones before it, never the other way round.
    """

    tokens: list[int]
    parents: list[int]
    q_logits: torch.Tensor | None = None
    sampled: list[bool] | None = None
    _depth: list[int] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents):
            raise ValueError("a tree needs one parent per token")
        depth: list[int] = []
        for i, p in enumerate(self.parents):
            if not -1 <= p < i:
                raise ValueError(f"node {i}'s parent {p} is not an earlier node (or -1, the root)")
            depth.append(1 if p < 0 else depth[p] + 1)
        self._depth = depth
        if self.sampled is not None:
            seen_one_hot: set[int] = set()
            for i, p in enumerate(self.parents):
                if self.sampled[i] and p in seen_one_hot:
                    raise ValueError(f"sampled node {i} follows a deterministic sibling")
                if not self.sampled[i]:
                    seen_one_hot.add(p)

    @classmethod
    def chain(cls, tokens: Sequence[int], q_logits: torch.Tensor | None = None) -> Tree:
        """γ drafts as a width-1 tree (``q_logits``: every node sampled from its row)."""
        n = len(tokens)
        sampled = None if q_logits is None else [True] * n
        return cls(list(tokens), list(range(-1, n - 1)), q_logits, sampled)

    @property
    def n(self) -> int:
        return len(self.tokens)

    @property
    def depth(self) -> list[int]:
        """Depth of each node: 1 for the root's children."""
        return self._depth

    def children(self) -> dict[int, list[int]]:
        """Node → its children in node order (``-1``: the root's)."""
        out: dict[int, list[int]] = {-1: []}
        for i, p in enumerate(self.parents):
            out.setdefault(p, []).append(i)
            out.setdefault(i, [])
        return out

    def path(self, node: int) -> list[int]:
        """Nodes from the root's child down to ``node``."""
        out = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def is_sampled(self, i: int) -> bool:
        return self.sampled is not None and self.sampled[i]


def check_attention(model) -> None:
    """Refuse, in one line, an attention implementation that does not take a custom 4-D mask."""
    impl = getattr(model.config, "_attn_implementation", None) or "eager"
    if impl not in TREE_ATTENTION:
        raise UserError(
            f"token trees need attention that takes a 4-D mask (sdpa or eager), not {impl!r}; "
            "load the model with attn_implementation='sdpa' or use a chain (--tree-nodes 1)"
        )


def _segment(pending: int, tree: Tree, start: int) -> tuple[list[int], np.ndarray]:
    """The tokens after the committed prefix in cache order (the pending sequence tokens, then the tree nodes):
    each one's parent within that segment (-1: the prefix) and its position."""
    parents = [i - 1 for i in range(pending)]
    root = pending - 1  # the sequence's last token; -1 when it is already committed (a later draft level)
    parents += [root if p < 0 else pending + p for p in tree.parents]
    pos = np.concatenate(
        [np.arange(start, start + pending), start + pending - 1 + np.asarray(tree.depth, dtype=np.int64)]
    )
    return parents, pos


def _ancestors(parents: list[int]) -> np.ndarray:
    """``a[i, j]``: j is i or an ancestor of i (parents precede children)."""
    n = len(parents)
    a = np.eye(n, dtype=bool)
    for i, p in enumerate(parents):
        if p >= 0:
            a[i] |= a[p]
    return a


def visible(
    pending: int, tree: Tree, start: int, queries: int, window: int | None = None
) -> tuple[np.ndarray, int]:
    """Which keys each of the last ``queries`` segment tokens attends to, as a bool ``[queries, kv]`` array, and
    how many committed keys the layer returns before the segment (all ``start`` of them; a sliding layer only its
    last ``window - 1``, and a key counts only if it is less than ``window`` positions behind the query)."""
    parents, pos = _segment(pending, tree, start)
    anc = _ancestors(parents)[len(parents) - queries :]
    q_pos = pos[len(parents) - queries :, None]
    prefix = start if window is None else min(start, window - 1)
    prefix_pos = np.arange(start - prefix, start)
    seen = np.concatenate([np.broadcast_to(True, (queries, prefix)), anc], axis=1)
    if window is not None:
        seen &= q_pos - np.concatenate([prefix_pos, pos])[None, :] < window
    return seen, prefix


def additive(seen: np.ndarray, dtype: torch.dtype, device) -> torch.Tensor:
    """A bool visibility array as the additive ``[1, 1, q, kv]`` mask of ``dtype``: 0 where seen, else its min."""
    seen_t = torch.from_numpy(np.ascontiguousarray(seen)).to(device)
    zero = torch.zeros((), dtype=dtype, device=device)
    return torch.where(seen_t, zero, torch.finfo(dtype).min)[None, None]


def attention_mask(
    config, pending: int, tree: Tree, start: int, queries: int, dtype: torch.dtype, device
) -> torch.Tensor | dict[str, torch.Tensor]:
    """The mask of one tree forward (see :func:`visible`): one tensor, or, for a model with sliding-window layers,
    one per layer type (Gemma-3 and Qwen2 take such a mapping as it is)."""
    full = additive(visible(pending, tree, start, queries)[0], dtype, device)
    types = set(getattr(config, "layer_types", None) or ())
    if "sliding_attention" not in types:
        return full
    window = int(config.sliding_window)
    sliding = additive(visible(pending, tree, start, queries, window)[0], dtype, device)
    return {"full_attention": full, "sliding_attention": sliding}


def positions(pending: int, tree: Tree, start: int, fed: int, device) -> torch.Tensor:
    """Position ids ``[1, q]`` of the tokens one tree forward feeds: the pending ones, then nodes ``fed…``."""
    pos = _segment(pending, tree, start)[1]
    return torch.from_numpy(np.concatenate([pos[:pending], pos[pending + fed :]])).to(device).view(1, -1)


@contextmanager
def widened(cache, extra: int) -> Iterator[None]:
    """Let sliding-window layers return ``extra`` more keys for one forward: a draft level fed after earlier
    levels must still see ``window - 1`` committed keys behind those levels' entries (transformers returns the
    last ``window - 1 + new`` entries of a layer, counting the earlier levels' ones)."""
    layers = [lay for lay in cache.layers if getattr(lay, "is_sliding", False)] if extra else []
    for lay in layers:
        lay.sliding_window += extra
    try:
        yield
    finally:
        for lay in layers:
            lay.sliding_window -= extra
