"""viasd-tune: search and serve VIA-SD routing profiles (three-tier speculative decoding)."""

__version__ = "0.1.0"
