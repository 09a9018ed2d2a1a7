"""A live ``viasd-tune serve`` on loopback for the server tests: tiny models saved to disk, the server started as
a subprocess on a free port (``--port 0``; it prints the port it got), its log kept in a file."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx2 as httpx
from conftest import noisy_copy, tiny_model

ROOT = Path(__file__).resolve().parents[1]
CONTEXT = 1024
# Letters, digits, space and Greek: every character is a letter or number to transformers' TextStreamer, so
# text streams out round by round instead of waiting for the next space.
CHARS = [chr(c) for c in (*range(48, 58), *range(65, 91), *range(97, 123))] + [" "]
CHARS += [chr(c) for c in range(0x3B1, 0x3CA)] + [chr(c) for c in range(0x391, 0x3A2)]
START_TIMEOUT_S = 300  # the machine running the tests may be busy: importing torch alone can take a minute
# The decode flags of the test server: VIA-SD with recheck, whose slim tier settles tokens that a later full
# pass may replace, so only verified text may be streamed.
DECODE_FLAGS = [
    "--mode",
    "viasd",
    "--drafter",
    "model",
    "--gamma",
    "4",
    "--skip-attn",
    "1",
    "--skip-mlp",
    "2",
]
DECODE_FLAGS += [
    "--tau-accept",
    "0.05",
    "--tau-escalate",
    "3",
    "--recheck",
    "--dtype",
    "float32",
    "--device",
    "cpu",
]


def letters_tokenizer():
    """A character tokenizer without an end-of-sequence token (so every answer runs to max_tokens), with a chat
    template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "<unk>": 2, **{c: i + 3 for i, c in enumerate(CHARS)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    backend.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>", bos_token="<s>"
    )
    tok.chat_template = (
        "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}assistant {% endif %}"
    )
    return tok


def save_models(root: Path) -> tuple[str, str]:
    """A tiny Llama target and a draft close to it, with a 1024-token context and no EOS, as model folders."""
    tok = letters_tokenizer()
    target = tiny_model("llama", seed=0, layers=4, vocab=len(tok))
    paths = []
    for name, model in (("target", target), ("draft", noisy_copy(target, 0.1, seed=1))):
        model.config.max_position_embeddings = CONTEXT
        model.config.eos_token_id = model.generation_config.eos_token_id = None
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
        paths.append(str(root / name))
    return paths[0], paths[1]


class Server:
    """``viasd-tune serve ARGS --port 0`` in a subprocess, one torch thread, output in ``log_path``."""

    def __init__(self, args: list[str], log_path: Path, env: dict | None = None):
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 (closed in stop())
        child_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **(env or {})}
        cmd = [sys.executable, "-m", "viasd_tune.cli", "serve", *args, "--port", "0"]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=child_env, cwd=ROOT)
        self.url = self._wait_ready()

    def _wait_ready(self) -> str:
        deadline = time.monotonic() + START_TIMEOUT_S
        url = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.log()}")
            if url is None:
                m = re.search(r"serving .* at (http://127\.0\.0\.1:\d+)/v1", self.log())
                url = m.group(1) if m else None
            if url is not None:
                try:
                    if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                        return url
                except httpx.TransportError:
                    pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"the server did not start within {START_TIMEOUT_S} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def health(self) -> dict:
        return httpx.get(f"{self.url}/health", timeout=10).json()

    def wait_health(self, pred, timeout_s: float = 120) -> dict:
        """Poll /health until ``pred(health)``; fail after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            h = self.health()
            if pred(h):
                return h
            time.sleep(0.1)
        raise AssertionError(f"/health never satisfied the condition; last {h}")

    def terminate(self) -> None:
        self.proc.send_signal(signal.SIGTERM)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
