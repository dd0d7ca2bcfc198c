"""`swiftkv eval`: how closely a SwiftKV student follows its teacher on held-out text.

Metrics, over every target position of the text packed into rows of `seq_len` tokens:
    top1_agreement   fraction of positions where student and teacher predict the same next token
    kl               mean KL(teacher || student) of the next-token distributions (temperature 1)
    ppl_teacher      perplexity of the teacher on the text
    ppl_student      perplexity of the student on the text
and on a prompt set (chat prompts built from the same text unless given), greedy decoding of
`gen_tokens` tokens by both:
    greedy_exact_match     fraction of prompts whose continuations are identical
    greedy_token_agreement mean fraction of positions equal before the first divergence

The teacher is a plain Llama folder or a SwiftKV folder (run with SwiftKV off); the student is a SwiftKV
folder (run with SwiftKV on). Both run in float32 unless `bf16` is set.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from .data import DataError, load_packed, load_records, loss_mask


class EvalError(ValueError):
    pass


def _load(path: str | Path):
    from .modeling import load_model

    p = Path(path)
    if not (p / "config.json").exists():
        raise EvalError(f"model folder {str(p)!r} does not exist or has no config.json")
    return load_model(str(p))


def default_prompts(text_path: str | Path, n: int, max_chars: int = 300) -> list[list[dict]]:
    """Chat prompts from the evaluation text: the user messages of chat records, else text openings."""
    prompts = []
    for rec in load_records(text_path):
        if "messages" in rec:
            users = [m for m in rec["messages"] if m["role"] != "assistant"]
            if users:
                prompts.append([{"role": users[0]["role"], "content": users[0]["content"][:max_chars]}])
        elif rec.get("text", "").strip():
            prompts.append([{"role": "user", "content": "Continue this text:\n\n" + rec["text"][:max_chars]}])
        if len(prompts) >= n:
            break
    return prompts


@torch.no_grad()
def evaluate(
    teacher: str | Path,
    student: str | Path,
    text: str | Path,
    seq_len: int = 512,
    max_tokens: int = 65536,
    num_prompts: int = 16,
    gen_tokens: int = 32,
    bf16: bool = False,
    threads: int | None = None,
) -> dict:
    from transformers import AutoTokenizer

    from .modeling import LlamaSwiftKVForCausalLM

    if threads:
        torch.set_num_threads(threads)
    if not Path(text).exists():
        raise DataError(f"evaluation text {str(text)!r} does not exist")
    t_model, s_model = _load(teacher), _load(student)
    if not isinstance(s_model, LlamaSwiftKVForCausalLM) or s_model.config.num_key_value_layers >= s_model.config.num_hidden_layers:
        raise EvalError(f"{student} is not a SwiftKV checkpoint (num_key_value_layers must be < num_hidden_layers)")
    if t_model.config.vocab_size != s_model.config.vocab_size:
        raise EvalError("teacher and student have different vocabularies")
    tokenizer = AutoTokenizer.from_pretrained(student)
    data = load_packed(text, tokenizer, seq_len, assistant_only=False, max_rows=max(1, max_tokens // seq_len))
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else torch.autocast("cpu", enabled=False)
    n = agree = kl_sum = nll_t = nll_s = 0.0
    t0 = time.perf_counter()
    for r in range(len(data)):
        ids = data.ids[r : r + 1]
        mask = loss_mask(data.target[r : r + 1])[0]
        labels = torch.roll(ids[0], -1)[mask]
        with ctx:
            t_logits = t_model(ids, swiftkv=False).logits[0][mask].float()
            s_logits = s_model(ids, swiftkv=True).logits[0][mask].float()
        log_t, log_s = F.log_softmax(t_logits, -1), F.log_softmax(s_logits, -1)
        agree += (t_logits.argmax(-1) == s_logits.argmax(-1)).sum().item()
        kl_sum += F.kl_div(log_s, log_t, reduction="none", log_target=True).sum().item()
        nll_t += F.nll_loss(log_t, labels, reduction="sum").item()
        nll_s += F.nll_loss(log_s, labels, reduction="sum").item()
        n += mask.sum().item()
    result = {
        "top1_agreement": agree / n,
        "kl": kl_sum / n,
        "ppl_teacher": math.exp(nll_t / n),
        "ppl_student": math.exp(nll_s / n),
        "tokens": int(n),
    }
    result["ppl_ratio"] = result["ppl_student"] / result["ppl_teacher"]
    if num_prompts > 0 and gen_tokens > 0:
        result.update(greedy_agreement(t_model, s_model, tokenizer, default_prompts(text, num_prompts), gen_tokens))
    result["seconds"] = round(time.perf_counter() - t0, 1)
    return result


@torch.no_grad()
def greedy_agreement(t_model, s_model, tokenizer, prompts: list[list[dict]], gen_tokens: int) -> dict:
    if not prompts:
        return {}
    exact = prefix = 0.0
    for messages in prompts:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        eos = tokenizer.eos_token_id
        a = t_model.greedy_generate(list(ids), gen_tokens, swiftkv=False, eos_token_id=eos)
        b = s_model.greedy_generate(list(ids), gen_tokens, swiftkv=True, eos_token_id=eos)
        exact += a == b
        same = 0
        for x, y in zip(a, b):
            if x != y:
                break
            same += 1
        prefix += same / max(len(a), 1)
    return {"greedy_exact_match": exact / len(prompts), "greedy_token_agreement": prefix / len(prompts), "greedy_prompts": len(prompts)}


def format_result(result: dict) -> str:
    return json.dumps(result, indent=2)
