"""Each round's token tree cut to the size that pays (``decoding/tree_sizing.py``, ``tree_sizing="cost"``).

- the verify cost curve: relative to one step, never lower for a larger block, linear between points;
- calibration counts a node only where the target could accept it (its parent on the path);
- the cut keeps a valid subtree with every sampled node, and the best prefix of the best-first order (brute force);
- decoding stays exact: greedy equals greedy AR on every tree drafter, sampling fits the target's distribution;
- the decoder keeps what sizing learnt across requests until ``forget()``, and a seeded sample starts cold;
- configuration: the field, its refusal on a chain, the profile round trip and the ``generate`` flag.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from conftest import noisy_copy, tiny_model
from test_sampling import N_SEEDS, PROMPT, V, assert_fits
from test_tree import TREE_DRAFTERS, prompts, random_tree_config
from test_tree_sampling import first_two_tokens

from viasd_tune.config import DecodeConfig
from viasd_tune.decoding.common import Sampling
from viasd_tune.decoding.decoder import Decoder
from viasd_tune.decoding.tree import Tree
from viasd_tune.decoding.tree_sizing import EDGES, Calibration, VerifyCost, cut, measure_verify_cost, subtree
from viasd_tune.errors import UserError

pytestmark = pytest.mark.usefixtures("one_thread")

STEEP = VerifyCost((1, 2, 64), (1.0, 1.3, 20.0))  # every node costs: trees get cut
FLAT = VerifyCost((1, 64), (1.0, 1.0))  # nodes are free: nothing is cut


def test_verify_cost_is_relative_monotone_and_linear_between_points():
    cost = VerifyCost.from_times([(8, 0.30), (1, 0.20), (4, 0.18), (16, 0.40)])
    assert cost.blocks == (1, 4, 8, 16)
    assert cost.costs == pytest.approx((1.0, 1.0, 1.5, 2.0))  # the 4-token block's faster time is noise
    assert cost(6) == pytest.approx(1.25)
    assert cost(24) == pytest.approx(2.5)  # the last segment's slope beyond the last point
    with pytest.raises(ValueError):
        VerifyCost.from_times([])


def test_measured_cost_covers_the_largest_block():
    cost = measure_verify_cost(tiny_model("llama", seed=0, layers=2), max_block=17, context=8, reps=1)
    assert cost.blocks[0] == 1 and cost.blocks[-1] == 17 and cost.costs[0] == 1.0
    assert all(b >= a for a, b in zip(cost.costs, cost.costs[1:], strict=False))


def test_calibration_learns_only_where_the_parent_was_accepted():
    cal = Calibration()
    assert cal.prob("lookup", 0.4) == pytest.approx(0.4)  # nothing seen: the source's own score
    # nodes 0 and 1 hang from the root, 2 from 0 (accepted), 3 from 1 (rejected: says nothing)
    for _ in range(20):
        cal.learn(["lookup"] * 4, [0.4, 0.4, 1.0, 1.0], [-1, -1, 0, 1], path=[0])
    assert cal.prob("lookup", 0.4) == pytest.approx(
        (20 + 0.8) / (40 + 2)
    )  # half of 40 verified root children
    assert cal.prob("lookup", 1.0) == pytest.approx(2 / 22)  # node 2 every time, never node 3
    assert cal.prob("recycle", 0.4) == pytest.approx(0.4)  # another source's table is its own
    assert len(EDGES) + 1 == cal.counts["lookup"].shape[0]


def _random_case(rng: random.Random, n: int, sampled: bool):
    parents = [rng.randint(-1, i - 1) for i in range(n)]
    scores: list[float] = []
    for p in parents:
        scores.append((1.0 if p < 0 else scores[p]) * rng.choice([1.0, rng.random()]))
    flags = [rng.random() < 0.2 for _ in range(n)] if sampled else None
    tree = Tree([rng.randrange(3, 50) for _ in range(n)], parents, sampled=None)
    object.__setattr__(
        tree, "sampled", flags
    )  # cut reads the marks only; their sibling order is merge's business
    keys = [rng.choice(["lookup", "recycle", "lookup+recycle"]) for _ in range(n)]
    cal = Calibration()
    for _ in range(5):
        path, node = [], -1
        while (kids := [i for i, p in enumerate(parents) if p == node]) and rng.random() < 0.7:
            node = rng.choice(kids)
            path.append(node)
        cal.learn(keys, [rng.random() for _ in range(n)], parents, path)
    return tree, scores, keys, cal


@pytest.mark.parametrize("seed", range(12))
def test_cut_keeps_a_subtree_with_every_sampled_node_and_the_best_prefix(seed):
    rng = random.Random(seed)
    tree, scores, keys, cal = _random_case(rng, rng.randint(1, 20), sampled=seed % 2 == 1)
    cost = VerifyCost((1, 4, 8, 32), (1.0, 1.0 + rng.random() * 0.3, 1.2 + rng.random(), 3.0))
    keep, steps = cut(tree, scores, keys, cal, cost)
    kept = set(keep)
    assert keep == sorted(kept) and all(tree.parents[i] < 0 or tree.parents[i] in kept for i in keep)
    forced = set()
    for i in range(tree.n):
        j = i
        while tree.sampled and tree.sampled[i] and j >= 0:
            forced.add(j)
            j = tree.parents[j]
    assert forced <= kept
    # brute force: the best-first order from the forced nodes, every prefix valued as the rule says
    path_prob = []
    for i, p in enumerate(tree.parents):
        path_prob.append(min(1.0, cal.prob(keys[i], min(steps[i], 1.0))) * (path_prob[p] if p >= 0 else 1.0))
    order, frontier = (
        [],
        {i for i, p in enumerate(tree.parents) if (p < 0 or p in forced) and i not in forced},
    )
    while frontier:
        c = max(frontier, key=lambda i: (scores[i], -i))
        order.append(c)
        frontier = (frontier - {c}) | {i for i, p in enumerate(tree.parents) if p == c}
    values = [
        (1 + sum(path_prob[i] for i in forced | set(order[:k]))) / cost(1 + len(forced) + k)
        for k in range(len(order) + 1)
    ]
    assert len(kept) - len(forced) == int(np.argmax(values))


def test_cut_follows_the_cost_curve():
    rng = random.Random(3)
    tree, scores, keys, cal = _random_case(rng, 12, sampled=False)
    assert cut(tree, scores, keys, cal, FLAT)[0] == list(range(12))
    cheap = len(cut(tree, scores, keys, cal, VerifyCost((1, 13), (1.0, 1.5)))[0])
    assert len(cut(tree, scores, keys, cal, STEEP)[0]) <= cheap <= 12


def test_subtree_keeps_order_parents_and_sampling_rows():
    tree = Tree(
        [5, 6, 7, 8], [-1, -1, 0, 2], torch.arange(4.0)[:, None].repeat(1, 3), [True, False, False, False]
    )
    small = subtree(tree, [0, 2, 3])
    assert (small.tokens, small.parents, small.sampled) == ([5, 7, 8], [-1, 0, 1], [True, False, False])
    assert small.q_logits[:, 0].tolist() == [0.0, 2.0, 3.0]


# ------------------------------------------------------------------------------------------------ decoding


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def pair(request):
    target = tiny_model(request.param, seed=0, layers=4)
    return target, noisy_copy(target, 0.1, seed=1)


def sized(cfg: DecodeConfig) -> DecodeConfig:
    fields = {**cfg.to_dict(), "tree_nodes": max(cfg.tree_nodes, 2), "tree_sizing": "cost"}
    return DecodeConfig.from_dict(fields)


@pytest.mark.parametrize("drafter", TREE_DRAFTERS)
def test_greedy_sized_trees_equal_greedy_ar(pair, drafter):
    """One decoder per cost curve serves every prompt (what it learnt carries over), each output the target's."""
    target, draft = pair
    rng = random.Random(drafter)
    total = 0
    for cost in (STEEP, VerifyCost((1, 8, 16, 64), (1.0, 1.1, 1.6, 4.0))):
        ar = Decoder(target, None, DecodeConfig(mode="ar"), eos=set())
        cfg = sized(random_tree_config(rng, drafter))
        dec = Decoder(target, None, cfg, draft=draft, eos=set(), verify_cost=cost)
        verified = 0
        for i, ids in enumerate(prompts(5, seed=hash(drafter) % 1000)):
            result = dec.generate(ids, 40)
            assert result.token_ids == ar.generate(ids, 40).token_ids, f"prompt {i}: {cfg}"
            assert result.stats.full_calls == result.stats.rounds
            verified += result.stats.tree_nodes_verified
        assert bool(dec.calibration.counts) == (verified > 0)  # it learns from every node it verifies
        total += verified
    assert total > 0


def test_sizing_cuts_trees_and_forget_starts_cold(pair):
    """With a steep curve fewer nodes are verified than with the fixed budget, outputs equal; the decoder keeps its
    calibration across requests and ``forget()`` drops it."""
    target, _ = pair
    base = dict(mode="sd", gamma=6, drafter="lookup+recycle", tree_nodes=16)
    fixed = Decoder(target, None, DecodeConfig(**base), eos=set())
    cost = Decoder(target, None, DecodeConfig(**base, tree_sizing="cost"), eos=set(), verify_cost=STEEP)
    ids = prompts(1, seed=7)[0]
    a, b = fixed.generate(ids, 40), cost.generate(ids, 40)
    assert a.token_ids == b.token_ids
    assert b.stats.tree_nodes_verified < a.stats.tree_nodes_verified
    learnt = {k: v.copy() for k, v in cost.calibration.counts.items()}
    assert learnt
    cost.generate(ids, 8)
    assert sum(v.sum() for v in cost.calibration.counts.values()) > sum(v.sum() for v in learnt.values())
    cost.forget()
    assert not cost.calibration.counts


def test_decoder_measures_the_curve_when_none_is_given():
    target = tiny_model("llama", seed=0, layers=2)
    dec = Decoder(
        target, None, DecodeConfig(mode="sd", drafter="lookup+recycle", tree_nodes=9, tree_sizing="cost")
    )
    assert dec.verify_cost is not None and dec.verify_cost.blocks[-1] == 10
    assert (
        Decoder(target, None, DecodeConfig(mode="sd", drafter="lookup+recycle", tree_nodes=9)).verify_cost
        is None
    )


@pytest.fixture(scope="module")
def small_vocab_pair():
    return tiny_model("llama", seed=0, layers=2, vocab=V), tiny_model("llama", seed=100, layers=1, vocab=V)


@pytest.mark.parametrize("drafter", ["model", "lookup+recycle"])
def test_sampling_over_sized_trees_follows_the_target(small_vocab_pair, drafter):
    """The first token, and the second one's marginal, are the target's when each round's tree is cut (sampled
    nodes kept, deterministic ones dropped by their calibrated score)."""
    target, draft = small_vocab_pair
    prompt = PROMPT if drafter == "model" else [1, 4, 6, 3, 4, 6, 3, 4, 6, 3]
    shape = {"tree_model_width": 3, "tree_model_depth": 3} if drafter == "model" else {"tree_lookup_width": 3}
    cfg = DecodeConfig(mode="sd", gamma=3, drafter=drafter, tree_nodes=7, tree_sizing="cost", **shape)
    decoder = Decoder(target, None, cfg, draft=draft, eos=set(), verify_cost=VerifyCost((1, 8), (1.0, 2.0)))
    first, second, hists, accepted, verified = first_two_tokens(decoder, target, prompt, Sampling(1.0, 1.0))
    assert accepted > N_SEEDS // 10 and verified < 7 * 2 * N_SEEDS  # nodes accepted, and trees were cut
    assert_fits(hists[0], first, "first token")
    assert_fits(hists[1], second, "second token")


def test_a_seeded_sample_repeats_whatever_the_decoder_served_before(small_vocab_pair):
    target, _ = small_vocab_pair
    cfg = DecodeConfig(mode="sd", gamma=4, drafter="lookup+recycle", tree_nodes=8, tree_sizing="cost")
    dec = Decoder(target, None, cfg, eos=set(), verify_cost=STEEP)
    first = dec.generate(PROMPT, 12, temperature=0.9, seed=3).token_ids
    for ids in prompts(3, seed=2):
        dec.generate([t % V for t in ids.tolist()], 12)  # greedy requests teach the kept calibration
    assert dec.calibration.counts
    assert dec.generate(PROMPT, 12, temperature=0.9, seed=3).token_ids == first


# ------------------------------------------------------------------------------------------------ configuration


def test_tree_sizing_is_checked_refused_on_a_chain_and_round_trips():
    with pytest.raises(UserError, match="unknown tree_sizing 'auto'"):
        DecodeConfig(mode="sd", drafter="lookup", tree_nodes=8, tree_sizing="auto")
    with pytest.raises(
        UserError, match=r"tree_sizing \(--tree-sizing\) cost cuts a token tree.*--tree-nodes above 1"
    ):
        DecodeConfig(mode="sd", drafter="lookup+recycle", tree_sizing="cost")
    with pytest.raises(UserError, match="does nothing in mode ar"):
        DecodeConfig(mode="ar", tree_sizing="cost")
    from test_tree import _profile_of

    from viasd_tune.profile import validate_profile

    cfg = DecodeConfig(mode="sd", drafter="lookup+recycle", tree_nodes=12, tree_sizing="cost")
    prof = _profile_of(cfg)
    validate_profile(prof)
    assert prof["tree"]["sizing"] == "cost"
    with pytest.raises(UserError, match=r"\$\.tree\.sizing"):
        validate_profile({**prof, "tree": {**prof["tree"], "sizing": "auto"}})
    assert DecodeConfig.from_profile(prof) == cfg
    del prof["tree"]["sizing"]
    assert DecodeConfig.from_profile(prof).tree_sizing == "fixed"  # a profile written before sizing existed
    assert DecodeConfig.from_dict(cfg.to_dict()) == cfg


def test_generate_flag_sets_tree_sizing():
    from viasd_tune.cli import _decode_config, build_parser

    argv = ["generate", "--prompt", "x", "--mode", "sd", "--drafter", "lookup+recycle", "--tree-nodes", "16"]
    assert _decode_config(build_parser().parse_args([*argv, "--tree-sizing", "cost"])).tree_sizing == "cost"
    assert _decode_config(build_parser().parse_args(argv)).tree_sizing == "fixed"
