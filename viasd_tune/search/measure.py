"""Measuring a configuration for real: decode every calibration (or held-out) prompt with it and with a baseline,
interleaved prompt by prompt, and score speed, acceptance and fidelity against the target's own output."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from tqdm.auto import tqdm

from ..config import DecodeConfig
from ..decoding.decoder import Decoder
from ..decoding.tree_sizing import VerifyCost
from ..fidelity import agreement, greedy_agreement
from ..routing import num_layers
from . import replay


@dataclass
class Measurement:
    speedup: float
    fidelity: float  # greedy agreement: share of emitted tokens the target would have picked (fidelity.py)
    agreement: float  # position-wise agreement with the target's decoded greedy output
    exact: float
    acceptance: float
    tier_shares: dict
    tier_time_s: dict
    tokens_per_s: float
    ar_tokens_per_s: float
    # Seconds per emitted token on each prompt, for the configuration and the baseline: a routed export labels
    # every calibration prompt with the configuration that served it fastest.
    prompt_s_per_token: list[float] = field(default_factory=list)
    base_prompt_s_per_token: list[float] = field(default_factory=list)


def measure(
    target,
    tokenizer,
    draft,
    config: DecodeConfig,
    refs: list[replay.Reference],
    max_new_tokens: int,
    flip: bool,
    baseline: DecodeConfig | None = None,
    verify_cost: VerifyCost | None = None,
) -> Measurement:
    """Decode every prompt with ``config`` and with ``baseline`` (AR by default), interleaved; ratio of sums.
    ``verify_cost``: the search's curve for ``tree_sizing`` ``cost`` (None: the decoder measures its own)."""
    dec = Decoder(target, tokenizer, config, draft=draft, verify_cost=verify_cost)
    base = Decoder(target, tokenizer, baseline or DecodeConfig(mode="ar"), draft=draft, verify_cost=verify_cost)
    t_cfg = t_base = 0.0
    tokens = base_tokens = full_calls = slim_calls = 0
    n_layers = num_layers(target)
    fid, pos, exact = [], [], []
    tiers = dict.fromkeys(("direct", "slim", "full"), 0)
    times = dict.fromkeys(("draft", "slim", "full"), 0.0)
    per_prompt: list[float] = []
    base_per_prompt: list[float] = []
    for i, ref in enumerate(refs):
        order = [base, dec] if (i + flip) % 2 == 0 else [dec, base]  # alternate who goes first
        for d in order:
            r = d.generate(ref.prompt_ids, max_new_tokens=max_new_tokens)
            seconds = r.stats.wall_time_s / max(r.stats.new_tokens, 1)
            (base_per_prompt if d is base else per_prompt).append(seconds)
            if d is base:
                t_base += r.stats.wall_time_s
                base_tokens += r.stats.new_tokens
                continue
            s = r.stats
            t_cfg += s.wall_time_s
            tokens += s.new_tokens
            full_calls += s.full_calls
            slim_calls += s.slim_calls
            fid.append(greedy_agreement(target, ref.prompt_ids, r.token_ids))  # untimed
            pos.append(agreement(r.token_ids, ref.output))
            exact.append(float(r.token_ids == ref.output))
            for k in tiers:
                tiers[k] += getattr(s, f"tokens_{k}")
            for k in times:
                times[k] += getattr(s, f"{k}_time_s")
    # Speed compares time per token, so an early EOS on one side does not count as speed.
    speedup = (t_base / max(base_tokens, 1)) / (t_cfg / max(tokens, 1))
    return Measurement(
        speedup=speedup,
        fidelity=statistics.fmean(fid),
        agreement=statistics.fmean(pos),
        exact=statistics.fmean(exact),
        acceptance=replay.acceptance(tokens, full_calls, slim_calls, 1.0 - config.skip.fraction(n_layers)),
        tier_shares={k: v / max(tokens, 1) for k, v in tiers.items()},
        tier_time_s=times,
        tokens_per_s=tokens / t_cfg if t_cfg else 0.0,
        ar_tokens_per_s=base_tokens / t_base if t_base else 0.0,
        prompt_s_per_token=per_prompt,
        base_prompt_s_per_token=base_per_prompt,
    )


def references(target, tokenizer, items, max_new_tokens: int, progress: bool) -> list[replay.Reference]:
    """The target's greedy output on every calibration prompt, decoded once."""
    dec = Decoder(target, tokenizer, DecodeConfig(mode="ar"))
    refs = []
    for p, ids in tqdm(items, desc="target outputs", disable=not progress, leave=False):
        r = dec.generate(ids, max_new_tokens=max_new_tokens)
        refs.append(replay.Reference(p.id, ids, r.token_ids, r.stats.wall_time_s))
    return refs


def held_out(
    target,
    tokenizer,
    draft,
    cfg: DecodeConfig,
    items,
    max_new_tokens: int,
    progress: bool,
    verify_cost: VerifyCost | None = None,
) -> dict:
    """Metrics of ``cfg`` on prompts the search never saw, vs AR and vs plain SD with the same drafter: what the
    exported profile reports."""
    hrefs = references(target, tokenizer, items, max_new_tokens, progress)
    m = measure(target, tokenizer, draft, cfg, hrefs, max_new_tokens, False, verify_cost=verify_cost)
    sd_cfg = DecodeConfig(
        mode="sd",
        gamma=cfg.gamma,
        drafter=cfg.drafter,
        draft_skip=cfg.draft_skip,
        lookup_min=cfg.lookup_min,
    )
    vs_sd = measure(
        target, tokenizer, draft, cfg, hrefs, max_new_tokens, True, baseline=sd_cfg, verify_cost=verify_cost
    )
    return {
        "speedup_measured": m.speedup,
        "speedup_vs_sd": vs_sd.speedup,
        "acceptance": m.acceptance,
        "fidelity": m.fidelity,
        "agreement": m.agreement,
        "exact_match": m.exact,
        "tier_shares": m.tier_shares,
        "tier_time_s": m.tier_time_s,
        "held_out_prompts": len(hrefs),
        "tokens_per_s": m.tokens_per_s,
        "ar_tokens_per_s": m.ar_tokens_per_s,
    }
