"""The hybrid drafters ``lookup+model`` / ``lookup+self``: prompt lookup first each round, the model drafter when
lookup finds fewer than ``lookup_min`` tokens. Lossless (fp32, token-identical to greedy AR), routed as the round
counters say, and configured, saved and refused like every other field."""

from __future__ import annotations

import json
import random
import sys

import pytest
import torch
from conftest import VOCAB, noisy_copy, tiny_model
from test_profile import make_profile

from viasd_tune.cli import main
from viasd_tune.config import DecodeConfig
from viasd_tune.decoding import drafters as drafters_mod
from viasd_tune.decoding.common import Sequence, Stats
from viasd_tune.decoding.decoder import Decoder
from viasd_tune.decoding.drafters import HybridDrafter, LookupDrafter, prompt_lookup
from viasd_tune.errors import UserError
from viasd_tune.profile import validate_profile
from viasd_tune.routing import SkipSet

HYBRIDS = ["lookup+model", "lookup+self"]
N_NEW = 24
NEVER = sys.float_info.max
DRAFT_SKIP = SkipSet.of([1, 2], [2])


@pytest.fixture(scope="module", params=["llama", "gemma3"])  # gemma3: sliding-window layers in every cache
def models(request, one_thread):
    target = tiny_model(request.param, seed=0, layers=4)
    return target, noisy_copy(target, 0.1, seed=1)


def prompts(n: int, seed: int) -> list[torch.Tensor]:
    """Half repeat a chunk of themselves (lookup finds continuations), half are distinct tokens (it finds none
    in the prompt; the tiny models' own output may still repeat)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        if i % 2:
            base = torch.randint(3, VOCAB, (int(torch.randint(3, 10, (1,), generator=g)),), generator=g)
            out.append(torch.cat([base, base, base[: len(base) // 2 + 1]]))
        else:
            out.append(
                torch.randperm(VOCAB - 3, generator=g)[: int(torch.randint(2, 20, (1,), generator=g))] + 3
            )
    return out


def run(target, config: DecodeConfig, ids, draft=None, n=N_NEW, eos=frozenset(), **kw):
    return Decoder(target, None, config, draft=draft, eos=set(eos)).generate(ids, n, **kw)


def greedy_ar(target, ids, n=N_NEW):
    return run(target, DecodeConfig(mode="ar"), ids, n=n).token_ids


def random_skip(rng: random.Random) -> SkipSet:
    return SkipSet.of(
        [i for i in range(4) if rng.random() < 0.4], [i for i in range(1, 4) if rng.random() < 0.4]
    )


def check_counters(stats, flush_rounds_possible: bool = False) -> None:
    drafted = stats.rounds_lookup + stats.rounds_model
    if flush_rounds_possible:  # a re-check's last pass is a round that drafts nothing
        assert drafted <= stats.rounds
    else:
        assert drafted == stats.rounds


# ------------------------------------------------------------------------------------------- lossless


@pytest.mark.parametrize("drafter", HYBRIDS)
def test_sd_greedy_equals_ar(models, drafter):
    target, draft = models
    rng = random.Random(0)
    lookup = model = 0
    for i, ids in enumerate(prompts(8, seed=1)):
        cfg = DecodeConfig(
            mode="sd", gamma=rng.choice([1, 2, 3, 5, 8]), drafter=drafter, draft_skip=DRAFT_SKIP,
            lookup_min=rng.choice([1, 2, 3]),
        )  # fmt: skip
        result = run(target, cfg, ids, draft=draft)
        assert result.token_ids == greedy_ar(target, ids), f"prompt {i}, {cfg}"
        check_counters(result.stats)
        lookup, model = lookup + result.stats.rounds_lookup, model + result.stats.rounds_model
    assert lookup > 0 and model > 0  # both sources drafted, and the output is the target's either way


@pytest.mark.parametrize("drafter", HYBRIDS)
def test_viasd_tau_escalate_zero_equals_ar(models, drafter):
    target, draft = models
    rng = random.Random(1)
    for ids in prompts(6, seed=2):
        cfg = DecodeConfig(
            mode="viasd", gamma=rng.choice([1, 3, 4, 6]), drafter=drafter, skip=random_skip(rng),
            draft_skip=DRAFT_SKIP, kl=rng.choice(["forward", "reverse", "js"]), lookup_min=rng.choice([1, 2]),
        )  # fmt: skip
        result = run(target, cfg, ids, draft=draft)
        assert result.token_ids == greedy_ar(target, ids)
        assert result.stats.tokens_full == N_NEW and result.stats.slim_calls == 0
        check_counters(result.stats)


@pytest.mark.parametrize("drafter", HYBRIDS)
def test_viasd_with_recheck_equals_ar(models, drafter):
    """Any skip set and thresholds (the slim tier settling one-hot lookup drafts and model drafts alike):
    with recheck the output is the target's."""
    target, draft = models
    rng = random.Random(2)
    slim = 0
    for ids in prompts(8, seed=3):
        tau_escalate = rng.choice([0.5, 3.0, NEVER])
        cfg = DecodeConfig(
            mode="viasd", gamma=rng.choice([2, 4, 5]), drafter=drafter, skip=random_skip(rng),
            draft_skip=DRAFT_SKIP, tau_accept=rng.choice([0.0, 0.1 * tau_escalate]), tau_escalate=tau_escalate,
            kl=rng.choice(["forward", "reverse", "js"]), recheck=True, lookup_min=rng.choice([1, 2, 4]),
        )  # fmt: skip
        result = run(target, cfg, ids, draft=draft)
        assert result.token_ids == greedy_ar(target, ids), cfg
        check_counters(result.stats, flush_rounds_possible=True)
        slim += result.stats.tokens_slim + result.stats.tokens_direct
    assert slim > 0  # the first two tiers settled tokens, so the re-check had something to check


@pytest.mark.parametrize("drafter", HYBRIDS)
def test_sampling_runs_and_counts(models, drafter):
    """Sampling mixes one-hot (lookup) and model proposals in the re-check's proposal rows; it must run."""
    target, draft = models
    for seed, ids in enumerate(prompts(4, seed=4)):
        cfg = DecodeConfig(
            mode="viasd", gamma=3, drafter=drafter, skip=SkipSet.of([1], [2]), draft_skip=DRAFT_SKIP,
            tau_escalate=1.0, recheck=True,
        )  # fmt: skip
        s = run(target, cfg, ids, draft=draft, temperature=0.8, seed=seed).stats
        assert s.new_tokens == N_NEW == s.tokens_direct + s.tokens_slim + s.tokens_full
        check_counters(s, flush_rounds_possible=True)


# ------------------------------------------------------------------------------------------- routing


def test_lookup_when_the_context_repeats_model_otherwise(models):
    target, draft = models
    cfg = DecodeConfig(mode="sd", gamma=4, drafter="lookup+model")
    repeating = torch.tensor([5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6])
    distinct = torch.tensor([5, 6, 7, 8, 9, 10, 11, 12])
    stop = set(range(VOCAB))  # every token ends the output: one round, of γ 4 (5 new tokens allowed)
    s = run(target, cfg, repeating, draft=draft, n=5, eos=stop).stats  # lookup proposes 7 8 9 10
    assert (s.rounds, s.rounds_lookup, s.rounds_model, s.drafted, s.draft_calls) == (1, 1, 0, 4, 0)
    s = run(target, cfg, distinct, draft=draft, n=5, eos=stop).stats  # nothing recurs: the draft model drafts
    assert (s.rounds, s.rounds_lookup, s.rounds_model, s.drafted, s.draft_calls) == (1, 0, 1, 4, 4)
    # Pure drafters count their own source too.
    assert (
        run(target, DecodeConfig(mode="sd", gamma=4, drafter="lookup"), repeating, n=1).stats.rounds_lookup
        == 1
    )
    assert run(target, DecodeConfig(mode="sd", gamma=4), distinct, draft=draft, n=1).stats.rounds_model == 1


def test_lookup_takes_the_latest_emitted_occurrence_else_the_earliest_in_the_prompt():
    """Which earlier occurrence of the suffix n-gram lookup continues from: the latest in the emitted text (the
    model repeating itself), else the earliest in the prompt (the source rather than a later quote of it)."""
    prompt = [5, 6, 1, 5, 6, 2, 7]
    assert prompt_lookup(torch.tensor(prompt + [5, 6]), 3, prompt_len=7).tolist() == [1, 5, 6]
    emitted = [5, 6, 3, 9, 5, 6]  # "5 6" recurs in the emitted text: that occurrence wins
    assert prompt_lookup(torch.tensor(prompt + emitted), 3, prompt_len=7).tolist() == [3, 9, 5]
    assert prompt_lookup(torch.tensor(prompt + [5, 6]), 3).tolist() == [2, 7, 5]  # no prompt: the latest
    assert prompt_lookup(torch.tensor([5, 6, 8]), 3, prompt_len=3).numel() == 0  # nothing recurs
    # The drafter passes the sequence's prompt length.
    seq = Sequence(torch.tensor(prompt), capacity=16)
    seq.tokens += [5, 6]
    assert LookupDrafter(Stats()).propose(seq, 3).tolist() == [1, 5, 6]


class _Recorder:
    """A model drafter stand-in that says whether it was asked."""

    kind = "model"

    def __init__(self):
        self.calls, self.rollbacks = 0, []

    def draft(self, seq, gamma):
        self.calls += 1
        return torch.full((gamma,), 3), torch.zeros(gamma, VOCAB)

    def rollback(self, length, floor):
        self.rollbacks.append((length, floor))


@pytest.mark.parametrize("gamma", [1, 2, 3, 5])
@pytest.mark.parametrize("lookup_min", [1, 2, 3, 4, 64])
def test_lookup_min_threshold(gamma, lookup_min):
    """A lookup proposal is used iff it has at least min(lookup_min, γ) tokens; else the model drafts."""
    rng = random.Random(gamma * 100 + lookup_min)
    for _ in range(30):
        tokens = [rng.randrange(3, 9) for _ in range(rng.randrange(1, 14))]  # small alphabet: partial matches
        seq = Sequence(torch.tensor(tokens), capacity=len(tokens) + gamma + 1)
        stats, model = Stats(), _Recorder()
        hybrid = HybridDrafter(LookupDrafter(stats), model, lookup_min)
        drafts, q = hybrid.draft(seq, gamma)
        found = prompt_lookup(torch.tensor(tokens), gamma, prompt_len=len(tokens))
        if found.numel() >= min(lookup_min, gamma):
            assert q is None and drafts.tolist() == found.tolist() and model.calls == 0
            assert (stats.rounds_lookup, stats.drafted) == (1, found.numel())
        else:
            assert q is not None and model.calls == 1 and stats.rounds_lookup == 0
        hybrid.rollback(len(tokens), 0)
        assert model.rollbacks == [(len(tokens), 0)]  # lookup keeps no state: the model drafter rolls back
    assert hybrid.kind == "lookup+model"


@pytest.mark.parametrize("drafter", HYBRIDS)
def test_lookup_min_end_to_end(models, drafter):
    """The prompt's lookup finds two tokens (40 9 after the earlier 9): drafted by lookup up to lookup_min 2, by the
    model above it."""
    target, draft = models
    ids = torch.tensor([20, 9, 40, 9])
    stop = set(range(VOCAB))  # every token ends the output: one round, of γ 4 (5 new tokens allowed)
    for lookup_min, (by_lookup, by_model) in ((1, (1, 0)), (2, (1, 0)), (3, (0, 1)), (64, (0, 1))):
        cfg = DecodeConfig(mode="sd", gamma=4, drafter=drafter, draft_skip=DRAFT_SKIP, lookup_min=lookup_min)
        s = run(target, cfg, ids, draft=draft, n=5, eos=stop).stats
        assert (s.rounds_lookup, s.rounds_model) == (by_lookup, by_model), lookup_min
        assert s.drafted == (2 if by_lookup else 4)
    # γ below lookup_min: a lookup of γ tokens is as long as a draft gets, so it is used.
    cfg = DecodeConfig(mode="sd", gamma=2, drafter=drafter, draft_skip=DRAFT_SKIP, lookup_min=3)
    assert run(target, cfg, ids, draft=draft, n=3, eos=stop).stats.rounds_lookup == 1


def test_draft_model_cache_catches_up_after_lookup_rounds(models, monkeypatch):
    """A separate draft model that sat out lookup rounds drafts exactly what it would over the whole sequence
    from scratch: its next forward feeds the tokens its cache has not seen."""
    target, draft = models
    original = drafters_mod.ModelDrafter.draft
    checked = []

    def draft_and_check(self, seq, gamma):
        before = list(seq.tokens)
        lag = len(before) - self.lm.committed  # tokens the draft model's cache has not seen
        drafts, logits = original(self, seq, gamma)
        if self.skip is None:  # the separate draft model
            ref = torch.tensor(before)
            for i, tok in enumerate(drafts.tolist()):
                with torch.inference_mode():
                    row = draft(input_ids=ref[None]).logits[0, -1].float()
                torch.testing.assert_close(logits[i], row, rtol=1e-4, atol=1e-4)
                assert tok == int(row.argmax())
                ref = torch.cat([ref, torch.tensor([tok])])
            checked.append(lag)
        return drafts, logits

    monkeypatch.setattr(drafters_mod.ModelDrafter, "draft", draft_and_check)
    rounds_lookup = 0
    for ids in prompts(6, seed=5):
        viasd = {"recheck": True, "tau_escalate": 3.0, "skip": SkipSet.of([1], [2])}
        for mode, extra in (("sd", {}), ("viasd", viasd)):
            cfg = DecodeConfig(mode=mode, gamma=3, drafter="lookup+model", **extra)
            result = run(target, cfg, ids, draft=draft)
            assert result.token_ids == greedy_ar(target, ids)
            rounds_lookup += result.stats.rounds_lookup
    assert rounds_lookup > 0 and max(checked) > 2  # some model rounds caught up on a lookup round's tokens


# ------------------------------------------------------------------------------------------- configuration


@pytest.mark.parametrize("drafter", HYBRIDS)
def test_profile_round_trip(drafter):
    cfg = DecodeConfig(
        mode="viasd", gamma=4, drafter=drafter, skip=SkipSet.of([3], [5]), draft_skip=SkipSet.of([1, 2], [4]),
        tau_accept=0.1, tau_escalate=0.6, recheck=True, lookup_min=3,
    )  # fmt: skip
    p = make_profile()
    decoding = cfg.to_profile()
    draft = {**p["draft"], **decoding.pop("draft")}
    if drafter == "lookup+self":
        draft.update(name=None, fingerprint=None)
    p.update(decoding, draft=draft)
    assert p["lookup_min"] == 3 and p["draft"]["kind"] == drafter
    validate_profile(json.loads(json.dumps(p)))
    assert DecodeConfig.from_profile(p) == cfg
    assert DecodeConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    del p["lookup_min"]  # a profile written before the field: 1
    assert DecodeConfig.from_profile(p).lookup_min == 1


def test_profile_schema_refuses_bad_lookup_min_and_a_model_hybrid_without_its_model():
    p = make_profile()
    p.update(drafter="lookup+model", lookup_min=0)
    p["draft"]["kind"] = "lookup+model"
    with pytest.raises(UserError, match=r"\$.lookup_min"):
        validate_profile(p)
    p["lookup_min"] = 2
    validate_profile(p)
    p["draft"].update(name=None, fingerprint=None)
    with pytest.raises(UserError, match=r"\$.draft"):
        validate_profile(p)


@pytest.mark.parametrize(
    "value, needle",
    [(0, "from 1 to 64"), (65, "from 1 to 64"), (-1, "from 1 to 64"), (1.5, "whole number"), (True, "whole number"),
     ("2", "whole number"), (None, "whole number")],
)  # fmt: skip
def test_bad_lookup_min_is_refused(value, needle):
    with pytest.raises(UserError, match=needle) as exc:
        DecodeConfig(drafter="lookup+model", lookup_min=value)
    assert "\n" not in str(exc.value) and "lookup-min" in str(exc.value)


def test_hybrids_need_their_model():
    with pytest.raises(UserError, match="drafter 'lookup\\+model' needs a draft model"):
        DecodeConfig(mode="sd", drafter="lookup+model").validate(4, None)
    with pytest.raises(UserError, match="self-draft needs a skip set"):
        DecodeConfig(mode="sd", drafter="lookup+self").validate(4, None)
    with pytest.raises(UserError, match="out of range"):
        DecodeConfig(mode="sd", drafter="lookup+self", draft_skip=SkipSet.of([7])).validate(4, None)
    DecodeConfig(mode="sd", drafter="lookup+model", draft_skip=SkipSet.of([1])).validate(4, 2)


def test_generate_cli(tiny_dirs, capsys):
    target, draft = tiny_dirs
    base = ["generate", "--model", target, "--dtype", "float32", "--device", "cpu", "--max-new-tokens", "12",
            "--prompt", "abcabcabcab", "--json"]  # fmt: skip
    outs = []
    for extra in (
        ["--mode", "ar"],
        ["--mode", "sd", "--draft", draft, "--drafter", "lookup+model", "--lookup-min", "2", "--gamma", "3"],
        ["--mode", "viasd", "--drafter", "lookup+self", "--draft-skip-attn", "1,2", "--skip-mlp", "2",
         "--tau-escalate", "2", "--recheck"],
    ):  # fmt: skip
        assert main(base + extra) == 0
        outs.append(json.loads(capsys.readouterr().out))
    assert outs[1]["token_ids"] == outs[2]["token_ids"] == outs[0]["token_ids"]
    assert outs[1]["config"]["lookup_min"] == 2 and outs[1]["config"]["drafter"] == "lookup+model"
    for out in outs[1:]:
        assert out["stats"]["rounds_lookup"] > 0
    assert main(base + ["--drafter", "lookup+model", "--lookup-min", "0", "--draft", draft]) == 2
    assert "--lookup-min" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------- search


def test_replay_prices_hybrid_rounds_as_decoding_runs_them(models):
    """The replay runs the decoder's own hybrid rounds: the same rounds, lookup rounds and forwards per tier as
    decoding, a draft forward only in model rounds, and each draft forward priced as its model part's (the draft
    model's, or the target's under the self-draft's skip set)."""
    from viasd_tune.search import costmodel, replay

    target, draft = models
    ids_all = prompts(6, seed=6)
    refs = [replay.Reference(str(i), ids, greedy_ar(target, ids), 1.0) for i, ids in enumerate(ids_all)]
    cost = costmodel.CostModel(target=None, n_layers=4, draft_coef=(1.0, 0.0), draft_layers=4)
    cost.target_time = lambda k, skip: 10.0  # type: ignore[method-assign]
    cache = replay.ReplayCache(target, refs, draft, cost=cost)
    for drafter in ["lookup", "model", "self", *HYBRIDS]:
        for lookup_min, tau_escalate in ((1, 0.0), (3, 0.0), (2, NEVER)):
            dskip = DRAFT_SKIP if drafter.endswith("self") else SkipSet()  # the search skips no draft-model layer
            cfg = DecodeConfig(
                mode="viasd", gamma=4, drafter=drafter, draft_skip=dskip,
                lookup_min=lookup_min if drafter in HYBRIDS else 1, tau_escalate=tau_escalate,
            )  # fmt: skip
            est = replay.simulate(cache, cfg)
            real = [run(target, cfg, ids, draft=draft).stats for ids in ids_all]
            what = (drafter, lookup_min, tau_escalate)
            assert est.tokens == sum(s.new_tokens for s in real) == len(refs) * N_NEW
            assert est.fidelity == 1.0, what  # empty skip set: the slim verifier is the target
            for name in ("rounds", "rounds_lookup", "full_calls", "slim_calls", "draft_calls"):
                assert est.total(name) == sum(getattr(s, name) for s in real), (what, name)
            model_rounds = est.total("rounds") - est.total("rounds_lookup")
            draft_calls = est.total("draft_calls")
            assert (draft_calls == 0) == (model_rounds == 0), what  # lookup rounds make no draft forward
            assert est.total("draft_time_s") == draft_calls * (10.0 if drafter.endswith("self") else 1.0), what
            if drafter == "lookup":
                assert est.total("rounds_lookup") == est.total("rounds") and draft_calls == 0
            if drafter in ("model", "self"):
                assert est.total("rounds_lookup") == 0
            if drafter in HYBRIDS and lookup_min == 1:
                assert 0 < est.total("rounds_lookup") < est.total("rounds"), what  # both sources drafted


def _space(tmp_path, **changes):
    import yaml

    from viasd_tune.search.space import shipped_space_file

    doc = yaml.safe_load(shipped_space_file("default").read_text())
    for key in ("recheck", "draft_confidence", "draft_model", "tree"):  # optional keys these tests fix no params for
        doc.pop(key, None)
    doc.update(changes)
    path = tmp_path / "space.yaml"
    path.write_text(yaml.safe_dump({k: v for k, v in doc.items() if v is not None}))
    return str(path)


def test_search_space_hybrids_and_lookup_min(tmp_path):
    import optuna

    from viasd_tune.search import params as search_params
    from viasd_tune.search import space as spaces

    all_drafters = ["model", "self", "lookup", *HYBRIDS]
    path = _space(tmp_path, drafter=HYBRIDS + ["lookup"], lookup_min={"low": 1, "high": 4})
    space = spaces.load_space(path)
    assert space.lookup_min == (1, 4)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    search_params.enqueue_known_points(study, space, 8, all_drafters)
    configs: list[DecodeConfig] = []
    study.optimize(
        lambda t: configs.append(search_params.suggest(t, space, 8, all_drafters)) or 0.0, n_trials=40
    )
    # The reference points: no skip with the first drafter, then plain SD per drafter, at the lowest lookup_min.
    assert [(c.drafter, c.lookup_min, c.tau_escalate == 0) for c in configs[:4]] == [
        ("lookup+model", 1, False), ("lookup+model", 1, True), ("lookup+self", 1, True), ("lookup", 1, True),
    ]  # fmt: skip
    for trial, cfg in zip(study.trials, configs, strict=True):
        assert DecodeConfig.from_dict(trial.user_attrs["config"]) == cfg
        assert ("lookup_min" in trial.params) == (cfg.drafter in HYBRIDS)
        assert ("self_skip_frac" in trial.params) == (cfg.drafter == "lookup+self")
        assert cfg.draft_skip.is_empty == (cfg.drafter != "lookup+self")
        assert 1 <= cfg.lookup_min <= 4
    assert {c.drafter for c in configs} == set(HYBRIDS + ["lookup"])
    assert len({c.lookup_min for c in configs if c.drafter in HYBRIDS}) > 1  # searched
    # Without a draft model, lookup+model is left out like model.
    params = {"drafter": "lookup+self", "gamma": 4, "lookup_min": 2, "self_skip_frac": 0.5, "kl": "js"}
    params |= {"tau_escalate": 1.0, "tau_accept_ratio": 0.5, "skip_frac": 0.0}
    params |= {f"score_{k}_{i}": 0.5 for i in range(1, 7) for k in ("attn", "mlp")}
    cfg = search_params.suggest(optuna.trial.FixedTrial(params), space, 8, ["self", "lookup", "lookup+self"])
    assert cfg.drafter == "lookup+self" and cfg.lookup_min == 2 and not cfg.draft_skip.is_empty
    with pytest.raises(UserError, match="none of .* is available"):
        model_only = _space(tmp_path, drafter=["lookup+model"], self_draft=None)  # self_draft: nothing runs it
        search_params.suggest(optuna.trial.FixedTrial(params), spaces.load_space(model_only),
                              8, ["self", "lookup", "lookup+self"])  # fmt: skip
    # Without the key lookup_min is 1 and not a parameter; the signature of such a space is what it was.
    plain = spaces.load_space(_space(tmp_path, drafter=HYBRIDS))
    assert plain.lookup_min is None
    cfg = search_params.suggest(
        optuna.trial.FixedTrial({**params, "drafter": "lookup+model"}), plain, 8, all_drafters
    )
    assert cfg.lookup_min == 1
    assert spaces.space_signature(plain, 8) != spaces.space_signature(space, 8)
    default = spaces.load_space("default")
    import dataclasses
    import hashlib

    content = dataclasses.asdict(default)
    del content["source"], content["lookup_min"]
    old = {"space": content, "num_layers": 8}
    assert spaces.space_signature(default, 8) == hashlib.sha256(json.dumps(old, sort_keys=True).encode()).hexdigest()


@pytest.mark.parametrize(
    "changes, needle",
    [
        ({"lookup_min": {"low": 0, "high": 2}}, "$.lookup_min.low"),
        ({"lookup_min": {"low": 3, "high": 2}}, "low 3 > high 2"),
        ({"lookup_min": {"low": 1, "high": 65}}, "$.lookup_min.high"),
        ({"lookup_min": {"low": 1.5, "high": 2}}, "$.lookup_min.low"),
        ({"lookup_min": {"low": 1}}, "missing key 'high'"),
        ({"drafter": ["lookup+self"], "self_draft": None}, "needed because drafter lists 'self' or 'lookup+self'"),
        ({"drafter": ["lookup+nothing"]}, "$.drafter[0]"),
    ],
)  # fmt: skip
def test_bad_search_spaces_are_refused(tmp_path, changes, needle):
    from viasd_tune.search import space as spaces

    with pytest.raises(UserError) as exc:
        spaces.load_space(_space(tmp_path, **changes))
    assert needle in str(exc.value) and "\n" not in str(exc.value)


@pytest.mark.parametrize("drafter", HYBRIDS)
def test_runtime_serves_a_hybrid_profile(tiny_dirs, tmp_path, capsys, drafter):
    from viasd_tune import models, runtime
    from viasd_tune.profile import write_profile

    target, draft = (models.load(path, "float32") for path in tiny_dirs)
    cfg = DecodeConfig(
        mode="viasd", gamma=3, drafter=drafter, skip=SkipSet.of([1], [2]), tau_accept=0.05, tau_escalate=2.0,
        recheck=True, lookup_min=2, draft_skip=DRAFT_SKIP if drafter == "lookup+self" else SkipSet(),
    )  # fmt: skip
    p = make_profile()
    decoding = cfg.to_profile()
    p.update(decoding, dtype="float32", target={"name": tiny_dirs[0], "fingerprint": target.fingerprint})
    p["draft"] = {"name": None, "fingerprint": None, **decoding["draft"]}
    if drafter == "lookup+model":
        p["draft"].update(name=tiny_dirs[1], fingerprint=draft.fingerprint)
    path = tmp_path / "profile.json"
    write_profile(path, p)
    decoder = runtime.load(path)
    assert decoder.config == cfg and (decoder.draft is not None) == (drafter == "lookup+model")
    prompt = "abcdabcdabcdab"
    out = decoder.generate(prompt, max_new_tokens=16)
    ar = Decoder(target.model, target.tokenizer, DecodeConfig(mode="ar")).generate(prompt, max_new_tokens=16)
    assert out.token_ids == ar.token_ids and out.stats.rounds_lookup > 0
    assert main(["generate", "--profile", str(path), "--prompt", prompt, "--max-new-tokens", "16", "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)["stats"]
    assert stats["rounds_lookup"] == out.stats.rounds_lookup and "rounds_model" in stats
    assert main(["generate", "--profile", str(path), "--prompt", "x", "--lookup-min", "2"]) == 2
    assert "--lookup-min cannot be combined with --profile" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------- sampling


@pytest.mark.parametrize("mode", ["sd", "viasd-recheck"])
def test_sampled_second_token_follows_the_target(mode):
    """Sampling stays exact when the source switches with the prefix: after the prompt (no token recurs) the
    draft model drafts, after a first token that occurs in the prompt lookup does (a one-hot proposal). The first
    token must follow p, the second the target's marginal, sum over x of p(x) p(· | x) (chi-square, p < 0.001)."""
    from test_sampling import INF, N_SEEDS, PROMPT, V, assert_fits, next_token_logits

    from viasd_tune.decoding.common import Sampling, probs_from_logits

    target, draft = tiny_model("llama", seed=0, layers=2, vocab=V), tiny_model("llama", seed=100, layers=1, vocab=V)
    sampling = Sampling(1.0, 1.0)
    if mode == "sd":
        config = DecodeConfig(mode="sd", gamma=2, drafter="lookup+model")
    else:
        config = DecodeConfig(
            mode="viasd", gamma=2, drafter="lookup+model", skip=SkipSet.of([0], [1]), tau_accept=0.0,
            tau_escalate=INF, recheck=True,
        )  # fmt: skip
    decoder = Decoder(target, None, config, draft=draft, eos=set())
    first = probs_from_logits(next_token_logits(target), sampling)
    second = sum(
        first[x] * probs_from_logits(next_token_logits(target, prompt=PROMPT + [x]), sampling) for x in range(V)
    )
    hist, hist_first = torch.zeros(V, dtype=torch.long), torch.zeros(V, dtype=torch.long)
    lookup = model = 0
    for seed in range(N_SEEDS):
        out = decoder.generate(PROMPT, 2, temperature=1.0, seed=seed)
        hist_first[out.token_ids[0]] += 1
        hist[out.token_ids[1]] += 1
        lookup, model = lookup + out.stats.rounds_lookup, model + out.stats.rounds_model
    assert lookup > N_SEEDS // 10 and model >= N_SEEDS  # both sources drafted, model in every first round
    assert_fits(hist_first, first, f"{mode} hybrid first token")
    assert_fits(hist, second, f"{mode} hybrid second token")


def test_search_over_a_hybrid_space_exports_and_serves(tiny_dirs, tmp_path):
    """End to end: a space of the hybrid only, lookup_min searched; every trial is a hybrid, a trial's profile keeps
    the draft model and lookup_min, and it serves. (The search's own export may be plain decoding, which is
    faster on tiny models; it must serve too.)"""
    import optuna
    import yaml

    from viasd_tune import runtime
    from viasd_tune.profile import load_profile, validate_profile
    from viasd_tune.search.export import build_profile
    from viasd_tune.search.run import SearchSettings, run_search
    from viasd_tune.search.space import shipped_space_file

    space = yaml.safe_load(shipped_space_file("smoke").read_text())
    space.update(drafter=["lookup+model"], lookup_min={"low": 1, "high": 3})
    (tmp_path / "hybrid.yaml").write_text(yaml.safe_dump(space))
    out = tmp_path / "hyb"
    settings = SearchSettings(
        model=tiny_dirs[0], draft=tiny_dirs[1], dtype="float32", device="cpu", data="builtin", prompts=4, trials=3,
        space=str(tmp_path / "hybrid.yaml"), max_new_tokens=8, out=str(out), min_fidelity=0.5, progress=False,
    )  # fmt: skip
    run_search(settings)
    study = optuna.load_study(study_name="hyb", storage=f"sqlite:///{out / 'study.db'}")
    configs = [DecodeConfig.from_dict(t.user_attrs["config"]) for t in study.trials]
    # --trials counts real decodes; the front screen may add trials that were only replayed
    assert sum(bool(t.user_attrs.get("measured")) for t in study.trials) == 3
    assert {c.drafter for c in configs} == {"lookup+model"}
    assert all(1 <= c.lookup_min <= 3 for c in configs)
    assert runtime.load(load_profile(out / "profile.json")).generate("abc", max_new_tokens=4).stats.new_tokens == 4
    done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    for trial in done:
        profile = validate_profile(build_profile(study, trial))
        cfg = DecodeConfig.from_dict(trial.user_attrs["config"])
        assert profile["drafter"] == profile["draft"]["kind"] == "lookup+model"
        assert profile["draft"]["name"] == tiny_dirs[1] and profile["lookup_min"] == cfg.lookup_min
        decoder = runtime.load(profile)
        assert decoder.config == cfg and decoder.draft is not None
        stats = decoder.generate("abcabcabcabc", max_new_tokens=6).stats
        assert stats.new_tokens == 6 and stats.rounds_lookup > 0
    assert done
