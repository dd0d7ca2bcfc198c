"""Load-test workloads cut from real text: what a request looks like (prompt and output lengths) and when it
arrives (Poisson), reproducible from a seed.

Prompts are windows of the offline corpora `swiftkv data prepare` writes (data/mix/heldout.jsonl by
default), tokenized with the served model's tokenizer, so prompt lengths are counted in the model's own
tokens and the text is what a user would send, not random token ids. Shapes:

    rag    10:1   prompt 1,000-2,000 tokens, output 100-200 (a document and a question about it)
    chat    1:1   prompt   150-300,          output 150-300
    gen    1:10   prompt    30-60,           output 300-600
    mixed         70% rag, 20% chat, 10% gen, drawn per request

`scale` multiplies every length target (at least 1 token), so the same shapes fit tiny models with a short
context (scale 0.1: rag is 100-200 prompt and 10-20 output tokens).

`fixed` is the other kind of workload: every prompt exactly N tokens of real text with no instruction, every
output M tokens, arriving as a Poisson process or at a constant rate. It is what a client with synthetic
fixed-length data (guidellm's synthetic_text, `vllm bench serve --dataset-name random`) sends, so the two
can be compared on one server (loadtest.crosscheck).
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from pathlib import Path

SHAPES: dict[str, dict] = {
    "rag": {"prompt": (1000, 2000), "output": (100, 200),
            "instruction": "Answer from the text above: what is it about, and what are its main points?"},
    "chat": {"prompt": (150, 300), "output": (150, 300),
             "instruction": "Reply to the message above."},
    "gen": {"prompt": (30, 60), "output": (300, 600),
            "instruction": "Write a long, detailed continuation of the text above."},
}
MIXES: dict[str, dict[str, float]] = {"rag": {"rag": 1.0}, "chat": {"chat": 1.0}, "gen": {"gen": 1.0},
                                      "mixed": {"rag": 0.7, "chat": 0.2, "gen": 0.1}}
WORKLOADS = tuple(MIXES)


class WorkloadError(ValueError):
    """A workload that cannot be built (unknown name, bad bounds, not enough text); the message says why."""


@dataclass(frozen=True)
class Request:
    index: int
    kind: str  # rag | chat | gen
    arrival_s: float  # seconds after the start of the run
    document: str  # the text cut from the corpus
    document_tokens: int  # its length in the model's tokens
    max_tokens: int  # output tokens asked for (sent with ignore_eos, so generated in full)
    instruction: str

    def messages(self) -> list[dict]:
        # no instruction (fixed-length requests): the message is the document alone, so it is exactly its tokens
        content = f"{self.document}\n\n{self.instruction}" if self.instruction else self.document
        return [{"role": "user", "content": content}]

    def as_dict(self) -> dict:
        return asdict(self)


def scaled(bounds: tuple[int, int], scale: float) -> tuple[int, int]:
    lo, hi = (max(1, round(b * scale)) for b in bounds)
    return lo, max(lo, hi)


def token_streams(text_path: str | Path, tokenizer) -> dict[str, list[int]]:
    """source -> its records' tokens joined in file order (records without a source share one stream)."""
    from swiftkv_core.data import load_records

    streams: dict[str, list[int]] = {}
    for rec in load_records(text_path):
        body = rec.get("text") or "\n\n".join(m["content"] for m in rec.get("messages", []))
        if body.strip():
            streams.setdefault(str(rec.get("source", "")), []).extend(
                tokenizer(body.strip() + "\n\n", add_special_tokens=False)["input_ids"])
    if not streams:
        raise WorkloadError(f"{text_path} holds no text")
    return streams


def word_start(stream: list[int], start: int, length: int, tokenizer, search: int = 32) -> int:
    """The first position at or after `start` (within `search` tokens, window still fitting) whose token
    begins a word, so a prompt does not open in the middle of one."""
    for i in range(start, min(start + search, len(stream) - length)):
        if tokenizer.decode(stream[i : i + 1])[:1].isspace():
            return i + 1 if tokenizer.decode(stream[i : i + 1]).strip() == "" else i
    return start


def generate(workload: str, text_path: str | Path, tokenizer, rate: float, count: int, duration_s: float | None = None,
             seed: int = 0, scale: float = 1.0) -> list[Request]:
    """Up to `count` requests arriving as a Poisson process of `rate` requests/s, none later than `duration_s`.

    The same seed gives the same requests (kinds, texts, lengths, arrival times) for any rate's arrival
    pattern scaled accordingly: the texts and lengths do not depend on the rate."""
    if workload not in MIXES:
        raise WorkloadError(f"workload: unknown {workload!r}; choose one of {', '.join(WORKLOADS)}")
    if rate <= 0 or count < 1 or scale <= 0 or (duration_s is not None and duration_s <= 0):
        raise WorkloadError(f"rate ({rate}), count ({count}), scale ({scale}) and duration ({duration_s}) must be positive")
    streams = token_streams(text_path, tokenizer)
    sources = sorted(streams)
    shape_rng, time_rng = random.Random(seed), random.Random(seed + 1)
    kinds, weights = zip(*MIXES[workload].items())
    out: list[Request] = []
    t = 0.0
    for i in range(count):
        t += time_rng.expovariate(rate)
        if duration_s is not None and t > duration_s:
            break
        kind = shape_rng.choices(kinds, weights)[0]
        shape = SHAPES[kind]
        n_prompt = shape_rng.randint(*scaled(shape["prompt"], scale))
        n_out = shape_rng.randint(*scaled(shape["output"], scale))
        fitting = [s for s in sources if len(streams[s]) > n_prompt]
        if not fitting:
            raise WorkloadError(f"{text_path}: no source holds {n_prompt} tokens for a {kind} prompt")
        src = fitting[shape_rng.randrange(len(fitting))]
        start = word_start(streams[src], shape_rng.randrange(len(streams[src]) - n_prompt), n_prompt, tokenizer)
        end = start + n_prompt
        for _ in range(4):  # stripped and re-encoded, a window can come out a few tokens short: widen it
            doc = tokenizer.decode(streams[src][start:end]).strip()
            doc_tokens = len(tokenizer(doc, add_special_tokens=False)["input_ids"])
            if doc_tokens >= n_prompt or end >= len(streams[src]):
                break
            end = min(len(streams[src]), end + n_prompt - doc_tokens)
        out.append(Request(i, kind, round(t, 6), doc, doc_tokens, n_out, shape["instruction"]))
    return out


ARRIVALS = ("poisson", "constant")


def fixed(text_path: str | Path, tokenizer, rate: float, count: int, prompt_tokens: int, output_tokens: int,
          seed: int = 0, arrivals: str = "poisson") -> list[Request]:
    """`count` requests of exactly `prompt_tokens` tokens of corpus text (counted as the document re-encodes,
    without special tokens) and `output_tokens` output tokens. Arrivals: a Poisson process of `rate`, or
    constant, request i at (i + 1) / rate (as guidellm's constant profile: the first one interval after the start)."""
    if arrivals not in ARRIVALS:
        raise WorkloadError(f"arrivals: unknown {arrivals!r}; choose one of {', '.join(ARRIVALS)}")
    if rate <= 0 or count < 1 or prompt_tokens < 1 or output_tokens < 1:
        raise WorkloadError(f"rate ({rate}), count ({count}), prompt_tokens ({prompt_tokens}) and output_tokens ({output_tokens}) must be positive")
    streams = token_streams(text_path, tokenizer)
    fitting = sorted(s for s in streams if len(streams[s]) > prompt_tokens + 64)
    if not fitting:
        raise WorkloadError(f"{text_path}: no source holds {prompt_tokens} tokens for a prompt")
    rng, time_rng = random.Random(seed), random.Random(seed + 1)
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    out: list[Request] = []
    t = 0.0
    for i in range(count):
        t = t + time_rng.expovariate(rate) if arrivals == "poisson" else (i + 1) / rate
        for _ in range(20):  # a window whose text re-encodes to exactly prompt_tokens tokens (nearly always the first)
            stream = streams[fitting[rng.randrange(len(fitting))]]
            start = word_start(stream, rng.randrange(len(stream) - prompt_tokens - 64), prompt_tokens + 64, tokenizer)
            ids = encode(tokenizer.decode(stream[start : start + prompt_tokens + 64]).strip())[:prompt_tokens]
            doc = tokenizer.decode(ids)
            if len(encode(doc)) == prompt_tokens and doc.strip() == doc:
                break
        else:
            raise WorkloadError(f"{text_path}: no window of text re-encodes to exactly {prompt_tokens} tokens")
        out.append(Request(i, "fixed", round(t, 6), doc, prompt_tokens, output_tokens, ""))
    return out


def summary(requests: list[Request]) -> dict:
    """Counts and mean lengths per kind, and the prompt:output ratio of the whole set."""
    by_kind: dict[str, dict] = {}
    for r in requests:
        k = by_kind.setdefault(r.kind, {"requests": 0, "prompt_tokens": 0, "output_tokens": 0})
        k["requests"] += 1
        k["prompt_tokens"] += r.document_tokens
        k["output_tokens"] += r.max_tokens
    for k in by_kind.values():
        k["mean_prompt_tokens"] = round(k.pop("prompt_tokens") / k["requests"], 1)
        k["mean_output_tokens"] = round(k.pop("output_tokens") / k["requests"], 1)
    total_p = sum(r.document_tokens for r in requests)
    total_o = sum(r.max_tokens for r in requests)
    return {"requests": len(requests), "kinds": by_kind, "prompt_to_output": round(total_p / max(total_o, 1), 2),
            "span_s": requests[-1].arrival_s if requests else 0.0}
