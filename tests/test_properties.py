"""Property tests (hypothesis) over random prompts, γ, skip sets, thresholds, divergences and drafters.

(i) the lossless configurations equal greedy ``ar``; (ii) statistics add up for any configuration, greedy or
sampled; (iii) with τ_accept = τ_escalate = ∞ every round is the drafter's proposal, all accepted, plus the slim
verifier's one token. Every drafter is covered, the hybrids included. The oracles are independent of the engine's
code: cache-free forwards for the models, and for prompt lookup what any lookup must satisfy (a copy of what
followed an earlier occurrence of the context's longest recurring suffix n-gram), not which occurrence it picks.
"""

from __future__ import annotations

import functools
import math
import sys

import pytest
import torch
from conftest import VOCAB, logits_over_committed, noisy_copy, tiny_model, valid_config
from hypothesis import example, given, settings
from hypothesis import strategies as st

from viasd_tune.config import CHAIN_DRAFTERS, DecodeConfig, model_drafter
from viasd_tune.decoding.common import DIRECT, FULL, SLIM, divergence
from viasd_tune.decoding.decoder import Decoder
from viasd_tune.routing import SkipSet, skipping

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: many tiny forwards, one thread

LAYERS = 4
ARCHS = ("llama", "qwen2", "gemma3")  # gemma3: sliding window 16, exceeded by long prompts + new tokens

# Built once: hypothesis calls each test body many times.
_targets = {arch: tiny_model(arch, seed=10 + i, layers=LAYERS) for i, arch in enumerate(ARCHS)}
MODELS = {arch: (t, noisy_copy(t, 0.15, seed=20 + i)) for i, (arch, t) in enumerate(_targets.items())}

SETTINGS = settings(max_examples=25, deadline=None, derandomize=True, database=None, print_blob=True)
INF = sys.float_info.max  # "never": thresholds are finite, and no finite divergence exceeds this


# ------------------------------------------------------------------------------------------------ strategies


@st.composite
def prompts(draw) -> list[int]:
    base = draw(st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=20))
    if draw(st.booleans()):  # repeat a chunk so prompt lookup finds matches
        start = draw(st.integers(0, len(base) - 1))
        base = base + base[start : start + draw(st.integers(1, 8))]
    return base


skip_sets = st.builds(
    SkipSet.of,
    st.sets(st.integers(0, LAYERS - 1), max_size=3),
    st.sets(st.integers(0, LAYERS - 1), max_size=3),
)
nonempty_skip_sets = skip_sets.filter(lambda s: not s.is_empty)
gammas = st.integers(1, 6)
drafters = st.sampled_from(CHAIN_DRAFTERS)  # the hybrids too; tree drafters: test_tree.py
lookup_mins = st.integers(1, 4)
kls = st.sampled_from(["forward", "reverse", "js"])
archs = st.sampled_from(ARCHS)
new_tokens = st.integers(1, 16)


@st.composite
def thresholds(draw) -> tuple[float, float]:
    values = st.one_of(st.just(0.0), st.floats(0.0, 6.0, allow_nan=False), st.just(INF))
    a, b = draw(values), draw(values)
    return min(a, b), max(a, b)


# ------------------------------------------------------------------------------------------------ helpers


def decode(arch: str, config: DecodeConfig, prompt: list[int], n: int, eos: set[int], **kw):
    target, draft = MODELS[arch]
    return Decoder(target, None, config, draft=draft, eos=set(eos)).generate(prompt, n, **kw)


@functools.lru_cache(maxsize=512)
def _greedy_ar(arch: str, prompt: tuple[int, ...], n: int) -> tuple[int, ...]:
    return tuple(decode(arch, DecodeConfig(mode="ar"), list(prompt), n, set()).token_ids)


def greedy_ar(arch: str, prompt: list[int], n: int, eos: set[int]) -> list[int]:
    """Greedy ar output (16 tokens computed once per prompt), cut at ``n`` tokens and after the first EOS."""
    out = list(_greedy_ar(arch, tuple(prompt), 16))[:n]
    stop = next((i for i, t in enumerate(out) if t in eos), None)
    return out if stop is None else out[: stop + 1]


@torch.inference_mode()
def argmax_next(model, seq: list[int], skip: SkipSet | None = None) -> int:
    """Greedy next token from a cache-free forward of the whole sequence."""
    with skipping(model, skip):
        return int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax())


def argmax_over_committed(model, seq: list[int], committed: int, skip: SkipSet) -> int:
    """The next token of a pass under ``skip`` over the full model's KV of ``seq[:committed]``."""
    return int(logits_over_committed(model, seq, committed, skip)[-1].argmax())


def model_proposal(
    arch, source: str, draft_skip: SkipSet, seq: list[int], k: int, committed: int
) -> list[int]:
    """The model drafter's greedy continuation of ``seq`` (k tokens): the draft model under ``draft_skip`` over its
    own cache (a cache-free forward), or the self-draft over the target's committed KV."""
    target, draft = MODELS[arch]
    out: list[int] = []
    for _ in range(k):
        if source == "model":
            out.append(argmax_next(draft, seq + out, draft_skip))
        else:
            out.append(argmax_over_committed(target, seq + out, committed, draft_skip))
    return out


def lookup_copies(seq: list[int], max_ngram: int = 3) -> list[list[int]]:
    """What prompt lookup may copy from: for each earlier occurrence (one with a successor) of the longest suffix
    n-gram of ``seq`` that recurs (n ≤ max_ngram), everything that followed it. Empty when no token recurs."""
    for n in range(min(max_ngram, len(seq) - 1), 0, -1):
        starts = [s for s in range(len(seq) - n) if seq[s : s + n] == seq[-n:]]
        if starts:
            return [seq[s + n :] for s in starts]
    return []


def is_lookup(drafts: list[int], copies: list[list[int]], room: int) -> bool:
    """Whether ``drafts`` is a lookup proposal with ``room`` for that many tokens: a copy's first tokens, as many
    as the copy holds and the room allows."""
    return any(drafts == copy[: len(drafts)] and len(drafts) == min(room, len(copy)) for copy in copies)


# ------------------------------------------------------------------------------------------------ (i)


@st.composite
def lossless_configs(draw) -> DecodeConfig:
    gamma, drafter, draft_skip = draw(gammas), draw(drafters), draw(nonempty_skip_sets)
    lookup_min = draw(lookup_mins)
    kind = draw(st.sampled_from(["sd", "viasd-escalate0", "viasd-empty-skip", "viasd-recheck"]))
    if kind == "sd":
        return valid_config(
            mode="sd", gamma=gamma, drafter=drafter, draft_skip=draft_skip, lookup_min=lookup_min
        )
    # viasd-recheck: any skip set and thresholds, the target re-checks whatever the others settle
    if kind == "viasd-recheck":
        tau_accept, tau_escalate = draw(thresholds())
        return valid_config(
            mode="viasd",
            gamma=gamma,
            drafter=drafter,
            draft_skip=draft_skip,
            skip=draw(skip_sets),
            tau_accept=tau_accept,
            tau_escalate=tau_escalate,
            kl=draw(kls),
            recheck=True,
            draft_confidence=draw(st.sampled_from([0.0, 0.3, 0.9])),
            lookup_min=lookup_min,
        )
    if kind == "viasd-escalate0":
        tau = (0.0, 0.0)
        skip = draw(skip_sets)
    else:  # the slim verifier is the target itself; nothing is accepted without it (τ_accept = 0)
        tau = (0.0, draw(st.one_of(st.floats(0.0, 6.0, allow_nan=False), st.just(INF))))
        skip = SkipSet()
    return valid_config(
        mode="viasd",
        gamma=gamma,
        drafter=drafter,
        draft_skip=draft_skip,
        skip=skip,
        tau_accept=tau[0],
        tau_escalate=tau[1],
        kl=draw(kls),
        lookup_min=lookup_min,
    )


@SETTINGS
@given(
    arch=archs,
    prompt=prompts(),
    config=lossless_configs(),
    n=new_tokens,
    eos=st.sets(st.integers(3, VOCAB - 1), max_size=1),
)
def test_lossless_configs_equal_greedy_ar(arch, prompt, config, n, eos):
    result = decode(arch, config, prompt, n, eos)
    assert result.token_ids == greedy_ar(arch, prompt, n, eos)
    if config.tau_escalate == 0:
        assert result.tiers == [FULL] * len(result.token_ids)
    if not config.recheck:
        assert DIRECT not in result.tiers  # τ_accept = 0: every token went through a verifier


# ------------------------------------------------------------------------------------------------ (ii)


@st.composite
def any_configs(draw) -> DecodeConfig:
    mode = draw(st.sampled_from(["ar", "sd", "viasd", "viasd"]))
    tau_accept, tau_escalate = draw(thresholds())
    return valid_config(
        mode=mode,
        gamma=draw(gammas),
        drafter=draw(drafters),
        draft_skip=draw(nonempty_skip_sets),
        skip=draw(skip_sets),
        tau_accept=tau_accept,
        tau_escalate=tau_escalate,
        kl=draw(kls),
        recheck=draw(st.booleans()),
        draft_confidence=draw(st.sampled_from([0.0, 0.5])),
        lookup_min=draw(lookup_mins),
    )


@SETTINGS
@given(
    arch=archs,
    prompt=prompts(),
    config=any_configs(),
    n=new_tokens,
    eos=st.sets(st.integers(3, VOCAB - 1), max_size=2),
    temperature=st.sampled_from([0.0, 0.0, 0.7, 1.3]),
    top_p=st.sampled_from([1.0, 0.8]),
    seed=st.integers(0, 2**31 - 1),
)
def test_stats_add_up(arch, prompt, config, n, eos, temperature, top_p, seed):
    # greedy reads neither (and refuses them)
    sampling = {"top_p": top_p, "seed": seed} if temperature else {}
    result = decode(arch, config, prompt, n, eos, temperature=temperature, **sampling)
    s, ids, tiers = result.stats, result.token_ids, result.tiers
    assert len(ids) == len(tiers) == s.new_tokens
    assert 1 <= s.new_tokens <= n
    assert all(0 <= t < VOCAB for t in ids)
    # Generation stops exactly at max_new_tokens or right after the first EOS.
    assert all(t not in eos for t in ids[:-1])
    assert s.new_tokens == n or ids[-1] in eos
    assert [s.tokens_direct, s.tokens_slim, s.tokens_full] == [tiers.count(t) for t in (DIRECT, SLIM, FULL)]
    assert s.tokens_direct + s.tokens_slim + s.tokens_full == s.new_tokens
    d = s.to_dict()
    assert all(math.isfinite(v) and v >= 0 for v in d.values()), d
    # A final re-check that confirms everything is a full call without a round.
    assert s.rounds >= 1 and s.full_calls <= s.rounds + config.recheck and s.slim_calls <= s.rounds
    assert s.rolled_back_tokens <= s.rechecked and s.rollbacks <= s.rechecked
    if not (config.mode == "viasd" and config.recheck):
        assert s.rechecked == s.rollbacks == 0
    for tier in ("draft", "slim", "full"):
        assert d[f"{tier}_tokens_processed"] >= d[f"{tier}_calls"]
    if config.mode == "ar":
        assert s.rounds == s.full_calls == s.new_tokens == s.tokens_full
    else:
        assert s.tokens_direct <= s.drafted  # a directly accepted token is a draft token
        # Every round but a truncated last one ends with one slim- or full-decided token (a rollback can remove
        # those of earlier rounds).
        assert s.tokens_slim + s.tokens_full + s.rolled_back_tokens >= s.rounds - 1
    if config.mode != "viasd":
        assert s.tokens_direct == s.tokens_slim == s.slim_calls == 0
    if config.mode != "ar" and config.drafter == "lookup":
        assert s.draft_calls == 0
    if config.mode != "ar":  # every round drafts from one source: lookup (plain or a hybrid's) or a model
        assert s.rounds_lookup + s.rounds_model >= s.rounds - s.rollbacks - config.recheck
        assert (s.rounds_lookup > 0) <= config.drafter.startswith("lookup")
        assert (s.rounds_model > 0) <= (config.drafter != "lookup")


# ------------------------------------------------------------------------------------------------ (iii)


def rounds_of(tokens: list[int], tiers: list[int]) -> list[tuple[list[int], int | None]]:
    """The output split into rounds: (direct tokens, the closing token's tier, or None for a round cut at
    max_new_tokens after its direct tokens)."""
    out, direct = [], []
    for tok, tier in zip(tokens, tiers, strict=True):
        if tier == DIRECT:
            direct.append(tok)
        else:
            out.append((direct + [tok], tier))
            direct = []
    if direct:
        out.append((direct, None))
    return out


@SETTINGS
@given(
    arch=archs,
    prompt=prompts(),
    gamma=gammas,
    drafter=drafters,
    draft_skip=nonempty_skip_sets,
    skip=skip_sets,
    kl=kls,
    n=new_tokens,
    lookup_min=lookup_mins,
)
# A lookup copy of exactly lookup_min < γ tokens: the hybrid must use it.
@example("llama", [5, 6, 7, 5, 6], 4, "lookup+self", SkipSet.of([1], [1]), SkipSet(), "forward", 8, 3)
@example("qwen2", [5, 6, 7, 5, 6], 4, "lookup+model", SkipSet.of([1], [1]), SkipSet(), "js", 8, 3)
def test_infinite_thresholds_accept_every_draft(
    arch, prompt, gamma, drafter, draft_skip, skip, kl, n, lookup_min
):
    """Each round: the drafter's k ≤ γ proposals, all accepted directly, then the slim verifier's greedy token
    after them; a round with no proposal (lookup without a match) gets the full target's token. A model drafter
    proposes its greedy continuation, γ tokens unless fewer reach max_new_tokens with the verifier's token;
    lookup, a copy (as many tokens as γ and the copy allow); a hybrid, a lookup copy of at least min(lookup_min,
    γ) tokens when it finds one, else its model's continuation."""
    config = valid_config(
        mode="viasd",
        gamma=gamma,
        drafter=drafter,
        draft_skip=draft_skip,
        skip=skip,
        tau_accept=INF,
        tau_escalate=INF,
        kl=kl,
        lookup_min=lookup_min,
    )
    result = decode(arch, config, prompt, n, set())
    target, _ = MODELS[arch]
    source = model_drafter(drafter)
    seq = list(prompt)
    committed = len(prompt) - 1  # the target prefills all but the prompt's last token
    for tokens, tier in rounds_of(result.token_ids, result.tiers):
        i = len(seq) - len(prompt)
        where = f"round at new token {i}"
        drafts = tokens[:-1] if tier is not None else tokens
        # Room for drafts: γ, or what max_new_tokens leaves besides the verifier's token (at least one), as HF's
        # assisted generation caps them.
        room = max(1, min(gamma, n - i - 1))
        copies = lookup_copies(seq)
        if tier == FULL:  # no proposal: only plain lookup finds none
            assert drafter == "lookup" and not copies and not drafts, where
            assert tokens == [argmax_next(target, seq)], where
            committed = len(seq)  # the target's forward committed the sequence
        else:
            assert tier in (SLIM, None) and drafts, where
            by_lookup = drafter.startswith("lookup") and is_lookup(drafts, copies, room)
            if tier is None:  # cut at max_new_tokens: the proposal's first tokens
                by_lookup = drafter.startswith("lookup") and any(c[: len(drafts)] == drafts for c in copies)
            if drafter == "lookup":
                assert by_lookup, where
            elif not by_lookup:
                if drafter != source:  # a hybrid drafts by model only when its lookup copies too little
                    short = min(lookup_min, room)
                    assert not copies or any(min(room, len(c)) < short for c in copies), where
                assert drafts == model_proposal(arch, source, draft_skip, seq, len(drafts), committed), where
                assert tier is None or len(drafts) == room, where
            if tier is not None:
                assert tokens[-1] == argmax_over_committed(target, seq + drafts, committed, skip), where
        seq += tokens
    assert len(result.token_ids) == n
    if drafter != "lookup":
        assert result.stats.full_calls == 0
    if source != "self":  # (a self-draft crops the slim verifier's entries, which then re-reads the lag)
        # The slim verifier feeds only what it has not seen: never the prompt, each token at most once.
        assert result.stats.slim_tokens_processed <= result.stats.slim_calls * gamma + n


# ------------------------------------------------------------------------------------------------ divergences


@SETTINGS
@given(
    rows=st.integers(1, 4),
    vocab=st.integers(2, 12),
    scale=st.floats(0.1, 8.0),
    same=st.booleans(),
    seed=st.integers(0, 10_000),
)
def test_divergences_match_their_definitions(rows, vocab, scale, same, seed):
    """D_i routes every token: forward = KL(p_slim ‖ q), reverse = KL(q ‖ p_slim), js = Jensen–Shannon,
    one-hot draft = −log p_slim(token); all ≥ 0, zero when the distributions agree."""
    g = torch.Generator().manual_seed(seed)
    slim = torch.randn(rows, vocab, generator=g) * scale  # float32, as CachedLM returns them
    draft = slim.clone() if same else torch.randn(rows, vocab, generator=g) * scale
    tokens = torch.randint(0, vocab, (rows,), generator=g)
    p, q = torch.softmax(slim.double(), -1), torch.softmax(draft.double(), -1)  # reference in float64
    m = (p + q) / 2
    want = {
        "forward": (p * (p.log() - q.log())).sum(-1),
        "reverse": (q * (q.log() - p.log())).sum(-1),
        "js": 0.5 * (p * (p.log() - m.log())).sum(-1) + 0.5 * (q * (q.log() - m.log())).sum(-1),
    }
    for kind, ref in want.items():
        d = divergence(slim, draft, tokens, kind)
        assert d.shape == (rows,) and (d >= 0).all()
        torch.testing.assert_close(d.double(), ref.clamp_min(0.0), atol=2e-5, rtol=1e-4)
        if same:
            assert (d < 1e-5).all()
    assert (divergence(slim, draft, tokens, "js") <= math.log(2) + 1e-5).all()
    torch.testing.assert_close(divergence(draft, slim, tokens, "js"), divergence(slim, draft, tokens, "js"))
    for kind in want:  # a one-hot drafter: −log p_slim(token) whatever the kind
        torch.testing.assert_close(
            divergence(slim, None, tokens, kind).double(),
            -p.log().gather(-1, tokens[:, None])[:, 0],
            atol=2e-5,
            rtol=1e-4,
        )
