"""Sampling over a token tree is exact: chi-square goodness of fit, as tests/test_sampling.py does for chains.

Unit level: ``tree_sd.verify_tree`` on fixed logits that depend only on a node's token and depth, so the
first emitted token must follow the root's distribution and, given it is a node's token, the next one that
node's distribution. Trees mix deterministic candidates (sampling without replacement from the residual) and
candidates drawn from a draft distribution (SpecInfer's recursive rejection). Each harness also runs a wrong
rule, which must fail. End to end: the first two tokens of ``Decoder.generate`` with a draft-model tree.
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model
from test_sampling import CHI2_CRIT_P001, N_SEEDS, PROMPT, V, assert_fits, fits, next_token_logits

from viasd_tune.config import DecodeConfig
from viasd_tune.decoding import tree_sd
from viasd_tune.decoding.common import Sampling, probs_from_logits
from viasd_tune.decoding.decoder import Decoder
from viasd_tune.decoding.tree import Tree

pytestmark = pytest.mark.usefixtures("one_thread")

SETTINGS = [Sampling(1.0, 1.0), Sampling(0.8, 0.9)]


def tables(seed: int):
    """Logits after the prefix (``root``), after a depth-1 token t (``one[t]``), after a depth-2 token (``two[t]``),
    and a draft distribution's logits (``q``) that differs from the root's clearly."""
    g = torch.Generator().manual_seed(seed)
    root = torch.randn(V, generator=g) * 1.5
    return (
        root,
        torch.randn(V, V, generator=g) * 1.5,
        torch.randn(V, V, generator=g) * 1.5,
        root + torch.randn(V, generator=g) * 1.5,
    )


def shape(
    kind: str, q_probs: torch.Tensor, gen: torch.Generator, drop_sampled: bool = False
) -> tuple[list, list, list]:
    """(tokens, parents, sampled) of one trial's tree; sampled nodes are fresh draws from q, placed first among
    their siblings; deterministic siblings equal to a draw are left out (allowed: they come after it).
    ``drop_sampled``: the forbidden variant, a draw of token 5 is left out."""
    if kind == "deterministic":  # root: 0, 1, 2; node 0: 3, 4; node 3: 5
        return [0, 1, 2, 3, 4, 5], [-1, -1, -1, 0, 0, 3], [False] * 6
    draws = torch.multinomial(q_probs, 2, replacement=True, generator=gen).tolist()
    drawn = [x for x in draws[: 1 if kind == "mixed" else 2] if not (drop_sampled and x == 5)]
    tokens = drawn + [t for t in (0, 1, 2) if t not in drawn]
    parents = [-1] * len(tokens)
    sampled = [True] * len(drawn) + [False] * (len(tokens) - len(drawn))
    return tokens + [3, 4], parents + [0, 0], sampled + [False, False]  # the first node has two children


def run_trials(kind: str, sampling: Sampling, n: int, seed: int, drop_sampled: bool = False):
    """Histograms of the first token, and of the second one given the first is ``first`` (the tree's first
    node, so the walk can continue there)."""
    root, one, two, q_logits = tables(seed)
    q_probs = probs_from_logits(q_logits[None], sampling)[0]
    gen = torch.Generator().manual_seed(seed)
    first_hist = torch.zeros(V, dtype=torch.long)
    second: dict[int, torch.Tensor] = {}
    for _ in range(n):
        tokens, parents, sampled = shape(kind, q_probs, gen, drop_sampled)
        tree = Tree(tokens, parents, q_logits.expand(len(tokens), V).clone(), sampled)
        rows = [root] + [(one if d == 1 else two)[t] for t, d in zip(tokens, tree.depth, strict=True)]
        path, last = tree_sd.verify_tree(torch.stack(rows), tree, sampling, gen)
        out = [tokens[i] for i in path] + [last]
        first_hist[out[0]] += 1
        if len(out) > 1:
            second.setdefault(out[0], torch.zeros(V, dtype=torch.long))[out[1]] += 1
    return first_hist, second, (root, one)


@pytest.mark.parametrize("kind", ["deterministic", "mixed", "two-draws"])
@pytest.mark.parametrize("sampling", SETTINGS, ids=str)
def test_tree_rule_emits_the_targets_distribution(kind, sampling):
    n = 6000
    first, second, (root, one) = run_trials(kind, sampling, n, seed=11)
    assert_fits(first, probs_from_logits(root[None], sampling)[0], f"{kind}: first token")
    checked = 0
    for x, hist in second.items():
        if hist.sum() >= 400:  # the walk descended into node x often enough to test its distribution
            assert_fits(hist, probs_from_logits(one[x][None], sampling)[0], f"{kind}: token after {x}")
            checked += 1
    assert checked >= 1


@pytest.mark.parametrize("kind", ["deterministic", "mixed"])
def test_wrong_tree_rules_are_caught(kind, monkeypatch):
    """Power: testing every sibling against p (no residual) over-emits rejected candidates; leaving out a draw
    because of its value (here: token 5) biases the first token."""
    sampling = Sampling(1.0, 1.0)
    root = tables(11)[0]
    p = probs_from_logits(root[None], sampling)[0]
    if kind == "mixed":
        first, _, _ = run_trials(kind, sampling, 6000, seed=11, drop_sampled=True)
        assert not fits(first, p)
    monkeypatch.setattr(tree_sd, "residual", lambda r, q: r)
    first, _, _ = run_trials(kind, sampling, 6000, seed=11)
    assert not fits(first, p)


# --------------------------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def small_vocab_pair():
    target = tiny_model("llama", seed=0, layers=2, vocab=V)
    draft = tiny_model("llama", seed=100, layers=1, vocab=V)
    return target, draft


def first_two_tokens(decoder: Decoder, target, prompt: list[int], sampling: Sampling):
    """The target's first-token distribution and second-token marginal (sum_x p(x) p(. | x)) after ``prompt``,
    the histograms of the first two tokens ``decoder`` samples over N_SEEDS seeds, and the tree nodes it
    accepted and verified in all."""
    first = probs_from_logits(next_token_logits(target, prompt=prompt)[None], sampling)[0]
    second = sum(
        first[x] * probs_from_logits(next_token_logits(target, prompt=prompt + [x])[None], sampling)[0]
        for x in range(V)
    )
    hists = torch.zeros(2, V, dtype=torch.long)
    accepted = verified = 0
    for seed in range(N_SEEDS):
        out = decoder.generate(prompt, 2, temperature=sampling.temperature, top_p=sampling.top_p, seed=seed)
        hists[0, out.token_ids[0]] += 1
        hists[1, out.token_ids[1]] += 1
        accepted += out.stats.tree_depth_accepted
        verified += out.stats.tree_nodes_verified
    return first, second, hists, accepted, verified


@pytest.mark.parametrize("sampling", [Sampling(1.0, 1.0), Sampling(0.8, 0.9)], ids=str)
def test_draft_model_tree_first_two_tokens_follow_the_target(small_vocab_pair, sampling):
    """A draft-model tree (each expanded node: one sampled child and its top-k others) far from the target:
    the first token, and the second one's marginal sum_x p(x) p(. | x), are the target's."""
    target, draft = small_vocab_pair
    cfg = DecodeConfig(
        mode="sd", gamma=3, drafter="model", tree_nodes=7, tree_model_width=3, tree_model_depth=3
    )
    decoder = Decoder(target, None, cfg, draft=draft, eos=set())
    first, second, hists, accepted, _ = first_two_tokens(decoder, target, PROMPT, sampling)
    q = probs_from_logits(next_token_logits(draft)[None], sampling)[0]
    assert N_SEEDS * ((q - first) ** 2 / first.clamp_min(1e-9)).sum() > 10 * CHI2_CRIT_P001[7]
    assert accepted > N_SEEDS // 10  # the tree's nodes were accepted, not only corrections drawn
    assert_fits(hists[0], first, "first token")
    assert_fits(hists[1], second, "second token")


def test_lookup_and_recycling_tree_first_two_tokens_follow_the_target(small_vocab_pair):
    """Deterministic candidates only (the lookup tree of a repetitive prompt, then recycled successors): sampling
    without replacement from the residual keeps the first token's and the second one's marginal the target's."""
    target, _ = small_vocab_pair
    prompt = [1, 4, 6, 3, 4, 6, 3, 4, 6, 3]
    sampling = Sampling(1.0, 1.0)
    cfg = DecodeConfig(mode="sd", gamma=3, drafter="lookup+recycle", tree_nodes=6, tree_lookup_width=3)
    decoder = Decoder(target, None, cfg, eos=set())
    first, second, hists, accepted, verified = first_two_tokens(decoder, target, prompt, sampling)
    assert verified > N_SEEDS and accepted > N_SEEDS // 10
    assert_fits(hists[0], first, "first token")
    assert_fits(hists[1], second, "second token")
