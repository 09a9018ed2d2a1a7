"""The tree drafters against brute force: the suffix automaton's counts and continuations, the lookup tree, the
recycling table, the draft model's tree, and the merge under a node budget."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import VOCAB, noisy_copy, tiny_model

from viasd_tune.decoding.common import CachedLM, Sampling, Sequence, Stats
from viasd_tune.decoding.tree_drafters import (
    LookupSource,
    ModelSource,
    Proposal,
    RecycleSource,
    RecycleTable,
    SuffixAutomaton,
    merge,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: many tiny forwards, one thread


def occurrences(text: list[int], s: list[int]) -> int:
    n = len(s)
    return sum(text[i : i + n] == s for i in range(len(text) - n + 1))


def texts(seed: int, count: int = 30):
    rng = random.Random(seed)
    for _ in range(count):
        alphabet = rng.randint(1, 5)
        text = [rng.randrange(alphabet) for _ in range(rng.randint(1, 40))]
        if rng.random() < 0.5:  # a repeated chunk, as code and quotes have
            start = rng.randrange(len(text))
            text += text[start : start + rng.randint(1, 10)]
        yield text


def state_of(sam: SuffixAutomaton, s: list[int]) -> int | None:
    v = 0
    for t in s:
        v = sam.next[v].get(t)
        if v is None:
            return None
    return v


def test_suffix_automaton_counts_and_continuations_match_brute_force():
    for text in texts(0):
        sam = SuffixAutomaton()
        for i, t in enumerate(text):
            sam.extend(t)
            seen = text[: i + 1]
            # every substring's state counts its occurrences, and its transitions are its continuations
            for a in range(len(seen)):
                for b in range(a + 1, min(len(seen), a + 6) + 1):
                    s = seen[a:b]
                    v = state_of(sam, s)
                    assert v is not None and sam.cnt[v] == occurrences(seen, s), (seen, s)
                    follow = {
                        seen[j + len(s)] for j in range(len(seen) - len(s)) if seen[j : j + len(s)] == s
                    }
                    assert set(sam.next[v]) == follow
        # match(): the longest suffix that also occurs earlier with a continuation
        best = 0
        for n in range(1, len(text)):
            if occurrences(text[:-1], text[-n:]) > 0:
                best = n
        assert sam.len[sam.match()] == best, text


def test_lookup_tree_holds_only_continuations_that_occur_best_first():
    rng = random.Random(1)
    for text in texts(2):
        depth, width, budget = rng.randint(1, 6), rng.randint(1, 3), rng.randint(1, 20)
        source = LookupSource(depth=depth, width=width)
        seq = Sequence(torch.tensor(text[:-5] or text[:1]), len(text) + 1)
        source.propose(seq, depth, budget)  # the index grows with the sequence, no rescan
        seq.append(text[len(seq.tokens) :], [0] * (len(text) - len(seq.tokens)))
        prop = source.propose(seq, depth, budget)
        assert source.sam.size == len(text)
        assert prop.n <= budget and prop.depth() <= depth
        suffix = text[len(text) - source.sam.len[source.sam.match()] :]
        kids: dict[int, int] = {}
        for i in range(prop.n):
            path = []
            j = i
            while j >= 0:
                path.append(prop.tokens[j])
                j = prop.parents[j]
            path = suffix + path[::-1]
            assert occurrences(text, path) > 0, (
                "the lookup proposes only what followed the suffix in the text"
            )
            p = prop.parents[i]
            kids[p] = kids.get(p, 0) + 1
            assert 0 < prop.scores[i] <= (1.0 if p < 0 else prop.scores[p])
        assert max(kids.values(), default=0) <= width
        if suffix and budget >= width:  # the most frequent continuation is the first node
            follow = [
                text[j + len(suffix)]
                for j in range(len(text) - len(suffix))
                if text[j : j + len(suffix)] == suffix
            ]
            assert follow.count(prop.tokens[0]) == max(follow.count(t) for t in set(follow))


def test_recycle_table_keeps_each_tokens_top_k_successors():
    table = RecycleTable(VOCAB, 3)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, VOCAB, generator=g)
    tokens = [7, 9, 7, 11, 12]  # 7 twice: the later row wins
    table.update(tokens, logits)
    for row, t in ((1, 9), (2, 7), (3, 11), (4, 12)):
        top = torch.softmax(logits[row], -1).topk(3)
        assert table.succ[t].tolist() == top.indices.tolist()
        torch.testing.assert_close(torch.from_numpy(table.prob[t]), top.values)
    assert (table.succ[0] == -1).all()
    source = RecycleSource(VOCAB, depth=2, width=3)
    source.table = table
    seq = Sequence(torch.tensor([4, 7]), 8)
    prop = source.propose(seq, 2, 100)
    assert prop.tokens[:3] == table.succ[7].tolist()  # the root's children: 7's successors, best first
    for i in range(prop.n):
        parent_token = 7 if prop.parents[i] < 0 else prop.tokens[prop.parents[i]]
        assert prop.tokens[i] in table.succ[parent_token].tolist()


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(1.0)], ids=str)
@torch.inference_mode()
def test_model_tree_nodes_are_the_draft_models_top_k_on_their_paths(sampling):
    from test_cache import reference_logits

    from viasd_tune.routing import SkipSet

    target = tiny_model("llama", seed=0, layers=2)
    draft = noisy_copy(target, 0.2, seed=1)
    rng = random.Random(3)
    for trial in range(6):
        width, depth, budget = rng.randint(1, 4), rng.randint(1, 5), rng.randint(1, 16)
        lm = CachedLM(draft, tier="draft", stats=Stats())
        gen = torch.Generator().manual_seed(trial)
        source = ModelSource(lm, depth, width, sampling, gen)
        seq = Sequence(torch.tensor([rng.randrange(3, VOCAB) for _ in range(rng.randint(2, 12))]), 64)
        prop = source.propose(seq, depth, budget)
        assert 0 < prop.n <= budget and prop.depth() <= depth
        assert lm.stats.draft_calls == min(
            depth, prop.depth() + (prop.depth() < depth)
        )  # one forward per level
        for i in range(prop.n):
            path, j = [], prop.parents[i]
            while j >= 0:
                path.append(prop.tokens[j])
                j = prop.parents[j]
            logits = reference_logits(draft, seq.tokens + path[::-1], SkipSet())[-1]
            if prop.q_rows[i] is not None:  # sampled: drawn from the draft's logits at its parent
                torch.testing.assert_close(prop.q_rows[i], logits, atol=1e-4, rtol=0)
            else:
                assert prop.tokens[i] in logits.topk(width).indices.tolist()
            score = 1.0 if prop.parents[i] < 0 else prop.scores[prop.parents[i]]
            assert abs(prop.scores[i] - score * float(torch.softmax(logits, -1)[prop.tokens[i]])) < 1e-4
        if not sampling.greedy:  # every expanded node got one sampled child, before its other children
            kids: dict[int, list[int]] = {}
            for i, p in enumerate(prop.parents):
                kids.setdefault(p, []).append(i)
            for children in kids.values():
                assert prop.q_rows[children[0]] is not None
                assert all(prop.q_rows[c] is None for c in children[1:])


def test_merge_keeps_the_best_nodes_with_their_parents_and_every_sampled_node():
    rng = random.Random(4)
    row = torch.zeros(VOCAB)
    for _ in range(200):
        proposals = []
        for _ in range(rng.randint(1, 3)):
            prop = Proposal()
            taken = set()  # a source proposes a (parent, token) once
            for _ in range(rng.randint(0, 12)):
                parent, token = rng.randint(-1, prop.n - 1), rng.randrange(3, 8)
                if (parent, token) in taken:
                    continue
                taken.add((parent, token))
                ceiling = 1.0 if parent < 0 else prop.scores[parent]
                sampled = rng.random() < 0.15 and len(proposals) == 0
                prop.add(parent, token, ceiling * rng.random(), row if sampled else None)
            proposals.append(prop)
        n_sampled = sum(r is not None for p in proposals for r in p.q_rows)
        budget = rng.randint(1, 16)
        tree, kept = merge(proposals, budget)
        depth_of = {i: d for i, d in enumerate(tree.depth)}
        assert tree.n <= max(budget, n_sampled + max(depth_of.values(), default=0))
        # no duplicate (parent, token) except two sampled draws
        pairs = [
            (p, t)
            for p, t, s in zip(tree.parents, tree.tokens, tree.sampled or [False] * tree.n, strict=True)
            if not s
        ]
        assert len(pairs) == len(set(pairs))
        # each kept node of a proposal is the node with its path
        for prop, mine in zip(proposals, kept, strict=True):
            for node, i in mine.items():
                assert tree.tokens[node] == prop.tokens[i]
                p = prop.parents[i]
                assert (tree.parents[node] == -1) == (p < 0)
                if p >= 0:
                    assert mine[tree.parents[node]] == p
            for i, r in enumerate(prop.q_rows):  # sampled nodes are always kept
                assert r is None or i in mine.values()
        # siblings: sampled first
        if tree.sampled:
            for p in set(tree.parents):
                flags = [tree.sampled[c] for c in range(tree.n) if tree.parents[c] == p]
                assert flags == sorted(flags, reverse=True)
        if n_sampled == 0:  # best first: the budget's best nodes (scores never grow along a path)
            scores: dict[tuple, float] = {}
            for path, score in _all_paths(proposals):
                scores[path] = max(scores.get(path, 0.0), score)
            kept_paths = set(_paths(tree.tokens, tree.parents))
            assert len(kept_paths) == min(budget, len(scores))
            left = [v for path, v in scores.items() if path not in kept_paths]
            assert not left or max(left) <= min(scores[path] for path in kept_paths) + 1e-12


def _paths(tokens, parents) -> list[tuple]:
    out: list[tuple] = []
    for t, p in zip(tokens, parents, strict=True):
        out.append((out[p] if p >= 0 else ()) + (t,))
    return out


def _all_paths(proposals):
    """Every node the proposals hold, as (its token path, its score)."""
    for prop in proposals:
        yield from zip(_paths(prop.tokens, prop.parents), prop.scores, strict=True)
