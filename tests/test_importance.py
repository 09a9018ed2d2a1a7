"""Layer importance (one sub-layer skipped at a time, over the target's committed KV), the knapsack and ranking
that build seed skip sets from it, and the params that enqueue them."""

from __future__ import annotations

import itertools
import random

import optuna
import pytest
import torch
from conftest import logits_over_committed, tiny_model

from viasd_tune.config import DecodeConfig
from viasd_tune.decoding.decoder import Decoder
from viasd_tune.routing import SkipSet, install_skipping
from viasd_tune.search import importance, replay
from viasd_tune.search import params as search_params
from viasd_tune.search import space as spaces
from viasd_tune.search.importance import Importance

LAYERS = 6
HARMLESS = {(3, "attn"), (2, "mlp")}  # output projections zeroed: skipping them is exact


@pytest.fixture(scope="module")
def model():
    m = tiny_model("llama", seed=4, layers=LAYERS)
    with torch.no_grad():
        m.model.layers[3].self_attn.o_proj.weight.zero_()
        m.model.layers[2].mlp.down_proj.weight.zero_()
    install_skipping(m)
    return m


@pytest.fixture(scope="module")
def refs(model):
    dec = Decoder(model, None, DecodeConfig(mode="ar"))
    out = []
    for s in range(3):
        ids = torch.randint(4, 96, (7 + 3 * s,), generator=torch.Generator().manual_seed(s))
        r = dec.generate(ids, max_new_tokens=14)
        out.append(replay.Reference(str(s), ids, r.token_ids, 0.0))
    return out


def test_a_sublayer_whose_skip_changes_nothing_scores_zero_and_ranks_first(model, refs, one_thread):
    drop, kl, positions = importance.score_sublayers(model, refs, block=4)
    assert positions == sum(len(r.output) for r in refs)
    for i, k in HARMLESS:
        assert drop[k][i] == 0.0 and kl[k][i] == pytest.approx(0.0, abs=1e-9)
    others = [(i, k) for i in range(LAYERS) for k in ("attn", "mlp") if (i, k) not in HARMLESS]
    assert all(kl[k][i] > 1e-6 for i, k in others)  # every real sub-layer changes the distribution
    assert sum(drop[k][i] > 0 for i, k in others) >= len(others) // 2
    imp = Importance(drop, kl, {"attn": 1e-3, "mlp": 2e-3}, positions, 4)
    space = spaces.load_space("smoke")  # layers 0 and 5 protected
    assert set(importance.ranking(imp, space, LAYERS)[:2]) == HARMLESS


def test_scores_are_those_of_a_pass_over_the_committed_cache(model, refs, one_thread):
    """Block by block, a pass with one sub-layer skipped reading the full model's KV of everything before the
    block (built by hand in conftest) changes exactly as many top-1 picks as the scores say."""
    block = 4
    slots = [(1, "attn"), (4, "mlp"), (3, "attn")]
    drop, _, positions = importance.score_sublayers(model, refs, slots, block=block)
    for i, k in slots:
        skip = SkipSet.of([i]) if k == "attn" else SkipSet.of((), [i])
        changed = 0
        for ref in refs:
            seq = ref.full.tolist()
            for w in range(ref.prompt_ids.numel(), len(seq), block):
                end = min(w + block, len(seq))
                full = logits_over_committed(model, seq[:end], w)
                slim = logits_over_committed(model, seq[:end], w, skip)
                changed += int((full.argmax(-1) != slim.argmax(-1)).sum())
        assert drop[k][i] == changed / positions
    assert drop["mlp"][1] is None  # not asked for


def test_at_most_max_blocks_are_scored_round_robin(model, refs, one_thread):
    slots = [(2, "attn")]
    _, _, positions = importance.score_sublayers(model, refs, slots, block=4, max_blocks=4)
    # the first block of each of the 3 references, then the second block of the first
    assert positions == 4 * 4
    _, _, everything = importance.score_sublayers(model, refs, slots, block=4, max_blocks=None)
    assert everything == sum(len(r.output) for r in refs)


def _imp(seed: int, layers: int = 8, positions: int = 50) -> Importance:
    rng = random.Random(seed)
    drop = {k: [rng.randrange(0, 8) / positions for _ in range(layers)] for k in ("attn", "mlp")}
    kl = {k: [rng.random() for _ in range(layers)] for k in ("attn", "mlp")}
    return Importance(drop, kl, {"attn": 1.0e-3, "mlp": 2.0e-3}, positions, 4)


def _space(tmp_path, encoding="budget", sublayers="[attn, mlp]", first=1, last=1, budget=(0.0, 0.5)):
    text = (
        "version: 1\n"
        f"skip: {{encoding: {encoding}, sublayers: {sublayers}, protect_first: {first}, protect_last: {last},"
        f" budget: {{min: {budget[0]}, max: {budget[1]}}}}}\n"
        "tau_escalate: {low: 0.05, high: 20.0, log: true}\n"
        "tau_accept_ratio: {low: 0.001, high: 1.0, log: true}\n"
        "kl: [forward, js]\ngamma: [2, 3]\ndrafter: [model, lookup]\n"
    )
    path = tmp_path / f"space-{encoding}-{first}-{last}-{sublayers.strip('[]').replace(', ', '')}.yaml"
    path.write_text(text)
    return spaces.load_space(str(path))


@pytest.mark.parametrize("seed", range(6))
def test_knapsack_is_optimal_within_budget_count_and_protection(tmp_path, seed):
    imp = _imp(seed, layers=6)
    space = _space(tmp_path, first=1, last=2)
    eligible = [(i, k) for i in range(1, 4) for k in ("attn", "mlp")]
    for budget, count in [(0.0, 6), (0.06, 3), (0.1, 6), (0.3, 2), (1.0, 4)]:
        got = importance.knapsack(imp, space, 6, budget, count)
        assert set(got) <= set(eligible) and len(got) <= count
        assert sum(imp.drop[k][i] for i, k in got) <= budget + 1e-9
        # brute force over every subset of the 6 eligible sub-layers
        best = max(
            sum(importance._value(imp, s) for s in sub)
            for r in range(count + 1)
            for sub in itertools.combinations(eligible, r)
            if sum(imp.drop[k][i] for i, k in sub) <= budget + 1e-9
        )
        assert sum(importance._value(imp, s) for s in got) == pytest.approx(best)


def test_seed_sets_respect_the_space(tmp_path):
    imp = _imp(0, layers=8)
    only_attn = _space(tmp_path, sublayers="[attn]", first=2, last=1, budget=(0.2, 0.6))
    sets = importance.seed_skip_sets(imp, only_attn, 8)
    assert sets and len(set(sets)) == len(sets) <= importance.MAX_SEEDS
    for skip in sets:
        assert not skip.mlp and skip.attn <= set(range(2, 7))
        assert 0.2 <= len(skip.attn) / 5 <= 0.6
    # a harmless sub-layer the space protects is never picked
    imp.drop["attn"][0] = imp.drop["mlp"][7] = 0.0
    both = _space(tmp_path, first=1, last=1)
    assert all(0 not in s.attn and 7 not in s.mlp for s in importance.seed_skip_sets(imp, both, 8))


def _decode(space, params: dict, n_layers: int) -> SkipSet:
    other = {"drafter": "lookup", "gamma": 2, "kl": "js", "tau_escalate": 1.0, "tau_accept_ratio": 0.1}
    return search_params.suggest(
        optuna.trial.FixedTrial({**other, **params}), space, n_layers, ["lookup"]
    ).skip


@pytest.mark.parametrize("encoding", ["budget", "per_sublayer"])
def test_enqueued_params_decode_to_the_chosen_skip_sets(tmp_path, encoding):
    space = _space(tmp_path, encoding=encoding, budget=(0.0, 1.0))
    rng = random.Random(1)
    slots = [(i, k) for i in range(1, 9) for k in ("attn", "mlp")]
    for _ in range(30):
        chosen = rng.sample(slots, rng.randrange(0, len(slots) + 1))
        skip = SkipSet.of((i for i, k in chosen if k == "attn"), (i for i, k in chosen if k == "mlp"))
        assert _decode(space, search_params.skip_params(space, 10, skip), 10) == skip
    with pytest.raises(ValueError, match="may not skip"):
        search_params.skip_params(space, 10, SkipSet.of([0]))  # protected

    # through the study: enqueued seeds are the first trials and decode to the seed sets
    imp = _imp(2, layers=10)
    study = optuna.create_study(directions=["maximize", "maximize"])
    n = importance.enqueue_seeds(study, space, 10, imp)
    assert n == len(importance.seed_skip_sets(imp, space, 10)) > 0
    assert importance.enqueue_seeds(study, space, 10, imp) == 0  # not twice
    for want in importance.seed_skip_sets(imp, space, 10):
        trial = study.ask()
        assert search_params.suggest(trial, space, 10, ["lookup"]).skip == want
        study.tell(trial, [1.0, 1.0])


def test_importance_round_trips_through_json():
    imp = _imp(3)
    import json

    assert Importance.from_dict(json.loads(json.dumps(imp.to_dict()))) == imp


@pytest.mark.parametrize("budget", [(0.0, 0.05), (0.3, 0.3), (0.0, 1.0), (0.9, 1.0)])
def test_seed_sets_fit_any_budget_range(tmp_path, budget):
    """Every seed set is one the space's budget encoding can express, however narrow the range (none when it
    allows only the empty set)."""
    imp = _imp(5, layers=8)
    space = _space(tmp_path, budget=budget)
    for skip in importance.seed_skip_sets(imp, space, 8):
        assert _decode(space, search_params.skip_params(space, 8, skip), 8) == skip
