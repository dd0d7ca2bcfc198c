"""Training data shaped like the traffic a SwiftKV pool serves: the teacher's own answers to prompt-heavy requests.

The pool gets long prompts (a document, then a request about it) and short answers. Distilling on packed
passages teaches the student to continue text; distilling on these records teaches it to read a long prompt
through its SingleInputKV layers and answer as the teacher does. Documents are cut from the training text
(never the held-out files), each followed by one of REQUESTS (worded apart from the evaluation's), and the
teacher answers through vLLM, greedy by default, so the data is what the base pool would have served.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from .data import DataError

REQUESTS = (
    "Summarize the passage above in two or three sentences.",
    "Give a one-sentence summary of the passage above.",
    "List the three most important points of the passage above.",
    "What is the passage above about? Explain briefly.",
    "Write a short title for the passage above, then explain your choice in one sentence.",
    "Which names, terms or commands does the passage above mention? List them.",
    "Explain the passage above to a beginner in a few sentences.",
    "What question does the passage above answer? State the question and its answer.",
)


def answer_records(base: str | Path, text: str | Path, num: int, min_tokens: int, max_tokens: int, answer_tokens: int,
                   temperature: float = 0.0, seed: int = 0, engine_args: dict | None = None, llm=None) -> list[dict]:
    """`num` chat records {"messages": [user: document + request, assistant: the teacher's answer], "source"}. `llm`: a
    running vLLM LLM of `base` to answer with (its own settings); None starts one."""
    from transformers import AutoTokenizer

    from .evaluate import long_documents
    from .hardware import engine_args_for_machine, vllm_on_cpu

    tokenizer = AutoTokenizer.from_pretrained(str(base))
    docs = long_documents(text, tokenizer, num, min_tokens, max_tokens)
    if not docs:
        raise DataError(f"{text} holds no document of {min_tokens}-{max_tokens} tokens")
    rng = random.Random(seed)
    messages = [[{"role": "user", "content": f"{doc}\n\n{rng.choice(REQUESTS)}"}] for doc in docs]

    from vllm import LLM, SamplingParams

    if llm is None:
        # A fixed KV budget: on CPUs vLLM would otherwise reserve a share of all memory (gpu_memory_utilization).
        args = engine_args_for_machine({"dtype": "auto", "max_model_len": max_tokens + 64 + answer_tokens, "enforce_eager": True,
                                        "kv_cache_memory_bytes": 256 << 20} | (engine_args or {}), on_cpu=vllm_on_cpu())
        llm = LLM(model=str(base), seed=seed, **args)
    params = SamplingParams(temperature=temperature, max_tokens=answer_tokens, seed=seed)
    outputs = llm.chat(messages, params, use_tqdm=True)
    records = []
    for msgs, out in zip(messages, outputs):
        answer = out.outputs[0].text.strip()
        if answer:  # an empty answer teaches nothing
            records.append({"messages": msgs + [{"role": "assistant", "content": answer}], "source": "teacher-answers"})
    return records


def write_records(records: list[dict], out: str | Path) -> Path:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
    tmp.replace(out)
    return out
