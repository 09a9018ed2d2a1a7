"""The methods a bench compares and the runner that times them.

Planning (which methods run, which are skipped and why), building them on the already-loaded models (our
decoders, tuned profiles, Hugging Face ``generate`` with its assisted-generation knobs), and the interleaved
runner: for every (repeat, prompt) each method runs once, in an order that rotates, after one untimed warm-up.
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import UserError
from .contention import CpuMeter

if TYPE_CHECKING:  # torch and the model loader are imported where used: `viasd-tune --help` stays fast
    import torch

    from .. import models

BASELINE = "hf"
HF_ASSISTED_DEFAULT = ("hf-assisted", "hf-assisted-default")  # run by default when there is a draft model
HF_ASSISTED_OPT_IN = ("hf-assisted-conf", "hf-assisted-heuristic")  # only when --methods names them
HF_ASSISTED = (*HF_ASSISTED_DEFAULT, *HF_ASSISTED_OPT_IN)
TREE_METHOD = "sd-tree"  # our SD over a token tree (issue 33): by default only when --tree-nodes is given
FIXED_METHODS = (BASELINE, "ar", *HF_ASSISTED, "hf-lookup", "sd", TREE_METHOD)
VIASD_PREFIX = "viasd:"
RECHECK_PREFIX = "viasd+recheck:"  # the same profile with recheck on: lossless VIA-SD beside the lossy one
ROUTE_SEP = "#"  # viasd:<profile>#<configuration>: one configuration of a routed profile, served alone
LOOKUP_NGRAM = 3  # our LookupDrafter's longest n-gram; hf-lookup gets the same
DEFAULT_GAMMA = 5
DEFAULT_TREE_NODES = 16  # sd-tree named in --methods without --tree-nodes

# ------------------------------------------------------------------------------------------------ profiles


@dataclass
class BenchProfile:
    name: str
    path: str
    data: dict

    @property
    def configurations(self) -> list[str]:
        """A routed profile's configuration names (empty for a single-configuration profile)."""
        return [c["name"] for c in self.data.get("routes", {}).get("configurations", [])]


def profile_name(path: Path, taken: set[str]) -> str:
    """A short unique label: the folder of a search's ``profile.json``, else the file stem."""
    base = path.parent.name if path.stem == "profile" and path.parent.name else path.stem
    name, k = base, 2
    while name in taken:
        name, k = f"{base}-{k}", k + 1
    return name


def load_profiles(paths: Sequence[str]) -> list[BenchProfile]:
    """Validated profiles (each a one-line UserError when broken) with unique names."""
    from ..profile import load_profile

    out: list[BenchProfile] = []
    for p in paths:
        name = profile_name(Path(p), {b.name for b in out})
        out.append(BenchProfile(name, str(p), load_profile(p)))
    return out


# ------------------------------------------------------------------------------------------------ planning


@dataclass
class Method:
    """One way of decoding: ours (a :class:`Decoder`) or HF ``generate`` with extra arguments."""

    name: str
    description: str
    decoder: Any = None  # viasd_tune.decoding.decoder.Decoder for ours
    generate_kwargs: dict = field(default_factory=dict)
    assistant_config: Any = None  # GenerationConfig put on the draft for HF assisted generation
    settings: dict = field(default_factory=dict)
    routed: bool = False  # a routed profile: its rule reads the prompt's category

    @property
    def ours(self) -> bool:
        return self.decoder is not None


def is_viasd(name: str) -> bool:
    """A method that decodes with a tuned profile (with or without recheck)."""
    return name.startswith((VIASD_PREFIX, RECHECK_PREFIX))


def plan_methods(
    requested: list[str] | None,
    has_draft: bool,
    profile_names: list[str],
    routes: dict[str, list[str]] | None = None,
    tree: bool = False,
) -> tuple[list[str], dict[str, str]]:
    """Which methods run (``hf`` first) and which default ones are skipped, with the reason. ``routes``: a routed
    profile's configuration names, each benched beside the profile as ``viasd:<profile>#<configuration>``.
    ``tree`` (--tree-nodes given): ``sd-tree`` runs by default, after ``sd``."""
    routes = routes or {}
    viasd = [
        m
        for n in profile_names
        for m in [VIASD_PREFIX + n, *(f"{VIASD_PREFIX}{n}{ROUTE_SEP}{c}" for c in routes.get(n, []))]
    ]
    recheck = [RECHECK_PREFIX + n for n in profile_names]
    skipped: dict[str, str] = {}
    if requested is None:
        names = [BASELINE, "ar"]
        if has_draft:
            names += [*HF_ASSISTED_DEFAULT, "sd"]
        else:
            names += ["hf-lookup", "sd"]
            for m in HF_ASSISTED_DEFAULT:
                skipped[m] = "no --draft: HF assisted generation needs a draft model (hf-lookup runs instead)"
        if tree:
            names.append(TREE_METHOD)
        return names + viasd, skipped
    names = []
    for m in requested:
        if m in ("viasd", "viasd+recheck") and not profile_names:
            raise UserError(f"--methods names {m} but no --profile was given; pass --profile P")
        if m == "viasd":
            names += viasd
        elif m == "viasd+recheck":
            names += recheck
        elif m in FIXED_METHODS or m in viasd or m in recheck:
            names.append(m)
        else:
            known = [*FIXED_METHODS, "viasd", "viasd+recheck", *viasd, *recheck]
            raise UserError(f"unknown method {m!r} in --methods; choose from {', '.join(known)}")
        if m in HF_ASSISTED and not has_draft:
            raise UserError(f"method {m} is HF assisted generation and needs a draft model; pass --draft")
    if BASELINE not in names:
        names.insert(0, BASELINE)
    return list(dict.fromkeys(names)), skipped


def resolve_gamma(gamma: int | None, profiles: list[BenchProfile]) -> tuple[int, str]:
    """γ for ``sd``, the ``hf-assisted`` methods and ``hf-lookup``: --gamma, else the (first) profile's, else 5."""
    if gamma is not None:
        return gamma, "--gamma"
    if profiles:
        return int(profiles[0].data["gamma"]), f"profile {profiles[0].name}"
    return DEFAULT_GAMMA, "default"


# ------------------------------------------------------------------------------------------------ HF assisted


def assistant_config(name: str, draft_config: Any, gamma: int) -> tuple[Any, str]:
    """The draft's GenerationConfig for one HF assisted-generation method, and what it does.

    HF reads the assisted-generation knobs from ``assistant_model.generation_config`` only: passed to
    ``target.generate()`` they are silently ignored. So each method gets its own copy of the draft's config.
    """
    c = copy.deepcopy(draft_config)
    if name == "hf-assisted":  # exactly γ drafts per round: the algorithm our `sd` runs
        c.num_assistant_tokens = gamma
        c.num_assistant_tokens_schedule = "constant"
        c.assistant_confidence_threshold = 0.0
        return c, f"transformers assisted generation, same draft, γ={gamma} constant"
    if name == "hf-assisted-default":  # HF fills in its own defaults
        return c, "transformers assisted generation, same draft, HF's default schedule"
    if name == "hf-assisted-conf":  # threshold left unset: HF's default confidence cut
        c.num_assistant_tokens = gamma
        c.num_assistant_tokens_schedule = "constant"
        return c, f"transformers assisted generation, same draft, γ={gamma} constant with HF's confidence cut"
    if name == "hf-assisted-heuristic":
        c.num_assistant_tokens = gamma
        c.num_assistant_tokens_schedule = "heuristic"
        return c, f"transformers assisted generation, same draft, γ={gamma} to start, HF's heuristic schedule"
    raise ValueError(name)


def assistant_settings(config: Any) -> dict:
    """The assisted-generation knobs HF will actually use (its defaults filled in where unset)."""
    c = copy.deepcopy(config)
    # private in transformers 5.x; without it we report the raw (possibly None = HF default) values
    with contextlib.suppress(AttributeError, TypeError):
        c.update(**c._get_default_generation_params(), defaults_only=True)
    keys = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")
    return {k: getattr(c, k, None) for k in keys}


# ------------------------------------------------------------------------------------------------ building


def build_methods(
    names: list[str],
    target: models.LoadedModel,
    draft: models.LoadedModel | None,
    profiles: list[BenchProfile],
    gamma: int,
    eos: set[int],
    draft_confidence: float = 0.0,
    tree_nodes: int | None = None,
) -> dict[str, Method]:
    """Decoders and HF arguments for every method, sharing the already-loaded models. ``draft_confidence`` is
    our ``sd``'s (0: always γ drafts); ``tree_nodes`` is ``sd-tree``'s node budget (None: 16)."""
    from .. import runtime
    from ..config import DecodeConfig
    from ..decoding.decoder import Decoder
    from ..profile import configuration_profile

    tm, tok = target.model, target.tokenizer
    by_name = {VIASD_PREFIX + b.name: b for b in profiles} | {RECHECK_PREFIX + b.name: b for b in profiles}
    single = {
        f"{VIASD_PREFIX}{b.name}{ROUTE_SEP}{c}": (b, k)
        for b in profiles
        for k, c in enumerate(b.configurations)
    }
    by_name |= {m: b for m, (b, _) in single.items()}
    out: dict[str, Method] = {}
    for name in names:
        if name == BASELINE:
            out[name] = Method(name, "transformers model.generate, greedy", settings={"do_sample": False})
        elif name == "ar":
            out[name] = Method(
                name, "ours, autoregressive", Decoder(tm, tok, DecodeConfig(mode="ar"), eos=eos)
            )
        elif name == "sd":
            drafter = "model" if draft is not None else "lookup"
            cfg = DecodeConfig(mode="sd", gamma=gamma, drafter=drafter, draft_confidence=draft_confidence)
            dec = Decoder(tm, tok, cfg, draft=draft.model if draft else None, eos=eos)
            what = "the draft model" if draft is not None else "prompt lookup"
            if draft_confidence:
                what += f", drafting stops below confidence {draft_confidence:g}"
            out[name] = Method(
                name,
                f"ours, lossless SD, γ={gamma}, {what}",
                dec,
                settings={"gamma": gamma, "drafter": drafter, "draft_confidence": draft_confidence},
            )
        elif name == TREE_METHOD:
            out[name] = tree_method(target, draft, gamma, eos, tree_nodes)
        elif name == "hf-lookup":
            kw = {"prompt_lookup_num_tokens": gamma, "max_matching_ngram_size": LOOKUP_NGRAM}
            out[name] = Method(
                name, f"transformers prompt-lookup decoding, γ={gamma}", generate_kwargs=kw, settings=dict(kw)
            )
        elif name in HF_ASSISTED:
            config, what = assistant_config(name, draft.model.generation_config, gamma)
            out[name] = Method(name, what, assistant_config=config, settings=assistant_settings(config))
        else:
            b = by_name[name]
            recheck = name.startswith(RECHECK_PREFIX)
            data = {**b.data, "recheck": True} if recheck else b.data
            what = f"ours, VIA-SD profile {b.path}" + (", recheck on (lossless)" if recheck else "")
            if name in single:
                k = single[name][1]
                data = configuration_profile(b.data, k)
                what = f"ours, configuration {b.configurations[k]} of routed profile {b.path}, alone"
            elif recheck and "routes" in data:
                routes = data["routes"]
                configurations = [{**c, "recheck": True} for c in routes["configurations"]]
                data["routes"] = {**routes, "configurations": configurations}
            dec = runtime.load(data, model=target, draft=draft, strict=True)
            if isinstance(dec, runtime.RoutedDecoder):
                for d in dec.decoders:
                    d.eos = eos
                out[name] = Method(
                    name,
                    f"{what}, routed per prompt by its rule",
                    dec,
                    routed=True,
                    settings={
                        "profile": b.path,
                        "configurations": [d.config.to_dict() for d in dec.decoders],
                        "names": dec.names,
                        "rule": dec.rule,
                        "profile_dtype": b.data["dtype"],
                    },
                )
                continue
            dec.eos = eos
            c = dec.config
            out[name] = Method(
                name,
                what,
                dec,
                settings={
                    "profile": b.path,
                    "gamma": c.gamma,
                    "drafter": c.drafter,
                    "skip_attn": sorted(c.skip.attn),
                    "skip_mlp": sorted(c.skip.mlp),
                    "tau_accept": c.tau_accept,
                    "tau_escalate": c.tau_escalate,
                    "kl": c.kl,
                    "lookup_min": c.lookup_min,
                    "recheck": c.recheck,
                    "draft_confidence": c.draft_confidence,
                    **({"tree": c.to_profile()["tree"]} if c.is_tree else {}),
                    "profile_dtype": b.data["dtype"],
                },
            )
    return out


def tree_method(
    target: models.LoadedModel, draft: models.LoadedModel | None, gamma: int, eos: set[int], nodes: int | None
) -> Method:
    """``sd-tree``: lossless SD over a token tree of up to ``nodes`` draft nodes, no deeper than γ, from prompt
    lookup and token recycling (and the draft model, when there is one), each source at its default shape."""
    from ..config import DecodeConfig
    from ..decoding.decoder import Decoder

    nodes = DEFAULT_TREE_NODES if nodes is None else nodes
    drafter = "lookup+recycle+model" if draft is not None else "lookup+recycle"
    cfg = DecodeConfig(mode="sd", gamma=gamma, drafter=drafter, tree_nodes=nodes)
    dec = Decoder(target.model, target.tokenizer, cfg, draft=draft.model if draft else None, eos=eos)
    return Method(
        TREE_METHOD,
        f"ours, lossless SD over a token tree of up to {nodes} nodes, depth ≤ γ={gamma}, drafter {drafter}",
        dec,
        settings={"gamma": gamma, "drafter": drafter, "tree": cfg.to_profile()["tree"]},
    )


# ------------------------------------------------------------------------------------------------ running


class CallCounter:
    """Counts forward calls of a module and the tokens fed to it with a pre-hook, so HF's forwards are counted
    like ours."""

    def __init__(self, module: torch.nn.Module):
        self.calls = self.tokens = 0
        self.handle = module.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs) -> None:
        self.calls += 1
        ids = kwargs.get("input_ids", args[0] if args else None)
        shape = getattr(ids, "shape", None)
        if shape:
            self.tokens += int(shape[-1])

    def reset(self) -> None:
        self.calls = self.tokens = 0

    def remove(self) -> None:
        self.handle.remove()


class Runner:
    """Runs one method on one prompt and times only the decoding call.

    With ``wait_idle`` > 0 each timed run first waits (that long at most) for the rest of the machine to go quiet;
    a run during which other processes used more than ``foreign_max`` cores on average is re-run up to ``retries``
    times. Every record says how busy the machine was (``foreign_cores``), whatever these settings.
    """

    def __init__(
        self,
        target: models.LoadedModel,
        draft: models.LoadedModel | None,
        eos: set[int],
        *,
        wait_idle: float = 0.0,
        foreign_max: float = 0.05,
        retries: int = 0,
    ):
        self.target, self.draft = target.model, draft.model if draft else None
        self.eos = sorted(eos)
        tok = target.tokenizer
        pad = tok.pad_token_id if getattr(tok, "pad_token_id", None) is not None else self.eos[0]
        self.hf_kwargs = {"do_sample": False, "eos_token_id": self.eos, "pad_token_id": pad}
        self.cuda = self.target.device.type == "cuda"
        self.counter = CallCounter(self.target)
        self.draft_counter = CallCounter(self.draft) if self.draft is not None else None
        self.meter = CpuMeter()
        self.wait_idle, self.foreign_max, self.retries = wait_idle, foreign_max, retries

    def close(self) -> None:
        """Remove the counting hooks from the models."""
        self.counter.remove()
        if self.draft_counter is not None:
            self.draft_counter.remove()

    def _sync(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()

    def run(
        self, method: Method, ids: torch.Tensor, max_new: int, timed: bool = True, category: str | None = None
    ) -> dict:
        """Decode ``ids`` (1-D) greedily; the record holds tokens, seconds, forwards, contention and the output.

        ``timed=False`` (the warm-up) neither waits for quiet nor re-runs.
        """
        waited, retries = 0.0, 0
        while True:
            if timed:
                waited += self.meter.wait_idle(self.wait_idle, threshold=self.foreign_max)
            before = self.meter.snapshot()
            rec = self._run_once(method, ids, max_new, category)
            foreign = self.meter.foreign_cores(before, self.meter.snapshot())
            if not timed or foreign <= self.foreign_max or retries >= self.retries:
                break
            retries += 1
        ids_out = rec.pop("ids")
        rec.update(foreign_cores=round(foreign, 3), retries=retries, waited_s=round(waited, 1), ids=ids_out)
        return rec

    def _run_once(self, method: Method, ids: torch.Tensor, max_new: int, category: str | None = None) -> dict:
        self.counter.reset()
        if self.draft_counter is not None:
            self.draft_counter.reset()
        rec: dict[str, Any] = {}
        c0 = time.process_time()
        if method.ours:
            self._sync()
            t0 = time.perf_counter()
            routed = {"category": category} if method.routed else {}
            res = method.decoder.generate(ids, max_new_tokens=max_new, **routed)
            self._sync()
            seconds = time.perf_counter() - t0
            out = list(res.token_ids)
            rec["stats"] = res.stats.to_dict()
            if res.tiers and is_viasd(method.name):
                rec["tiers"] = list(res.tiers)
            full_calls = res.stats.full_calls
        else:
            out, seconds = self._hf(method, ids, max_new)
            full_calls = self.counter.calls
        cpu = time.process_time() - c0
        rec.update(
            tokens=len(out),
            seconds=seconds,
            target_calls=full_calls,
            target_forwards=self.counter.calls,
            target_tokens_fed=self.counter.tokens,
            draft_forwards=self.draft_counter.calls if self.draft_counter else 0,
            cpu_seconds=cpu,  # process CPU time: well below threads x seconds means we were starved
        )
        rec["ids"] = out
        return rec

    def _hf(self, method: Method, ids: torch.Tensor, max_new: int) -> tuple[list[int], float]:
        import torch

        from .. import kernels

        kw = {**self.hf_kwargs, **method.generate_kwargs, "max_new_tokens": max_new}
        saved = None
        if method.assistant_config is not None:
            # HF reads the assistant knobs from the draft's own generation_config (target.generate(...) kwargs
            # are ignored for them) and its "heuristic" schedule writes back into it: a fresh copy per call.
            saved = self.draft.generation_config
            self.draft.generation_config = copy.deepcopy(method.assistant_config)
            kw["assistant_model"] = self.draft
        inp = ids.unsqueeze(0)
        try:
            self._sync()
            t0 = time.perf_counter()
            with kernels.stock(self.target, self.draft):  # HF as a user runs it, on PyTorch's own kernels
                seq = self.target.generate(inp, attention_mask=torch.ones_like(inp), **kw)
            self._sync()
            seconds = time.perf_counter() - t0
        finally:
            if saved is not None:
                self.draft.generation_config = saved
        return seq[0, inp.shape[1] :].tolist(), seconds


def rotated(names: list[str], k: int) -> list[str]:
    """The method order for the k-th (repeat, prompt): a rotation, so each method leads equally often."""
    k %= len(names)
    return names[k:] + names[:k]


def run_interleaved(
    runner: Runner,
    methods: dict[str, Method],
    encoded: list[torch.Tensor],
    *,
    repeats: int,
    max_new_tokens: int,
    warmup_tokens: int,
    progress: bool = True,
    categories: list[str | None] | None = None,
) -> dict[str, list[list[dict]]]:
    """records[method][repeat][prompt]: every method on every prompt, order rotated, after one warm-up each.
    ``categories``: each prompt's category, for routed profiles' rules."""
    import torch
    from tqdm.auto import tqdm

    names = list(methods)
    with torch.inference_mode():
        for m in names:  # untimed: first-call allocations, kernel selection, lazy imports
            runner.run(methods[m], encoded[0], min(warmup_tokens, max_new_tokens), timed=False)
        ours = [methods[m].decoder for m in names if methods[m].ours]
        records: dict[str, list[list[dict]]] = {
            m: [[{}] * len(encoded) for _ in range(repeats)] for m in names
        }
        total = repeats * len(encoded) * len(names)
        with tqdm(total=total, desc="bench", unit="run", disable=not progress, dynamic_ncols=True) as bar:
            k = 0
            for r in range(repeats):
                for decoder in ours:  # each pass starts cold: no prompt drafts from its own earlier output
                    decoder.forget()
                for i, ids in enumerate(encoded):
                    for m in rotated(names, k):
                        bar.set_postfix_str(f"repeat {r + 1} prompt {i + 1} {m}", refresh=False)
                        cat = categories[i] if categories else None
                        records[m][r][i] = runner.run(methods[m], ids, max_new_tokens, category=cat)
                        bar.update(1)
                    k += 1
    return records
