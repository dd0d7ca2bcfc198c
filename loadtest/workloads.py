"""Load-test workloads cut from real text: what a request looks like (prompt and output lengths) and when it
arrives (Poisson), reproducible from a seed.

Prompts are windows of the offline corpora `swiftkv data prepare` writes (data/mix/heldout.jsonl by
default), tokenized with the served model's tokenizer, so prompt lengths are counted in the model's own
tokens and the text is what a user would send, not random token ids. Shapes:

    rag    10:1   prompt 1,000-2,000 tokens, output 100-200 (a document and a question about it)
    chat    1:1   prompt   150-300,          output 150-300
    gen    1:10   prompt    30-60,           output 300-600
    mixed         70% rag, 20% chat, 10% gen, drawn per request
    rag-shared    documents of 1,000-2,000 tokens, each asked 4 different questions (output 100-200): about
                  count/4 documents, the (document, question) pairs shuffled, so the questions about one document
                  arrive spread out and share its prefix (the document comes first) in the engines' prefix cache
    chat-multiturn
                  conversations of 6 turns, several at once: a user message of 150-300 tokens, then 100-250 per
                  later turn, output 100-200 per turn; each prompt is the whole conversation so far, so the history
                  grows to about 2,000 tokens. Closed loop: a turn is sent only after the previous turn's answer has
                  arrived and a think time (1 s) has passed, and carries that answer's text as it came (the driver,
                  loadtest.platform_bench.drive, builds its messages), so its prompt begins with what the engine has
                  just cached. Conversations start as a Poisson process of rate/6 and a conversation's turns are
                  scheduled a Poisson gap of the same mean apart (sent at that time, or later if the previous answer
                  is not in yet), so the offered load is `rate` requests/s as for the others; `count` requests in
                  all (count/6 conversations), `duration_s` bounds the conversations' starts

`scale` multiplies every length target (at least 1 token) and the think time, so the same shapes fit tiny models with a short
context (scale 0.1: rag is 100-200 prompt and 10-20 output tokens).

`fixed` is the other kind of workload: every prompt exactly N tokens of real text with no instruction, every
output M tokens, arriving as a Poisson process or at a constant rate. It is what a client with synthetic
fixed-length data (guidellm's synthetic_text, `vllm bench serve --dataset-name random`) sends, so the two
can be compared on one server (loadtest.crosscheck).
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, replace
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
RAG_SHARED = {"prompt": (1000, 2000), "output": (100, 200),
              "questions": ("What is the main point of the text above?",
                            "List the names and numbers the text above mentions.",
                            "Summarize the text above in three sentences.",
                            "What would a reader ask next about the text above?")}
CHAT_MULTITURN = {"turns": 6, "first": (150, 300), "later": (100, 250), "output": (100, 200), "think_s": 1.0,
                  "instruction": SHAPES["chat"]["instruction"]}
WORKLOADS = (*MIXES, "rag-shared", "chat-multiturn")


class WorkloadError(ValueError):
    """A workload that cannot be built (unknown name, bad bounds, not enough text); the message says why."""


@dataclass(frozen=True)
class Request:
    index: int
    kind: str  # rag | chat | gen | fixed | rag-shared | chat-multiturn
    arrival_s: float  # seconds after the start of the run (a later turn: at the earliest)
    document: str  # the text cut from the corpus
    document_tokens: int  # its length in the model's tokens
    max_tokens: int  # output tokens asked for (sent with ignore_eos, so generated in full)
    instruction: str
    group: int | None = None  # the document (rag-shared) or conversation (chat-multiturn) it belongs to
    # chat-multiturn: its turn (from 1), sent after the previous turn's answer and `think_s` more, its messages the
    # conversation so far; 0: sent at its arrival time, on its own
    turn: int = 0
    think_s: float = 0.0
    history_tokens: int = 0  # the earlier turns in its prompt: their user messages and answers (max_tokens each)

    def messages(self) -> list[dict]:
        """Its own user message (a later turn's history is added by whoever sends it)."""
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


def window(streams: dict[str, list[int]], n: int, rng: random.Random, tokenizer, what: str) -> tuple[str, int]:
    """A window of about `n` tokens of corpus text from a source drawn with `rng`, starting at a word -> (the text,
    its length re-encoded). `what` names it in the error when no source is long enough."""
    fitting = [s for s in sorted(streams) if len(streams[s]) > n]
    if not fitting:
        raise WorkloadError(f"no source holds {n} tokens for {what}")
    stream = streams[fitting[rng.randrange(len(fitting))]]
    start = word_start(stream, rng.randrange(len(stream) - n), n, tokenizer)
    end = start + n
    for _ in range(4):  # stripped and re-encoded, a window can come out a few tokens short: widen it
        doc = tokenizer.decode(stream[start:end]).strip()
        doc_tokens = len(tokenizer(doc, add_special_tokens=False)["input_ids"])
        if doc_tokens >= n or end >= len(stream):
            break
        end = min(len(stream), end + n - doc_tokens)
    return doc, doc_tokens


# A request measured after another with the same text finds it in the engines' prefix cache and flatters the run, so
# the warm-up and each further rate of a run draw texts of their own from seeds derived from the run's (generate uses a
# seed and the next one).
WARMUP_SEED_OFFSET = 1000
RATE_SEED_STEP = 2000


def warmup_seed(seed: int) -> int:
    return seed + WARMUP_SEED_OFFSET


def rate_seed(seed: int, k: int) -> int:
    """The seed of a run's k-th rate (from 0, in ascending order): the first rate draws with the run's own seed."""
    return seed + RATE_SEED_STEP * k


def generate(workload: str, text_path: str | Path, tokenizer, rate: float, count: int, duration_s: float | None = None,
             seed: int = 0, scale: float = 1.0) -> list[Request]:
    """Up to `count` requests arriving as a Poisson process of `rate` requests/s, none later than `duration_s`.

    The same seed gives the same requests (kinds, texts, lengths, arrival times) for any rate's arrival
    pattern scaled accordingly: the texts and lengths do not depend on the rate. rag-shared and chat-multiturn:
    see the module's table."""
    if workload not in WORKLOADS:
        raise WorkloadError(f"workload: unknown {workload!r}; choose one of {', '.join(WORKLOADS)}")
    if rate <= 0 or count < 1 or scale <= 0 or (duration_s is not None and duration_s <= 0):
        raise WorkloadError(f"rate ({rate}), count ({count}), scale ({scale}) and duration ({duration_s}) must be positive")
    streams = token_streams(text_path, tokenizer)
    shape_rng, time_rng = random.Random(seed), random.Random(seed + 1)

    def cut(n: int, kind: str) -> tuple[str, int]:
        try:
            return window(streams, n, shape_rng, tokenizer, f"a {kind} prompt")
        except WorkloadError as e:
            raise WorkloadError(f"{text_path}: {e}") from None

    if workload == "rag-shared":
        return rag_shared(cut, shape_rng, time_rng, rate, count, duration_s, scale)
    if workload == "chat-multiturn":
        return chat_multiturn(cut, shape_rng, time_rng, rate, count, duration_s, scale)
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
        doc, doc_tokens = cut(n_prompt, kind)
        out.append(Request(i, kind, round(t, 6), doc, doc_tokens, n_out, shape["instruction"]))
    return out


def rag_shared(cut, rng: random.Random, time_rng: random.Random, rate: float, count: int, duration_s: float | None,
               scale: float) -> list[Request]:
    """`count` questions about ceil(count/4) documents (each asked count // documents of the questions at least),
    in an order shuffled with `rng`, arriving as a Poisson process of `rate`."""
    questions = RAG_SHARED["questions"]
    n_docs = -(-count // len(questions))
    docs = [cut(rng.randint(*scaled(RAG_SHARED["prompt"], scale)), "rag-shared") for _ in range(n_docs)]
    pairs = [(i % n_docs, i // n_docs) for i in range(count)]
    rng.shuffle(pairs)
    outs = [rng.randint(*scaled(RAG_SHARED["output"], scale)) for _ in pairs]
    out: list[Request] = []
    t = 0.0
    for i, ((d, q), n_out) in enumerate(zip(pairs, outs)):
        t += time_rng.expovariate(rate)
        if duration_s is not None and t > duration_s:
            break
        out.append(Request(i, "rag-shared", round(t, 6), *docs[d], n_out, questions[q], group=d))
    return out


def chat_multiturn(cut, rng: random.Random, time_rng: random.Random, rate: float, count: int, duration_s: float | None,
                   scale: float) -> list[Request]:
    """`count` turns of ceil(count/6) conversations (the last one shorter when 6 does not divide `count`), ordered by
    the time each turn is scheduled for: conversations start as a Poisson process of rate/6 and a conversation's turns
    follow each other at gaps of the same distribution, so `rate` requests/s are offered with about 6 conversations
    under way."""
    c = CHAT_MULTITURN
    conversation_rate = rate / c["turns"]
    out: list[Request] = []
    start = 0.0
    for conv in range(-(-count // c["turns"])):
        start += time_rng.expovariate(conversation_rate)
        if duration_s is not None and start > duration_s:
            break
        t, history = start, 0
        for turn in range(1, min(c["turns"], count - conv * c["turns"]) + 1):
            if turn > 1:
                t += time_rng.expovariate(conversation_rate)
            n_user = rng.randint(*scaled(c["first" if turn == 1 else "later"], scale))
            n_out = rng.randint(*scaled(c["output"], scale))
            doc, doc_tokens = cut(n_user, "chat-multiturn")
            out.append(Request(0, "chat-multiturn", round(t, 6), doc, doc_tokens, n_out, c["instruction"], group=conv, turn=turn,
                               think_s=c["think_s"] * scale, history_tokens=history))
            history += doc_tokens + n_out
    out.sort(key=lambda r: r.arrival_s)
    return [replace(r, index=i) for i, r in enumerate(out)]


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
    """Counts and mean lengths per kind (a later turn's prompt counts its history), and the prompt:output ratio
    of the whole set."""
    by_kind: dict[str, dict] = {}
    for r in requests:
        k = by_kind.setdefault(r.kind, {"requests": 0, "prompt_tokens": 0, "output_tokens": 0})
        k["requests"] += 1
        k["prompt_tokens"] += r.document_tokens + r.history_tokens
        k["output_tokens"] += r.max_tokens
    for k in by_kind.values():
        k["mean_prompt_tokens"] = round(k.pop("prompt_tokens") / k["requests"], 1)
        k["mean_output_tokens"] = round(k.pop("output_tokens") / k["requests"], 1)
    total_p = sum(r.document_tokens + r.history_tokens for r in requests)
    total_o = sum(r.max_tokens for r in requests)
    return {"requests": len(requests), "kinds": by_kind, "prompt_to_output": round(total_p / max(total_o, 1), 2),
            "span_s": requests[-1].arrival_s if requests else 0.0}
