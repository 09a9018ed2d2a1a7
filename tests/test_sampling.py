"""The sampling rules are exact: chi-square goodness-of-fit of emitted tokens against the target distribution.

Unit level: fixed target logits p and draft logits q over a small vocabulary, many draws of the accept/correct
rule. Each harness is also run with a deliberately wrong rule, which must fail, so the tests have power.
End to end: the first token of ``Decoder.generate`` (sd / lossless viasd) over many seeds.
All seeds are fixed, so every statistic is reproducible.
"""

from __future__ import annotations

import sys

import pytest
import torch
from conftest import logits_over_committed, tiny_model

from viasd_tune.config import DecodeConfig
from viasd_tune.decoding import common, sd
from viasd_tune.decoding.common import Sampling, accept_mask, probs_from_logits, residual_sample
from viasd_tune.decoding.decoder import Decoder
from viasd_tune.routing import SkipSet

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: many tiny forwards, one thread

V = 8
INF = sys.float_info.max  # thresholds must be finite; this one routes every divergence the same way

# Upper 0.1 % points of the chi-square distribution, chi2.ppf(0.999, df) (scipy.stats; checked below when scipy
# is installed). A correct rule fails a single test with probability 0.001 for a given seed.
CHI2_CRIT_P001 = {
    1: 10.828,
    2: 13.816,
    3: 16.266,
    4: 18.467,
    5: 20.515,
    6: 22.458,
    7: 24.322,
    8: 26.124,
    9: 27.877,
    10: 29.588,
}


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic and degrees of freedom for ``counts`` against ``probs``.

    A category with probability 0 must never occur (returns inf if it does). Categories expected fewer than 5
    times are pooled, smallest first, so the chi-square approximation holds.
    """
    counts, probs = counts.double(), probs.double()
    n = counts.sum()
    impossible = probs <= 0
    if counts[impossible].sum() > 0:
        return float("inf"), 1
    obs, exp = counts[~impossible].tolist(), (probs[~impossible] / probs[~impossible].sum() * n).tolist()
    bins = sorted(zip(exp, obs, strict=True))
    while len(bins) > 2 and bins[0][0] < 5:
        (e0, o0), (e1, o1) = bins[0], bins[1]
        bins = sorted([(e0 + e1, o0 + o1), *bins[2:]])
    stat = sum((o - e) ** 2 / e for e, o in bins)
    return stat, len(bins) - 1


def fits(counts: torch.Tensor, probs: torch.Tensor) -> bool:
    stat, df = chi_square(counts, probs)
    return stat < CHI2_CRIT_P001[df]


def assert_fits(counts: torch.Tensor, probs: torch.Tensor, what: str = "") -> None:
    stat, df = chi_square(counts, probs)
    assert stat < CHI2_CRIT_P001[df], (
        f"{what}: chi2 = {stat:.1f} >= {CHI2_CRIT_P001[df]} (df {df}, p < 0.001)\n"
        f"observed {counts.tolist()}\nexpected {[round(float(x), 1) for x in probs * counts.sum()]}"
    )


def test_chi_square_helper():
    probs = torch.tensor([0.5, 0.3, 0.2, 0.0])
    stat, df = chi_square(torch.tensor([50, 30, 20, 0]), probs)
    assert stat < 1e-9 and df == 2
    assert chi_square(torch.tensor([50, 30, 19, 1]), probs)[0] == float("inf")  # an impossible token occurred
    assert not fits(torch.tensor([70, 20, 10, 0]), probs)
    # Rare categories are pooled: expected 0.5 and 1.5 become one bin with 2 expected.
    stat, df = chi_square(torch.tensor([97, 1, 2]), torch.tensor([0.97, 0.005, 0.025]))
    assert df == 1 and abs(stat - ((97 - 97) ** 2 / 97 + (3 - 3) ** 2 / 3)) < 1e-9


def test_critical_values_match_scipy():
    from scipy import stats  # the test extra installs it

    for df, crit in CHI2_CRIT_P001.items():
        assert abs(stats.chi2.ppf(0.999, df) - crit) < 1e-3


# --------------------------------------------------------------------------------------------- unit level

SETTINGS = [Sampling(1.0, 1.0), Sampling(0.7, 1.0), Sampling(1.0, 0.9)]


def logits_pair(seed: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Target and draft logits that overlap but differ clearly (total variation around 0.3-0.5): far enough
    apart for many rejections, close enough that a wrong acceptance rule shows."""
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(rows, V, generator=g) * 1.5
    q = p + torch.randn(rows, V, generator=g) * 1.2
    return p, q


def nucleus_reference(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Independent top-p: keep the most likely tokens until their mass reaches top_p, renormalise."""
    out = torch.zeros_like(probs)
    mass = 0.0
    for i in probs.argsort(descending=True).tolist():
        out[i] = probs[i]
        mass += float(probs[i])
        if mass >= top_p:
            break
    return out / out.sum()


@pytest.mark.parametrize("sampling", SETTINGS, ids=str)
def test_probs_from_logits_is_temperature_and_nucleus(sampling):
    p_logits, _ = logits_pair(0, 4)
    got = probs_from_logits(p_logits, sampling)
    for row, logits in zip(got, p_logits, strict=True):
        torch.testing.assert_close(
            row, nucleus_reference(torch.softmax(logits / sampling.temperature, -1), sampling.top_p)
        )
    if sampling.top_p < 1:
        assert (got == 0).any()  # the test really filters something


def rule_first_tokens(p, q, n, gen, sampling, accept=None, resample=None) -> torch.Tensor:
    """Histogram of the first emitted token of one speculative step, vectorised over ``n`` trials:
    draft x ~ q, accept it by ``accept`` else emit ``resample``'s token."""
    accept = accept or (lambda p, q, x: accept_mask(p, q, x, sampling, gen))
    resample = resample or (lambda p, q: residual_sample(p, q, gen))
    P, Q = p.expand(n, V), q.expand(n, V)
    drafts = torch.multinomial(q, n, replacement=True, generator=gen)
    first = torch.where(accept(P, Q, drafts), drafts, resample(P, Q))
    return torch.bincount(first, minlength=V)


def wrong_accept_p(gen):
    """Accept with probability p(x) instead of min(1, p(x)/q(x))."""

    def accept(p, q, x):
        return torch.rand(x.shape, generator=gen) < p.gather(-1, x[:, None]).squeeze(-1)

    return accept


def wrong_resample_p(gen):
    """Resample from p instead of the residual norm(max(p - q, 0))."""
    return lambda p, q: torch.multinomial(p, 1, generator=gen).squeeze(-1)


@pytest.mark.parametrize("sampling", SETTINGS, ids=str)
def test_accept_and_residual_rule_is_exact(sampling):
    gen = torch.Generator().manual_seed(1)
    p_logits, q_logits = logits_pair(1, 1)
    p, q = probs_from_logits(p_logits, sampling)[0], probs_from_logits(q_logits, sampling)[0]
    assert 0.5 * (p - q).abs().sum() > 0.2  # the draft is far from the target: many rejections
    n = 100_000
    assert_fits(rule_first_tokens(p, q, n, gen, sampling), p, "speculative rule")
    # Power: each deliberately wrong rule is caught by the same harness.
    assert not fits(rule_first_tokens(p, q, n, gen, sampling, accept=wrong_accept_p(gen)), p)
    assert not fits(rule_first_tokens(p, q, n, gen, sampling, resample=wrong_resample_p(gen)), p)
    # ... and so is emitting the draft token unchecked.
    assert not fits(torch.bincount(torch.multinomial(q, n, replacement=True, generator=gen), minlength=V), p)


def verify_histograms(p_logits, q_logits, drafts_fn, sampling, n, gen) -> list[torch.Tensor]:
    """Run ``sd.verify`` n times; histogram of the i-th emitted token over the runs that emitted one."""
    k = p_logits.shape[0] - 1
    hists = [torch.zeros(V, dtype=torch.long) for _ in range(k + 1)]
    for t in range(n):
        out = sd.verify(p_logits, q_logits, drafts_fn(t), sampling, gen)
        assert 1 <= len(out) <= k + 1
        for i, tok in enumerate(out):
            hists[i][tok] += 1
    return hists


@pytest.mark.parametrize("sampling", SETTINGS, ids=str)
def test_sd_verify_is_exact(sampling, monkeypatch):
    """Position i's token (emitted when drafts 0..i-1 were accepted) is distributed as p_i, including the bonus.
    Rows of p/q do not depend on earlier tokens here, so each position is a fresh speculative step."""
    k, n = 2, 4000
    p_logits, q_logits = logits_pair(2, k + 1)
    q_logits = q_logits[:k]
    p = probs_from_logits(p_logits, sampling)
    q = probs_from_logits(q_logits, sampling)
    gen = torch.Generator().manual_seed(2)
    drafts = torch.stack([torch.multinomial(q[i], n, replacement=True, generator=gen) for i in range(k)], 1)
    hists = verify_histograms(p_logits, q_logits, lambda t: drafts[t], sampling, n, gen)
    for i, h in enumerate(hists):
        assert h.sum() > 150, f"position {i} reached only {int(h.sum())} times"
        assert_fits(h, p[i], f"sd.verify position {i}")

    # Power: the same harness with the wrong acceptance rule (accept with probability p(x)).
    def bad_accept(p, q, tokens, sampling, gen):
        return torch.rand(tokens.shape, generator=gen) < p.gather(-1, tokens[:, None]).squeeze(-1)

    monkeypatch.setattr(common, "accept_mask", bad_accept)
    bad = verify_histograms(p_logits, q_logits, lambda t: drafts[t], sampling, 1500, gen)
    assert not fits(bad[0], p[0])


def test_sd_verify_one_hot_draft_is_exact(monkeypatch):
    """Prompt lookup: a fixed proposal (q = one-hot). Accept x with probability p(x), else sample
    norm(p without x): the emitted token is still distributed as p."""
    sampling = Sampling(1.0, 1.0)
    p_logits, _ = logits_pair(3, 3)
    p = probs_from_logits(p_logits, sampling)
    n = 4000
    gen = torch.Generator().manual_seed(3)
    likely, unlikely = int(p[0].argmax()), int(p[0].argmin())
    assert p[0, likely] > 0.25
    for x0 in (likely, unlikely):
        drafts = torch.tensor([x0, int(p[1].argmax())])
        hists = verify_histograms(p_logits, None, lambda t, d=drafts: d, sampling, n, gen)
        assert_fits(hists[0], p[0], f"one-hot draft {x0}, position 0")
        assert_fits(hists[1], p[1], f"one-hot draft {x0}, position 1")
        assert_fits(hists[2], p[2], f"one-hot draft {x0}, bonus")

    # Power: resampling from p itself (not p without the rejected x) over-weights x.
    def bad_correction(p_row, q_row, token, sampling, gen):
        return torch.multinomial(p_row, 1, generator=gen).squeeze(-1)

    monkeypatch.setattr(common, "correction", bad_correction)
    drafts = torch.tensor([likely, 0])
    bad = verify_histograms(p_logits, None, lambda t: drafts, sampling, 1500, gen)
    assert not fits(bad[0], p[0])


# --------------------------------------------------------------------------------------------- end to end

PROMPT = [1, 4, 6, 3, 5]
N_SEEDS = 1500


@pytest.fixture(scope="module")
def small_vocab_pair():
    """A 2-layer target and an unrelated 1-layer draft over 8 tokens; their next-token distributions at the
    prompt are far apart, so the verifier rejects often."""
    target = tiny_model("llama", seed=0, layers=2, vocab=V)
    draft = tiny_model("llama", seed=100, layers=1, vocab=V)
    return target, draft


def next_token_logits(model, skip: SkipSet | None = None, prompt: list[int] = PROMPT) -> torch.Tensor:
    """Next-token logits after ``prompt``; under ``skip``, as the slim verifier computes them: over the full
    model's KV of all but the last token, which the target prefilled."""
    return logits_over_committed(model, prompt, len(prompt) - 1, skip)[-1]


def first_token_histogram(decoder: Decoder, sampling: Sampling) -> torch.Tensor:
    hist = torch.zeros(V, dtype=torch.long)
    for seed in range(N_SEEDS):
        out = decoder.generate(PROMPT, 1, temperature=sampling.temperature, top_p=sampling.top_p, seed=seed)
        assert len(out.token_ids) == 1
        hist[out.token_ids[0]] += 1
    return hist


def check_end_to_end(decoder: Decoder, expected: torch.Tensor, draft_probs: torch.Tensor, sampling: Sampling):
    # The test could tell the draft's distribution from the target's: its expected chi-square is huge.
    assert N_SEEDS * ((draft_probs - expected) ** 2 / expected.clamp_min(1e-9)).sum() > 10 * CHI2_CRIT_P001[7]
    assert_fits(first_token_histogram(decoder, sampling), expected, f"{decoder.config.mode} first token")


CONFIGS = {
    "sd": (DecodeConfig(mode="sd", gamma=2), Sampling(1.0, 1.0)),
    "viasd-escalate0": (
        DecodeConfig(mode="viasd", gamma=2, skip=SkipSet.of([0], [1]), tau_accept=0.0, tau_escalate=0.0),
        Sampling(1.0, 1.0),
    ),
    # Recheck makes the lossy tiers exact: every token settled directly (drawn from q) or by the slim verifier
    # (drawn from p_slim) is re-checked by the target against the distribution it was drawn from.
    "viasd-recheck-direct": (
        DecodeConfig(mode="viasd", gamma=2, skip=SkipSet.of([0], [1]), tau_accept=INF, tau_escalate=INF, recheck=True),
        Sampling(1.0, 1.0),
    ),
    "viasd-recheck-slim": (
        DecodeConfig(mode="viasd", gamma=2, skip=SkipSet.of([0], [1]), tau_accept=0.0, tau_escalate=INF, recheck=True),
        Sampling(0.8, 0.9),
    ),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_first_token_follows_target(small_vocab_pair, name):
    target, draft = small_vocab_pair
    config, sampling = CONFIGS[name]
    decoder = Decoder(target, None, config, draft=draft, eos=set())
    expected = probs_from_logits(next_token_logits(target), sampling)
    q = probs_from_logits(next_token_logits(draft), sampling)
    check_end_to_end(decoder, expected, q, sampling)


def test_slim_verifier_samples_the_slim_model_exactly(small_vocab_pair):
    """τ_accept = 0, τ_escalate = ∞ with a skip set: the slim verifier alone decides, so the output follows the
    *slim* model's distribution (the target with those sub-layers skipped), not the target's. With top-p, so
    the nucleus filter is covered end to end as well."""
    target, draft = small_vocab_pair
    skip = SkipSet.of([0], [1])
    sampling = Sampling(0.8, 0.9)
    never = sys.float_info.max  # thresholds are finite; no finite divergence exceeds this
    config = DecodeConfig(mode="viasd", gamma=2, skip=skip, tau_accept=0.0, tau_escalate=never)
    decoder = Decoder(target, None, config, draft=draft, eos=set())
    slim = probs_from_logits(next_token_logits(target, skip), sampling)
    full = probs_from_logits(next_token_logits(target), sampling)
    assert (slim == 0).any()  # the nucleus really cuts something
    assert (
        not torch.equal(slim == 0, full == 0)
        or N_SEEDS * ((slim - full) ** 2 / full).sum() > 3 * CHI2_CRIT_P001[7]
    )
    check_end_to_end(decoder, slim, probs_from_logits(next_token_logits(draft), sampling), sampling)


@pytest.mark.parametrize("name", ["viasd-recheck-direct", "viasd-recheck-slim"])
def test_recheck_second_token_follows_target(small_vocab_pair, name):
    """The second token too: it was settled in the same round as the first, or after a rollback of it, and its
    marginal must be the target's, sum over x of p(x) p(· | x)."""
    target, draft = small_vocab_pair
    config, sampling = CONFIGS[name]
    decoder = Decoder(target, None, config, draft=draft, eos=set())
    first = probs_from_logits(next_token_logits(target), sampling)
    second = sum(
        first[x] * probs_from_logits(next_token_logits(target, prompt=PROMPT + [x]), sampling) for x in range(V)
    )
    hist = torch.zeros(V, dtype=torch.long)
    rollbacks = 0
    for seed in range(N_SEEDS):
        out = decoder.generate(PROMPT, 2, temperature=sampling.temperature, top_p=sampling.top_p, seed=seed)
        hist[out.token_ids[1]] += 1
        rollbacks += out.stats.rollbacks
    assert rollbacks > N_SEEDS // 10  # the lossy tiers really disagreed, so the re-check had work to do
    assert_fits(hist, second, f"{name} second token")
