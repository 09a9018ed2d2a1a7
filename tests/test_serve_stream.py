"""``Decoder.stream`` (issue 34): text pieces as rounds commit final tokens, equal in the end to ``generate``."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import char_tokenizer, noisy_copy, tiny_model
from test_routed import AR, BY_LENGTH, LOOKUP, routed, tiny  # noqa: F401 (tiny: a fixture)

from viasd_tune import runtime
from viasd_tune.config import DecodeConfig
from viasd_tune.decoding.common import Result, Sequence, Stats
from viasd_tune.decoding.decoder import Decoder, StreamEnd
from viasd_tune.decoding.streaming import TextStream, _StopStrings
from viasd_tune.errors import UserError
from viasd_tune.routing import SkipSet

MULTIBYTE = "Grüße aus Köln: 中文字符, émoji 😀 and naïve café — ok."

CONFIGS = {
    "ar": DecodeConfig(mode="ar"),
    "sd-lookup": DecodeConfig(mode="sd", drafter="lookup", gamma=4),
    "sd-model": DecodeConfig(mode="sd", drafter="model", gamma=3),
    # token trees (issue 33): each round is one tree forward; sampled with a seed too
    "sd-tree-lookup+recycle": DecodeConfig(mode="sd", drafter="lookup+recycle", gamma=4, tree_nodes=10),
    "sd-tree-model": DecodeConfig(mode="sd", drafter="lookup+recycle+model", gamma=3, tree_nodes=8),
    # τ_escalate 50 lets the slim verifier settle nearly everything, so recheck rolls some of it back
    "viasd-recheck": DecodeConfig(
        mode="viasd", drafter="model", gamma=4, skip=SkipSet.of([2], [1]), tau_escalate=50.0, recheck=True
    ),
    "viasd-lossy": DecodeConfig(
        mode="viasd", drafter="model", gamma=3, skip=SkipSet.of([1], [2]), tau_accept=0.05, tau_escalate=2.0
    ),
    "viasd-self": DecodeConfig(
        mode="viasd",
        drafter="lookup+self",
        gamma=3,
        skip=SkipSet.of([2], []),
        draft_skip=SkipSet.of([1, 2], [1]),
        tau_escalate=5.0,
        recheck=True,
    ),
}


def byte_tokenizer():
    """A byte-level tokenizer (GPT-2 style, as SmolLM2's and Qwen's): one token per UTF-8 byte, so a multi-byte
    character spans several tokens, and rounds can end inside one."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers import models as tok_models
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate(alphabet)}}
    backend = Tokenizer(tok_models.BPE(vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )


def collect(stream) -> tuple[list[str], StreamEnd]:
    items = list(stream)
    assert isinstance(items[-1], StreamEnd) and all(isinstance(p, str) and p for p in items[:-1])
    return items[:-1], items[-1]


@pytest.fixture(scope="module")
def char_pair():
    target = tiny_model("llama", seed=0, layers=4)
    return target, noisy_copy(target, 0.1, seed=1), char_tokenizer()


@pytest.fixture(scope="module")
def memorised(one_thread):
    """A tiny byte-level model trained to recite MULTIBYTE, so its greedy output holds real multi-byte text."""
    tok = byte_tokenizer()
    ids = torch.tensor([tok(MULTIBYTE).input_ids])
    torch.manual_seed(0)
    model = tiny_model("llama", seed=0, layers=2, vocab=len(tok), hidden=64).train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(150):
        opt.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    return model.eval(), tok


def _text_prompts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    chars = [chr(c) for c in range(33, 120)]
    out = []
    for _ in range(n):
        motif = "".join(rng.choice(chars) for _ in range(rng.randint(2, 6)))
        out.append(
            (motif * 10)[: rng.randint(3, 30)] if rng.random() < 0.5 else "".join(rng.choices(chars, k=12))
        )
    return out


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_stream_concatenates_to_generate(char_pair, one_thread, name) -> None:
    """Every mode, many prompts, greedy and sampled with a seed: the pieces join to ``generate().text`` and the
    final result holds the same tokens and counts."""
    target, draft, tok = char_pair
    dec = Decoder(target, tok, CONFIGS[name], draft=draft)
    rollbacks = pieces_seen = 0
    for i, prompt in enumerate(_text_prompts(16, seed=len(name))):
        kw = dict(max_new_tokens=40) if i % 4 else dict(max_new_tokens=30, temperature=0.8, seed=i)
        ref = dec.generate(prompt, **kw)
        pieces, end = collect(dec.stream(prompt, **kw))
        assert "".join(pieces) == ref.text == end.result.text
        assert end.result.token_ids == ref.token_ids and end.result.tiers == ref.tiers
        assert end.result.stats.new_tokens == ref.stats.new_tokens == len(ref.token_ids)
        assert end.finish_reason == ("stop" if ref.token_ids[-1] in dec.eos else "length")
        rollbacks += end.result.stats.rollbacks
        pieces_seen += len(pieces)
    assert pieces_seen > 16  # text arrives in several pieces, not once at the end
    if name == "viasd-recheck":
        assert rollbacks > 0  # streamed text never includes a token a re-check later replaced


def test_stream_keeps_multibyte_characters_whole(memorised, one_thread) -> None:
    model, tok = memorised
    prompt = tok("Grü").input_ids
    n = len(tok(MULTIBYTE).input_ids) - len(prompt)
    for config in (CONFIGS["ar"], CONFIGS["sd-lookup"], DecodeConfig(mode="sd", drafter="lookup", gamma=1)):
        dec = Decoder(model, tok, config)
        ref = dec.generate(prompt, max_new_tokens=n)
        assert ref.text == MULTIBYTE[3:]  # the model recites real multi-byte text
        pieces, end = collect(dec.stream(prompt, max_new_tokens=n))
        assert "".join(pieces) == ref.text
        assert not any("\ufffd" in p for p in pieces)


def _fake_run(ids: list[int], prompt_len: int, rng: random.Random):
    """An engine stand-in: emits ``ids`` in rounds of random sizes, with a final watermark that lags at random."""

    def run(hook) -> Result:
        seq = Sequence(torch.tensor(ids[:prompt_len]), capacity=len(ids) + 1)
        final = 0
        while seq.length < len(ids):
            n = rng.randint(1, 5)
            seq.append(ids[seq.length : seq.length + n], [2] * len(ids[seq.length : seq.length + n]))
            emitted = seq.length - prompt_len
            final = rng.randint(final, emitted)
            if hook(seq, final):
                seq.truncate(prompt_len + final)
                break
        return Result(seq.emitted, Stats(new_tokens=seq.length - prompt_len), list(seq.tiers))

    return run


@pytest.mark.parametrize("seed", range(20))
def test_rounds_ending_mid_character_never_show_a_broken_one(seed) -> None:
    """Rounds and final watermarks split multi-byte characters at every possible byte."""
    tok, rng = byte_tokenizer(), random.Random(seed)
    ids = tok(MULTIBYTE * 2).input_ids
    pieces, end = collect(TextStream(_fake_run(ids, 2, rng), tok, eos={2}))
    assert "".join(pieces) == tok.decode(ids[2:]) == end.result.text
    assert not any("\ufffd" in p for p in pieces) and end.finish_reason == "length"


@pytest.mark.parametrize("seed", range(10))
def test_stop_strings_end_decoding_and_are_cut(seed) -> None:
    tok, rng = byte_tokenizer(), random.Random(seed)
    ids = tok(MULTIBYTE * 3).input_ids
    stop = rng.choice(["中文", "😀 and", "café —", "ok.Gr", " aus"])
    pieces, end = collect(TextStream(_fake_run(ids, 2, rng), tok, eos={2}, stop=["never there", stop]))
    full = tok.decode(ids[2:])
    assert "".join(pieces) == full[: full.index(stop)] == end.result.text
    assert end.finish_reason == "stop"
    # decoding ended at the round that made the stop string final, not at the end of the text
    assert stop in tok.decode(end.result.token_ids) and len(end.result.token_ids) < len(ids) - 2


def test_stop_filter_holds_back_a_possible_start_only() -> None:
    f = _StopStrings(["STOP", "xy"])
    assert f.feed("abc ST") == "abc " and f.feed("O") == "" and f.feed("P and more") == ""
    assert f.hit
    f = _StopStrings(["STOP"])
    assert f.feed("a STO") == "a " and f.feed("NE") == "STONE" and f.finish() == ""
    f = _StopStrings(["STOP"])
    assert f.feed("a ST", lookahead="OP!") == "a " and f.hit  # found in the not-yet-released text too


@pytest.mark.parametrize("name", ["viasd-recheck", "sd-tree-model"])
def test_stop_with_real_decoding(char_pair, one_thread, name) -> None:
    target, draft, tok = char_pair
    dec = Decoder(target, tok, CONFIGS[name], draft=draft)
    hits = 0
    for prompt in _text_prompts(8, seed=3):
        ref = dec.generate(prompt, max_new_tokens=40)
        stop = ref.text[12:15]
        if len(stop) < 3:
            continue
        pieces, end = collect(dec.stream(prompt, max_new_tokens=40, stop=stop))
        assert "".join(pieces) == ref.text[: ref.text.index(stop)] and end.finish_reason == "stop"
        assert ref.token_ids[: len(end.result.token_ids)] == end.result.token_ids
        assert len(end.result.token_ids) < len(ref.token_ids)  # it stopped early
        hits += 1
    assert hits >= 4


def test_cancel_stops_within_a_round(char_pair, one_thread) -> None:
    target, draft, tok = char_pair
    eos_free = Decoder(target, tok, CONFIGS["sd-model"], draft=draft, eos=set())
    stream = eos_free.stream("abcabc", max_new_tokens=400)
    first = next(stream)
    assert isinstance(first, str)
    stream.cancel()
    rest = list(stream)
    end = rest[-1]
    assert isinstance(end, StreamEnd) and end.finish_reason == "cancelled"
    assert len(end.result.token_ids) < 400
    stream.close()  # idempotent once ended


def test_close_mid_stream_joins_the_generation(char_pair, one_thread) -> None:
    target, _, tok = char_pair
    dec = Decoder(target, tok, CONFIGS["ar"], eos=set())
    stream = dec.stream("hello", max_new_tokens=400)
    next(stream)
    stream.close()
    assert not stream._thread.is_alive()
    assert dec.generate("hello", max_new_tokens=5).token_ids  # the model is free again


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(temperature=-1.0), "temperature"),
        (dict(stop=""), "stop"),
        (dict(stop=["a", "b", "c", "d", "e"]), "at most 4"),
        (dict(stop=[1]), "stop"),
        (dict(max_new_tokens=600), "context length"),
    ],
)
def test_stream_refuses_bad_input_before_decoding(char_pair, kwargs, needle) -> None:
    target, _, tok = char_pair
    dec = Decoder(target, tok, CONFIGS["ar"])
    with pytest.raises(UserError, match=needle):
        dec.stream("hello", **kwargs)


def test_routed_stream_names_its_configuration(tiny, one_thread) -> None:  # noqa: F811 (the fixture)
    target, draft, base = tiny
    dec = runtime.load(routed([AR, LOOKUP], BY_LENGTH, base), model=target, draft=draft)
    for prompt, name in (("short", "plain"), ("a much longer prompt, more than twenty", "lookup")):
        ref = dec.generate(prompt, max_new_tokens=20, chat="off")
        pieces, end = collect(dec.stream(prompt, max_new_tokens=20, chat="off"))
        assert end.result.stats.routed_to == ref.stats.routed_to == name
        assert "".join(pieces) == ref.text
