"""Prompts for measuring speculative decoding (`swiftkv bench engine --speculative`): two kinds that sit at the two
ends of what n-gram and suffix proposers can draft from.

    quote  a document, then a question whose answer quotes it: the output copies spans of the prompt, as RAG
           answers with citations do, so drafts looked up in the prompt are often right
    chat   an open question with no document: little in the prompt to copy

The document is a product catalogue generated from a seed (one line per item: name, material, city, price), and
the question asks for the lines of the items shipping from one city, word for word; or, with `text`, consecutive
lines of real text (`swiftkv data prepare` output, any file `swiftkv_core.data.load_records` reads) and a request
to quote its key sentences. Prompts are token ids rendered by the caller (`render`: chat messages -> ids, the
model's chat template), so a quote prompt fills `prompt_tokens` in the model's own tokens. The same seed gives the
same prompts; different seeds give different documents and questions (no cache of earlier answers helps).
"""

from __future__ import annotations

import functools
import random
from pathlib import Path
from typing import Callable

KINDS = ("quote", "chat")

Render = Callable[[list[dict]], list[int]]

_ADJECTIVES = ("Harbor", "Summit", "Cedar", "Falcon", "Meadow", "Granite", "Orchid", "Copper", "Willow", "Aurora",
               "Maple", "Quartz", "Juniper", "Beacon", "Lantern", "Prairie", "Coral", "Tundra", "Ember", "Glacier")
_THINGS = ("desk lamp", "kettle", "backpack", "bookshelf", "rain jacket", "espresso grinder", "bicycle bell",
           "wall clock", "cutting board", "hiking boot", "tea set", "office chair", "camping stove", "table fan",
           "picture frame", "garden hose", "water bottle", "reading chair", "toolbox", "umbrella stand")
_MATERIALS = ("brushed steel", "oak", "recycled plastic", "cast iron", "bamboo", "walnut", "aluminium", "ceramic",
              "waxed canvas", "glass", "birch plywood", "copper")
_CITIES = ("Lyon", "Porto", "Gdansk", "Utrecht", "Bologna", "Graz", "Tampere", "Valencia", "Leipzig", "Brno")
_COLOURS = ("matte black", "forest green", "sand", "navy blue", "brick red", "off-white", "slate grey", "mustard")

_CHAT_OPENINGS = (
    "Write a short poem about {topic}.",
    "Give me three practical tips for {activity}.",
    "Tell me a short story about a {character} who {plot}.",
    "What would you pack for a weekend of {activity}, and why?",
    "Explain to a ten-year-old why {topic} matters.",
    "Plan a relaxed Saturday around {activity} for two friends.",
    "Describe {topic} as if you were a tour guide seeing it for the first time.",
    "Invent a recipe inspired by {topic} and describe how it tastes.",
)
_TOPICS = ("autumn rain", "a city at night", "the first day of spring", "an old lighthouse", "the northern lights",
           "a busy train station", "the sound of the sea", "a mountain village", "a library at closing time",
           "a summer thunderstorm")
_ACTIVITIES = ("learning to bake bread", "hiking in the hills", "starting a vegetable garden", "painting with watercolours",
               "learning the guitar", "running a first 10 km race", "sketching people in cafes", "sea kayaking")
_CHARACTERS = ("retired clockmaker", "curious fox", "young astronaut", "shy baker", "travelling musician",
               "lighthouse keeper", "street magician", "forgetful wizard")
_PLOTS = ("finds a map in a library book", "misses the last train home", "befriends a talking crow",
          "wins a contest by accident", "loses a key on the first day of winter", "opens a shop on a bridge")


def catalogue_line(rng: random.Random, item: int) -> tuple[str, str]:
    """(a catalogue line, the city it ships from)."""
    city = rng.choice(_CITIES)
    line = (f"Item {item}: the {rng.choice(_ADJECTIVES)} {rng.choice(_THINGS)}, made of {rng.choice(_MATERIALS)} in "
            f"{rng.choice(_COLOURS)}, ships from {city} within {rng.randint(1, 9)} days and costs {rng.randint(8, 400)} euros.")
    return line, city


def _fit(lines: list[str], wrap: Callable[[list[str]], list[dict]], render: Render, prompt_tokens: int) -> tuple[int, list[int]]:
    """The most leading `lines` whose wrapped prompt renders to at most `prompt_tokens` ids: (how many, the ids)."""
    lo, hi = 1, len(lines)
    best = None
    while lo <= hi:  # rendered length grows with the number of lines
        mid = (lo + hi) // 2
        ids = render(wrap(lines[:mid]))
        if len(ids) <= prompt_tokens:
            best, lo = (mid, ids), mid + 1
        else:
            hi = mid - 1
    if best is None:
        raise ValueError(f"a quote prompt of {prompt_tokens} tokens cannot hold one line of its document and the "
                         "question: raise the prompt length")
    return best


@functools.lru_cache(maxsize=4)  # read once for every round and batch
def _text_lines(text: str) -> list[str]:
    from .data import load_records

    lines: list[str] = []
    for rec in load_records(text):
        body = rec.get("text") or "\n".join(m["content"] for m in rec.get("messages", []))
        lines += [ln.strip() for ln in body.splitlines() if len(ln.split()) >= 4]
    if len(lines) < 8:
        raise ValueError(f"{text}: fewer than 8 lines of text to quote from")
    return lines


def quote_prompts(n: int, prompt_tokens: int, render: Render, seed: int, text: str | Path | None = None) -> list[list[int]]:
    """`n` quote prompts of at most `prompt_tokens` ids each (as close to it as whole lines allow)."""
    rng = random.Random(f"quote-{seed}")
    source = _text_lines(str(text)) if text is not None else None
    out = []
    for _ in range(n):
        if source is None:
            # more lines than any context holds: the fit keeps the leading ones
            items = [catalogue_line(rng, 1000 + i) for i in range(max(8, prompt_tokens // 20))]
            lines = [line for line, _ in items]
            # the first item's city: one the kept lines always mention (about one line in ten matches it)
            question = (f"Which items ship from {items[0][1]}? Answer by quoting the catalogue line of each of them "
                        "word for word, one per line, in the order they appear.")

            def wrap(doc: list[str], question: str = question) -> list[dict]:
                return [{"role": "user", "content": "Catalogue:\n" + "\n".join(doc) + "\n\n" + question}]
        else:
            start = rng.randrange(len(source))
            lines = (source[start:] + source[:start])[: max(8, prompt_tokens // 8)]

            def wrap(doc: list[str]) -> list[dict]:
                return [{"role": "user", "content": "\n".join(doc) + "\n\nQuote, word for word, the sentences of the text "
                         "above that matter most to a reader, one per line, in the order they appear."}]

        out.append(_fit(lines, wrap, render, prompt_tokens)[1])
    return out


def chat_prompts(n: int, render: Render, seed: int) -> list[list[int]]:
    """`n` open chat prompts: a short request with nothing in it for the answer to copy."""
    rng = random.Random(f"chat-{seed}")
    out = []
    for _ in range(n):
        content = rng.choice(_CHAT_OPENINGS).format(topic=rng.choice(_TOPICS), activity=rng.choice(_ACTIVITIES),
                                                    character=rng.choice(_CHARACTERS), plot=rng.choice(_PLOTS))
        out.append(render([{"role": "user", "content": content}]))
    return out


def prompts(kind: str, n: int, prompt_tokens: int, render: Render, seed: int, text: str | Path | None = None) -> list[list[int]]:
    if kind == "quote":
        return quote_prompts(n, prompt_tokens, render, seed, text)
    if kind == "chat":
        return chat_prompts(n, render, seed)
    raise ValueError(f"unknown prompt kind {kind!r}; choose one of {', '.join(KINDS)}")


def renderer(tokenizer) -> Render:
    """Chat messages -> prompt ids with the tokenizer's chat template (the plain text of the messages where the
    tokenizer has none)."""
    if getattr(tokenizer, "chat_template", None):
        def render(messages: list[dict]) -> list[int]:
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    else:
        def render(messages: list[dict]) -> list[int]:
            return tokenizer("\n\n".join(m["content"] for m in messages))["input_ids"]
    return render
