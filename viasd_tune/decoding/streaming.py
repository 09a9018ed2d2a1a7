"""Streaming one generation: text pieces as the rounds commit final tokens, then a :class:`StreamEnd`.

The generation runs in its own thread and reports each round through the engine's ``on_round`` hook; the caller
iterates in its thread and may stop it (a stop string, a client gone) at the end of the current round. Only
final tokens are decoded: with VIA-SD ``recheck`` a slim-settled token stays unsent until the full target has
verified it, so no sent text is ever taken back.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from transformers import TextStreamer

from ..errors import UserError
from .common import Result, RoundHook
from .common import Sequence as TokenSequence

MAX_STOPS = 4  # as the OpenAI API allows


@dataclass
class StreamEnd:
    """The last item a stream yields. ``result.text`` is all the text streamed (cut before a stop string) and
    ``result.token_ids`` the tokens decoded (with a stop string, up to the end of the round that reached it)."""

    result: Result
    finish_reason: str  # "stop": EOS or a stop string; "length": max_new_tokens; "cancelled": cancel()


def check_stop(stop) -> tuple[str, ...]:
    """``stop``: None, a string or a list of up to four non-empty strings."""
    stops = () if stop is None else (stop,) if isinstance(stop, str) else stop
    if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) and s for s in stops):
        raise UserError(f"stop must be a non-empty string or a list of them (got {stop!r})")
    if len(stops) > MAX_STOPS:
        raise UserError(f"stop takes at most {MAX_STOPS} strings (got {len(stops)})")
    return tuple(stops)


class _Pieces(TextStreamer):
    """transformers' ``TextStreamer`` (it holds back text the next token may still change: an unfinished
    multi-byte character, an unfinished word), collecting the released text instead of printing it."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer, skip_special_tokens=True)
        self.released: list[str] = []

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        if text:
            self.released.append(text)

    def held(self) -> str:
        """Decoded text not released yet."""
        if not self.token_cache:
            return ""
        return self.tokenizer.decode(self.token_cache, **self.decode_kwargs)[self.print_len :]


class _StopStrings:
    """Cuts the text before the first stop string, holding back a tail that may be the start of one."""

    def __init__(self, stops: Sequence[str]):
        self.stops, self.pending, self.hit = stops, "", False

    def feed(self, text: str, lookahead: str = "") -> str:
        """Add released ``text``; return what can be sent. ``lookahead``: decoded text not released yet, searched
        too, so a stop string ends decoding as soon as its tokens are final."""
        self.pending += text
        window = self.pending + lookahead
        found = [i for i in (window.find(s) for s in self.stops) if i >= 0]
        if found:
            self.hit, self.pending = True, ""
            return window[: min(found)]
        keep = max(
            (k for s in self.stops for k in range(1, len(s)) if self.pending.endswith(s[:k])), default=0
        )
        out, self.pending = self.pending[: len(self.pending) - keep], self.pending[len(self.pending) - keep :]
        return out

    def finish(self) -> str:
        out, self.pending = self.pending, ""
        return out


class TextStream:
    """Iterates a generation: ``str`` pieces, then one :class:`StreamEnd`. ``cancel()`` may be called from any
    thread; the generation stops at the end of its current round. ``close()`` cancels and waits for it.

    Detokenising and the stop-string check run in the generation thread, inside the round hook, so a stop string
    ends decoding in the very round that made its tokens final."""

    def __init__(
        self,
        run: Callable[[RoundHook], Result],
        tokenizer,
        eos: set[int],
        stop: Sequence[str] = (),
    ):
        self._pieces = _Pieces(tokenizer)
        self._stops = _StopStrings(stop)
        self._eos = eos
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._halt = threading.Event()
        self._cancelled = False
        self._sent: list[int] = []  # final tokens already handed to the detokenizer
        self._text: list[str] = []
        self._done = False
        self.end: StreamEnd | None = None  # set by the generation thread when it finishes
        self._thread = threading.Thread(target=self._work, args=(run,), name="viasd-generate", daemon=True)
        self._thread.start()

    # ----------------------------------------------------------------- generation thread

    def _work(self, run: Callable[[RoundHook], Result]) -> None:
        try:
            self.end = self._end(run(self._on_round))
            self._events.put(self.end)
        except BaseException as e:  # handed to the iterating thread, which raises it
            self._events.put(e)

    def _on_round(self, seq: TokenSequence, final: int) -> bool:
        if final > len(self._sent):
            self._emit(seq.emitted[len(self._sent) : final])
        return self._halt.is_set() or self._stops.hit

    def _emit(self, tokens: list[int], last: bool = False) -> None:
        self._sent += tokens
        if tokens:
            self._pieces.put(torch.tensor(tokens, dtype=torch.long))
        if last:
            self._pieces.end()
        released = "".join(self._pieces.released)
        self._pieces.released.clear()
        text = self._stops.feed(released, "" if last else self._pieces.held())
        if last and not self._stops.hit:
            text += self._stops.finish()
        if text:
            self._text.append(text)
            self._events.put(text)

    def _end(self, result: Result) -> StreamEnd:
        n = len(self._sent)
        if result.token_ids[:n] != self._sent:  # the engine's watermark promised these were final
            raise AssertionError("a token already streamed was rolled back; this is a bug in viasd-tune")
        if not self._stops.hit:
            self._emit(result.token_ids[n:], last=True)
        result.text = "".join(self._text)
        if self._stops.hit or (result.token_ids and result.token_ids[-1] in self._eos):
            reason = "stop"
        else:
            reason = "cancelled" if self._cancelled else "length"
        return StreamEnd(result, reason)

    # ----------------------------------------------------------------- iterating thread

    def cancel(self) -> None:
        """Stop the generation at the end of its current round (thread-safe; the stream then ends)."""
        self._cancelled = True
        self._halt.set()

    def close(self) -> None:
        """Cancel and wait until the generation thread has stopped touching the models."""
        self.cancel()
        self._thread.join()

    def __iter__(self) -> Iterator[str | StreamEnd]:
        return self

    def __next__(self) -> str | StreamEnd:
        if self._done:
            raise StopIteration
        item = self._events.get()
        if isinstance(item, BaseException):
            self._done = True
            raise item
        if isinstance(item, StreamEnd):
            self._done = True
            self._thread.join()
        return item
