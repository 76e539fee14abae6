"""Deterministic pseudo-text shared by the reference server and the load generator.

The server never echoes or stores the prompt: it only measures its length to
estimate a token count, and it "generates" pseudo-words drawn from a fixed list
with a seeded generator, so the same request seed always yields the same text.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator

# Rough rule of thumb for English with BPE tokenizers; good enough for a
# reference server whose job is realistic timing, not exact tokenization.
CHARS_PER_TOKEN = 4

# Chat templates wrap every message in role markers and separators.
CHAT_TOKENS_PER_MESSAGE = 4

_SYLLABLES = (
    "ka",
    "lo",
    "mi",
    "ren",
    "tas",
    "vu",
    "zel",
    "or",
    "pin",
    "dra",
    "so",
    "que",
    "bal",
    "nim",
    "tor",
    "ey",
    "fa",
    "gul",
    "hin",
    "ja",
)


def _build_vocabulary() -> tuple[str, ...]:
    """Two-syllable pseudo-words, each about one token long."""
    rng = random.Random(1234)
    words = {rng.choice(_SYLLABLES) + rng.choice(_SYLLABLES) for _ in range(400)}
    return tuple(sorted(words))


PSEUDO_WORDS = _build_vocabulary()


def estimate_tokens(text: str) -> int:
    """Deterministic token estimate for one piece of text (at least 1)."""
    return max(1, math.ceil(len(text) / CHARS_PER_TOKEN))


def generated_tokens(seed: int) -> Iterator[str]:
    """Endless stream of pseudo-word tokens; mostly space-prefixed like real BPE output."""
    rng = random.Random(seed)
    while True:
        word = rng.choice(PSEUDO_WORDS)
        yield word if rng.random() < 0.15 else " " + word


def pseudo_prompt(approx_tokens: int, rng: random.Random) -> str:
    """Prompt text whose estimated size is close to `approx_tokens` tokens."""
    target_chars = max(1, approx_tokens) * CHARS_PER_TOKEN
    words: list[str] = []
    length = 0
    while length < target_chars:
        word = rng.choice(PSEUDO_WORDS)
        words.append(word)
        length += len(word) + 1
    return " ".join(words)[:target_chars]
