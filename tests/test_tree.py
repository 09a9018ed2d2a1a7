"""Token trees in the engine (issue 33), on tiny random models in fp32.

- masks: which keys a node sees; additive, in the model's dtype, never a fully masked row; bool vs additive;
- one tree forward gives every node the logits of a cache-free forward of prefix + its path, full and sliding
  layers, fed at once or level by level;
- after every round the cache equals a cache-free recompute, and Gemma-3's sliding layers stay bounded;
- decoding: greedy over any tree drafter and shape equals greedy AR; a width-1 tree is plain SD token for token
  (greedy and sampling, stats too);
- configuration: fields, refusals, profile round trip, flags.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from conftest import VOCAB, noisy_copy, tiny_model
from test_cache import WINDOW, check_cache_matches_fresh, gemma3_mixed, reference_logits

from viasd_tune.config import HYBRIDS, DecodeConfig
from viasd_tune.decoding import sd, tree_sd
from viasd_tune.decoding.common import CachedLM, Sampling, Sequence, Stats
from viasd_tune.decoding.decoder import Decoder
from viasd_tune.decoding.drafters import LookupDrafter, ModelDrafter
from viasd_tune.decoding.tree import Tree, additive, attention_mask, visible
from viasd_tune.decoding.tree_drafters import ChainTree
from viasd_tune.errors import UserError
from viasd_tune.routing import SkipSet

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: many tiny forwards, one thread

ATOL = 1e-4
ARCHS = ["llama", "qwen2", "gemma3"]
_MODELS: dict[str, torch.nn.Module] = {}


def model_of(arch: str):
    if arch not in _MODELS:
        _MODELS[arch] = gemma3_mixed() if arch == "gemma3-mixed" else tiny_model(arch, seed=5, layers=4)
    return _MODELS[arch]


def random_tree(rng: random.Random, n: int, vocab: int = VOCAB) -> Tree:
    """Random shape: each node's parent is the root or any earlier node (chains, bushes and everything between)."""
    style = rng.choice(["chain", "bush", "any"])
    parents = []
    for i in range(n):
        if style == "chain":
            parents.append(i - 1)
        elif style == "bush":
            parents.append(rng.choice([-1, max(-1, i - 1)]))
        else:
            parents.append(rng.randint(-1, i - 1))
    return Tree([rng.randrange(3, vocab) for _ in range(n)], parents)


# ------------------------------------------------------------------------------------------------ masks


def test_visibility_of_a_small_tree():
    """Prefix of 3 committed tokens, 1 pending, nodes 0 (root child), 1 (root child), 2 (child of 0)."""
    tree = Tree([10, 11, 12], [-1, -1, 0])
    seen, prefix = visible(pending=1, tree=tree, start=3, queries=4)
    assert prefix == 3
    expected = [
        # c0 c1 c2 | pending n0 n1 n2
        [1, 1, 1, 1, 0, 0, 0],  # the pending token: the prefix and itself
        [1, 1, 1, 1, 1, 0, 0],  # node 0: + the pending token, itself
        [1, 1, 1, 1, 0, 1, 0],  # node 1: not its sibling
        [1, 1, 1, 1, 1, 0, 1],  # node 2: its parent 0
    ]
    assert seen.astype(int).tolist() == expected
    # A sliding window of 3: position 4 (node 0) sees positions 2..4 only; node 2 at position 5 sees 3..5.
    seen, prefix = visible(pending=1, tree=tree, start=3, queries=4, window=3)
    assert prefix == 2  # the layer returns window - 1 committed keys
    assert seen.astype(int).tolist() == [
        [1, 1, 1, 0, 0, 0],  # pending at 3: keys at 1, 2, 3
        [0, 1, 1, 1, 0, 0],  # node 0 at 4: 2, 3, 4
        [0, 1, 1, 0, 1, 0],  # node 1 at 4: 2, 3 and itself
        [0, 0, 1, 1, 0, 1],  # node 2 at 5: 3, 4 (its parent), 5
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_masks_are_additive_in_the_models_dtype_and_never_fully_masked(dtype):
    rng = random.Random(0)
    for _ in range(30):
        tree = random_tree(rng, rng.randint(0, 20))
        pending, start = rng.randint(1, 3), rng.randint(0, 40)
        config = model_of("gemma3").config
        masks = attention_mask(config, pending, tree, start, pending + tree.n, dtype, "cpu")
        assert set(masks) == {"full_attention", "sliding_attention"}
        for m in masks.values():
            assert m.dtype == dtype and m.dim() == 4 and m.shape[2] == pending + tree.n
            assert torch.isfinite(m).all(), (
                "fp32's minimum would be -inf in bf16: the dtype's own minimum is used"
            )
            assert set(m.unique().tolist()) <= {0.0, torch.finfo(dtype).min}
            assert (m == 0).any(-1).all(), "a fully masked row gives NaN under SDPA"
    assert isinstance(
        attention_mask(model_of("llama").config, 1, Tree([], []), 5, 1, dtype, "cpu"), torch.Tensor
    )


@torch.inference_mode()
def test_bool_and_additive_masks_agree_under_sdpa_and_a_bool_mask_is_wrong_under_eager():
    """SDPA reads a bool mask as True = attend and a float mask as added to the scores: both give the same
    logits. Eager attention adds whatever it gets, so a bool mask there adds 0/1 and attends everywhere: the
    inversion the engine avoids by always passing additive masks."""
    model = tiny_model("llama", seed=7, layers=2)
    rng = random.Random(1)
    prefix = [rng.randrange(3, VOCAB) for _ in range(6)]
    tree = Tree([5, 6, 7, 8], [-1, -1, 0, 1])
    seen, _ = visible(0, tree, len(prefix), tree.n)
    ids = torch.tensor([prefix + tree.tokens])
    full = np.concatenate([np.tril(np.ones((len(prefix), len(prefix) + tree.n), bool)), seen])
    pos = torch.tensor([list(range(len(prefix))) + [len(prefix) - 1 + d for d in tree.depth]])
    as_bool = torch.from_numpy(full)[None, None]
    as_float = additive(full, torch.float32, "cpu")

    def logits(mask, impl):
        model.config._attn_implementation = impl
        try:
            return model(input_ids=ids, position_ids=pos, attention_mask=mask).logits[0]
        finally:
            model.config._attn_implementation = "sdpa"

    ref = [
        reference_logits(model, prefix + [tree.tokens[j] for j in tree.path(i)], SkipSet())[-1]
        for i in range(tree.n)
    ]
    for mask, impl in ((as_bool, "sdpa"), (as_float, "sdpa"), (as_float, "eager")):
        out = logits(mask, impl)
        assert torch.isfinite(out).all()
        for i in range(tree.n):
            torch.testing.assert_close(out[len(prefix) + i], ref[i], atol=ATOL, rtol=0)
    wrong = logits(as_bool, "eager")
    assert not torch.allclose(wrong[len(prefix) + 1], ref[1], atol=1e-2)


def test_flash_attention_is_refused_in_one_line():
    model = tiny_model("llama", seed=7, layers=2)
    model.config._attn_implementation = "flash_attention_2"
    try:
        with pytest.raises(UserError, match="4-D mask") as err:
            Decoder(model, None, DecodeConfig(mode="sd", drafter="lookup", tree_nodes=8), eos=set())
        assert "\n" not in str(err.value)
    finally:
        model.config._attn_implementation = "sdpa"


# ------------------------------------------------------------------------------------------------ forwards


@pytest.mark.parametrize("arch", ARCHS + ["gemma3-mixed"])
@torch.inference_mode()
def test_tree_forward_gives_every_node_its_paths_logits(arch):
    """Prefixes up to three sliding windows long, 1-3 pending tokens, random shapes up to 24 nodes."""
    model = model_of(arch)
    rng = random.Random(arch)
    for _ in range(6):
        lm = CachedLM(model)
        seq = [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 3 * WINDOW))]
        pending = rng.randint(1, min(3, len(seq)))
        if len(seq) > pending:
            lm.forward(torch.tensor(seq[:-pending]))
        tree = random_tree(rng, rng.randint(0, 24))
        out = lm.forward_tree(torch.tensor(seq), tree)
        assert out.shape == (1 + tree.n, VOCAB) and lm.committed == len(seq)
        torch.testing.assert_close(out[0], reference_logits(model, seq, SkipSet())[-1], atol=ATOL, rtol=0)
        for i in range(tree.n):
            path = seq + [tree.tokens[j] for j in tree.path(i)]
            torch.testing.assert_close(
                out[1 + i], reference_logits(model, path, SkipSet())[-1], atol=ATOL, rtol=0
            )


@pytest.mark.parametrize("arch", ["llama", "gemma3", "gemma3-mixed"])
@torch.inference_mode()
def test_a_tree_fed_level_by_level_matches_one_forward(arch):
    """A drafter feeds its tree one level per forward behind the committed sequence; levels of more nodes than
    the sliding window still see the window's committed keys."""
    model = model_of(arch)
    rng = random.Random(f"levels-{arch}")
    for _ in range(4):
        seq = [rng.randrange(3, VOCAB) for _ in range(rng.randint(WINDOW, 3 * WINDOW))]
        tree = random_tree(rng, rng.randint(WINDOW, 2 * WINDOW))
        one = CachedLM(model).forward_tree(torch.tensor(seq), tree)
        lm = CachedLM(model)
        rows = [lm.forward_tree(torch.tensor(seq), Tree([], []))]
        fed = 0
        while fed < tree.n:
            upto = min(tree.n, fed + rng.randint(1, WINDOW + 4))
            part = Tree(tree.tokens[:upto], tree.parents[:upto])
            rows.append(lm.forward_tree(torch.tensor(seq), part, fed=fed))
            fed = upto
        torch.testing.assert_close(torch.cat(rows), one, atol=ATOL, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3", "gemma3-mixed"])
@torch.inference_mode()
def test_cache_after_every_tree_round_equals_a_cache_free_recompute(arch):
    """Rounds as the decoder runs them: a tree below the sequence, a root-to-node path kept, the target's token
    appended (pending), sometimes a rollback; the cache always equals a fresh one over the same prefix, and
    the sliding layers never keep more than the window after the round's rollback."""
    model = model_of(arch)
    rng = random.Random(f"rounds-{arch}")
    lm = CachedLM(model)
    seq = [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 5))]
    longest = 0
    for _ in range(25):
        tree = random_tree(rng, rng.randint(0, 12))
        lm.forward_tree(torch.tensor(seq), tree)
        leaf = rng.randint(-1, tree.n - 1)
        path = tree.path(leaf) if leaf >= 0 else []
        lm.keep_path(tree.n, path)
        seq += [tree.tokens[i] for i in path]
        assert lm.committed == len(seq)
        check_cache_matches_fresh(model, SkipSet(), lm, seq)
        seq.append(rng.randrange(3, VOCAB))  # the target's own token: pending
        back = rng.choice([0, 0, rng.randint(0, len(path))])  # EOS / max_new_tokens cut the round
        seq = seq[: len(seq) - back]
        lm.rollback(len(seq) - 1)
        check_cache_matches_fresh(model, SkipSet(), lm, seq[:-1])
        for i, lay in enumerate(lm.cache.layers):
            if getattr(lay, "is_sliding", False) and lay.is_initialized:
                assert lay.keys.shape[-2] <= WINDOW - 1, f"layer {i} keeps {lay.keys.shape[-2]} entries"
        longest = max(longest, len(seq))
    assert longest > 3 * WINDOW


# ------------------------------------------------------------------------------------------------ decoding


@pytest.fixture(scope="module", params=ARCHS)
def pair(request):
    target = tiny_model(request.param, seed=0, layers=4)
    return target, noisy_copy(target, 0.1, seed=1)


def prompts(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(2, 24, (1,), generator=g))
        base = torch.randint(3, VOCAB, (length,), generator=g)
        out.append(torch.cat([base, base[: length // 2], base]) if length % 2 else base)
    return out


def decode(target, config: DecodeConfig, ids, draft=None, n=32, eos=frozenset(), **kw):
    return Decoder(target, None, config, draft=draft, eos=set(eos)).generate(ids, n, **kw)


TREE_DRAFTERS = ["lookup", "recycle", "lookup+recycle", "model", "lookup+model", "lookup+recycle+model"]


def random_tree_config(rng: random.Random, drafter: str) -> DecodeConfig:
    """A random budget (chains included), γ, and each of the drafter's sources' depth and width, every field set
    only where it acts (one that does nothing is refused)."""
    parts = drafter.split("+")
    fields: dict = {"mode": "sd", "gamma": rng.choice([1, 2, 4, 7]), "drafter": drafter}
    fields["tree_nodes"] = rng.choice([0, 1, 2, 5, 16, 40])
    if fields["tree_nodes"] > 1 or "recycle" in parts:
        for source, depth in (("lookup", 8), ("recycle", 6), ("model", 5)):
            if source in parts:
                fields[f"tree_{source}_depth"] = rng.randint(1, depth)
                fields[f"tree_{source}_width"] = rng.randint(1, 4)
    if drafter in HYBRIDS or "recycle" in parts:
        fields["lookup_min"] = rng.randint(1, 3)
    return DecodeConfig(**fields)


@pytest.mark.parametrize("drafter", TREE_DRAFTERS)
def test_greedy_tree_decoding_equals_greedy_ar(pair, drafter):
    """Every tree drafter, random budgets (chains included), depths, widths and γ; 40 new tokens go past the
    tiny Gemma-3's sliding window."""
    target, draft = pair
    rng = random.Random(drafter)
    verified = 0
    for i, ids in enumerate(prompts(6, seed=hash(drafter) % 1000)):
        cfg = random_tree_config(rng, drafter)
        ref = decode(target, DecodeConfig(mode="ar"), ids, n=40).token_ids
        result = decode(target, cfg, ids, draft=draft, n=40)
        assert result.token_ids == ref, f"prompt {i}: {cfg}"
        s = result.stats
        assert s.new_tokens == 40 and s.tokens_full == 40
        if cfg.is_tree:
            assert s.tree_depth_accepted + s.rounds >= s.new_tokens  # each round: its path + one target token
            assert s.full_calls == s.rounds
            verified += s.tree_nodes_verified
    assert verified > 0


def test_token_recycling_keeps_its_table_across_requests_until_forget(pair):
    """A decoder keeps what token recycling learnt (Token Recycling's hot start): every request stays equal to
    greedy AR, a prompt decoded again drafts from the first run's predictions and needs fewer target calls, and
    after ``forget()`` a request runs exactly as on a fresh decoder."""
    target, _ = pair
    cfg = DecodeConfig(mode="sd", drafter="recycle", gamma=4, tree_nodes=8, tree_recycle_depth=4)
    dec = Decoder(target, None, cfg, eos=set())
    many = prompts(6, seed=7)
    for ids in many:  # one decoder, the table warm after the first
        ref = decode(target, DecodeConfig(mode="ar"), ids, n=40).token_ids
        assert dec.generate(ids, 40).token_ids == ref
    ids = many[0]
    dec.forget()
    cold = dec.generate(ids, 40).stats
    again = dec.generate(ids, 40).stats
    assert again.full_calls < cold.full_calls
    dec.forget()
    assert dec.generate(ids, 40).stats.full_calls == cold.full_calls
    assert decode(target, cfg, ids, n=40).stats.full_calls == cold.full_calls  # a fresh decoder
    # A seeded sample repeats whatever the decoder learnt before it: it drafts from a cold table.
    sampled = dec.generate(ids, 40, temperature=0.9, seed=3)
    dec.generate(many[1], 40)
    assert dec.generate(ids, 40, temperature=0.9, seed=3).token_ids == sampled.token_ids
    assert dec.generate(ids, 40).stats.full_calls < cold.full_calls  # and leaves the warm table as it was


@pytest.mark.parametrize("drafter", ["lookup+recycle", "lookup+recycle+model"])
def test_eos_and_max_new_tokens_stop_a_tree_round(pair, drafter):
    target, draft = pair
    cfg = DecodeConfig(mode="sd", gamma=6, drafter=drafter, tree_nodes=12)
    for ids in prompts(3, seed=9):
        ref = decode(target, DecodeConfig(mode="ar"), ids, n=30).token_ids
        eos = ref[13]
        assert decode(target, cfg, ids, draft=draft, n=30, eos={eos}).token_ids == ref[: ref.index(eos) + 1]
        for n in (1, 5, 11):
            assert decode(target, cfg, ids, draft=draft, n=n).token_ids == ref[:n]


def _chain_run(target, draft, kind: str, as_tree: bool, ids, gamma: int, sampling: Sampling, seed: int):
    stats = Stats()
    full = CachedLM(target, stats=stats)
    gen = None if sampling.greedy else torch.Generator().manual_seed(seed)
    if kind == "lookup":
        drafter = LookupDrafter(stats)
    else:
        drafter = ModelDrafter(CachedLM(draft, tier="draft", stats=stats), sampling, gen, stats)
    seq = Sequence(ids, len(ids) + 30 + gamma + 1)
    with torch.inference_mode():
        if as_tree:
            result = tree_sd.generate(full, ChainTree(drafter), seq, 30, set(), gamma, sampling, gen)
        else:
            result = sd.generate(full, drafter, seq, 30, set(), gamma, sampling, gen)
    s = stats
    return result.token_ids, (s.full_calls, s.full_tokens_processed, s.drafted, s.rounds, s.draft_calls)


@pytest.mark.parametrize("kind", ["lookup", "model"])
@pytest.mark.parametrize("sampling", [Sampling(), Sampling(1.0), Sampling(0.7, 0.9)], ids=str)
def test_a_width_one_tree_is_todays_chain_token_for_token(kind, sampling):
    """The chain drafters' drafts verified as a width-1 tree give plain SD's tokens and counts, greedy and
    sampled with the same seed (the tree rule draws its uniforms and corrections as the chain rule does)."""
    target = tiny_model("llama", seed=0, layers=4)
    draft = noisy_copy(target, 0.3, seed=1)
    for i, ids in enumerate(prompts(5, seed=3)):
        gamma = 1 + i % 5
        chain = _chain_run(target, draft, kind, False, ids, gamma, sampling, seed=i)
        tree = _chain_run(target, draft, kind, True, ids, gamma, sampling, seed=i)
        assert tree == chain, f"prompt {i}"


# ------------------------------------------------------------------------------------------------ configuration


def test_tree_fields_are_checked_and_unsupported_combinations_refused_in_one_line():
    bad = {
        "tree_nodes (--tree-nodes) must be a whole number from 0 to 64": dict(tree_nodes=65),
        "tree_nodes": dict(tree_nodes=2.5),
        "tree_lookup_width (--tree-lookup-width)": dict(tree_lookup_width=0),
        "tree_model_depth (--tree-model-depth)": dict(tree_model_depth=True),
        "mode viasd verifies chains only": dict(mode="viasd", tree_nodes=8),
        "mode viasd verifies chains only ": dict(mode="viasd", drafter="recycle"),
        "does not build token trees": dict(
            mode="sd", drafter="self", draft_skip=SkipSet.of([1]), tree_nodes=4
        ),
    }
    for needle, kwargs in bad.items():
        with pytest.raises(UserError) as err:
            DecodeConfig(**{"drafter": "lookup", **kwargs})
        assert needle.strip() in str(err.value) and "\n" not in str(err.value)
    cfg = DecodeConfig(mode="sd", drafter="lookup", tree_nodes=1)
    assert not cfg.is_tree and DecodeConfig(mode="sd", drafter="recycle").is_tree
    assert (
        DecodeConfig(mode="viasd", drafter="lookup", tree_nodes=1).tree_nodes == 1
    )  # a chain: today's VIA-SD
    with pytest.raises(UserError, match="nothing in mode ar"):  # ar drafts nothing: a tree there is refused
        DecodeConfig(mode="ar", tree_nodes=16)


def _profile_of(cfg: DecodeConfig) -> dict:
    """test_profile's models and evidence (target 28 layers, draft 24) with ``cfg``'s decoding fields."""
    from test_profile import make_profile

    p = make_profile()
    fields = cfg.to_profile()
    p["draft"] = {**p["draft"], **fields.pop("draft")}
    return {**p, **fields}


def test_tree_profile_round_trip_and_defaults():
    from viasd_tune.profile import validate_profile

    cfg = DecodeConfig(
        mode="sd", gamma=6, drafter="lookup+recycle+model", tree_nodes=24, tree_lookup_width=3,
        tree_recycle_depth=5, tree_model_width=2,
    )  # fmt: skip
    p = _profile_of(cfg)
    validate_profile(p)
    assert p["tree"] == {
        "nodes": 24,
        "sizing": "fixed",
        "lookup": {"depth": 8, "width": 3},
        "recycle": {"depth": 5, "width": 4},
        "model": {"depth": 4, "width": 2},
    }
    assert DecodeConfig.from_profile(p) == cfg
    assert DecodeConfig.from_dict(cfg.to_dict()) == cfg
    del p["tree"]["model"], p["tree"]["nodes"]
    assert DecodeConfig.from_profile(p).tree_nodes == 1  # a profile without the budget: a chain
    del p["tree"]
    assert DecodeConfig.from_profile(p) == DecodeConfig(mode="sd", gamma=6, drafter="lookup+recycle+model")
    p = _profile_of(cfg)
    p["tree"]["recycle"]["width"] = 0
    with pytest.raises(UserError, match=r"\$\.tree\.recycle\.width"):
        validate_profile(p)


def test_generate_flags_build_a_tree_configuration():
    from viasd_tune.cli import _decode_config, build_parser

    args = build_parser().parse_args(
        ["generate", "--prompt", "x", "--mode", "sd", "--drafter", "lookup+recycle", "--tree-nodes", "16",
         "--tree-lookup-depth", "6", "--tree-recycle-width", "8"]
    )  # fmt: skip
    cfg = _decode_config(args)
    assert (cfg.tree_nodes, cfg.tree_lookup_depth, cfg.tree_recycle_width) == (16, 6, 8)
    assert cfg.tree_model_width == DecodeConfig().tree_model_width


def test_gemma3_sliding_layers_stay_bounded_over_a_long_tree_generation():
    """120 new tokens (7 windows) of tree rounds: after every round's rollback each sliding layer holds at most
    window - 1 entries, and the output is greedy AR's."""
    target = model_of("gemma3-mixed")
    cfg = DecodeConfig(mode="sd", gamma=6, drafter="lookup+recycle", tree_nodes=20)
    dec = Decoder(target, None, cfg, eos=set())
    ids = prompts(1, seed=12)[0]
    stats = Stats()
    full = CachedLM(target, stats=stats)
    sizes: list[int] = []
    rollback = full.rollback

    def checked_rollback(length, floor=None):
        rollback(length, floor)
        sizes.append(
            max(lay.keys.shape[-2] for lay in full.cache.layers if lay.is_sliding and lay.is_initialized)
        )

    full.rollback = checked_rollback
    seq = Sequence(ids, len(ids) + 120 + cfg.gamma + 1)
    with torch.inference_mode():
        drafter = dec._tree_drafter(Sampling(), None, stats, False)
        out = tree_sd.generate(full, drafter, seq, 120, set(), cfg.gamma, Sampling(), None)
    assert out.token_ids == decode(target, DecodeConfig(mode="ar"), ids, n=120).token_ids
    assert len(sizes) == stats.rounds and max(sizes) <= WINDOW - 1
    assert stats.tree_nodes_verified > stats.rounds  # real trees, not chains


@pytest.mark.parametrize("drafter", ["lookup+recycle", "lookup+recycle+model"])
def test_a_tree_profile_is_saved_loaded_and_served(tiny_dirs, tmp_path, capsys, drafter):
    """A tree configuration from flags, saved in a profile, loaded by runtime.load: AR's tokens, over a tree."""
    import json

    from test_profile import make_profile

    from viasd_tune import models, runtime
    from viasd_tune.cli import main
    from viasd_tune.profile import write_profile

    target, draft = (models.load(path, "float32") for path in tiny_dirs)
    prompt = "abcdabcdabcdab"
    flags = [
        "--mode",
        "sd",
        "--gamma",
        "5",
        "--drafter",
        drafter,
        "--tree-nodes",
        "12",
        "--tree-recycle-width",
        "3",
    ]
    models_flags = ["--model", tiny_dirs[0]] + (["--draft", tiny_dirs[1]] if "model" in drafter else [])
    assert main(["generate", *models_flags, "--dtype", "float32",
                 "--prompt", prompt, "--max-new-tokens", "16", "--json", *flags]) == 0  # fmt: skip
    printed = json.loads(capsys.readouterr().out)
    cfg = DecodeConfig.from_dict(printed["config"])
    assert (cfg.tree_nodes, cfg.tree_recycle_width, cfg.drafter) == (12, 3, drafter)
    assert printed["stats"]["tree_nodes_verified"] > 0
    p = make_profile()
    decoding = cfg.to_profile()
    p.update(decoding, dtype="float32", target={"name": tiny_dirs[0], "fingerprint": target.fingerprint})
    p["draft"] = {"name": None, "fingerprint": None, **decoding["draft"]}
    if cfg.model_drafter == "model":
        p["draft"].update(name=tiny_dirs[1], fingerprint=draft.fingerprint)
    path = tmp_path / "profile.json"
    write_profile(path, p)
    decoder = runtime.load(path)
    assert decoder.config == cfg
    out = decoder.generate(prompt, max_new_tokens=16)
    ar = Decoder(target.model, target.tokenizer, DecodeConfig(mode="ar")).generate(prompt, max_new_tokens=16)
    assert out.token_ids == ar.token_ids == printed["token_ids"]
    assert main(["generate", "--profile", str(path), "--prompt", "x", "--tree-nodes", "4"]) == 2
    assert "--tree-nodes cannot be combined with --profile" in capsys.readouterr().err
