"""``viasd-tune serve``: a decoder (a tuned profile or flags) behind the OpenAI HTTP API (see docs/serve.md)."""

from .app import create_app, listen, run

__all__ = ["create_app", "listen", "run"]
