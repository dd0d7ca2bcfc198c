"""`swiftkv eval`: how closely a SwiftKV student follows its teacher on held-out text.

Metrics, over every target position of the text packed into rows of `seq_len` tokens:
    top1_agreement   fraction of positions where student and teacher predict the same next token
    kl               mean KL(teacher || student) of the next-token distributions (temperature 1)
    ppl_teacher      perplexity of the teacher on the text
    ppl_student      perplexity of the student on the text
on short chat prompts built from the same text, greedy decoding of `gen_tokens` tokens by both:
    greedy_exact_match     fraction of prompts whose continuations are identical
    greedy_token_agreement mean fraction of the teacher's tokens before the first divergence
and, as SwiftKV traffic looks (long prompts, short answers), on `long_docs` documents of
`long_min_tokens`..`long_max_tokens` tokens cut from the same text, each followed by a request (a
one-sentence summary or a short question), the teacher answering greedily (`answer_tokens`, stop at EOS):
    long_teacher_forced_agreement  student's top-1 = the teacher's answer token, teacher-forced with the
                                   document as context (pooled over all answer tokens)
    long_rouge_l                   mean ROUGE-L F1 (over tokens) of the student's greedy answer against the teacher's
    long_exact_match               fraction of documents whose answers are identical

The teacher is a plain Llama folder or a SwiftKV folder (run with SwiftKV off); the student is a SwiftKV
folder (run with SwiftKV on). When the teacher's weights are the student's non-SwiftKV weights (the student
was distilled from it), one model serves both and the layers below l run once per text row. Everything
runs in float32 unless `bf16` is set; generation uses the reference model's KV cache.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from .data import DataError, load_packed, load_records, loss_mask


class EvalError(ValueError):
    pass


LONG_REQUESTS = (
    "Summarize the text above in one sentence.",
    "What is the main topic of the text above? Answer briefly.",
)
# Config fields that change what the shared layers compute; the rest (names, dtype, SwiftKV layout) do not.
_SHAPE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps", "rope_theta", "rope_scaling",
                 "rope_parameters", "attention_bias", "mlp_bias", "tie_word_embeddings")


def _load(path: str | Path):
    from .modeling_llama_swiftkv import load_model

    p = Path(path)
    if not (p / "config.json").exists():
        raise EvalError(f"model folder {str(p)!r} does not exist or has no config.json")
    return load_model(str(p))


def same_base_weights(teacher: str | Path, student: str | Path) -> bool:
    """Whether the teacher folder holds exactly the student's non-SwiftKV tensors (and the same shape config),
    compared tensor by tensor from the safetensors files without building a model."""
    from safetensors import safe_open
    from transformers import AutoConfig

    def tensors(folder: Path) -> dict[str, Path]:
        out = {}
        for f in sorted(folder.glob("*.safetensors")):
            with safe_open(f, "pt") as st:
                out.update({k: f for k in st.keys() if "swiftkv" not in k})
        return out

    t_dir, s_dir = Path(teacher), Path(student)
    t_cfg, s_cfg = AutoConfig.from_pretrained(t_dir), AutoConfig.from_pretrained(s_dir)
    if any(getattr(t_cfg, k, None) != getattr(s_cfg, k, None) for k in _SHAPE_FIELDS):
        return False
    t_files, s_files = tensors(t_dir), tensors(s_dir)
    if not t_files or set(t_files) != set(s_files):
        return False
    for name in t_files:
        with safe_open(t_files[name], "pt") as a, safe_open(s_files[name], "pt") as b:
            if not torch.equal(a.get_tensor(name).float(), b.get_tensor(name).float()):
                return False
    return True


def _chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


def _pair_logits(t_model, s_model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher and student logits of `ids`; one shared model runs the layers below l once for both."""
    if t_model is s_model:
        state = s_model.forward_lower(ids)
        return s_model.forward_upper(state, swiftkv=False).logits, s_model.forward_upper(state, swiftkv=True).logits
    return t_model(ids, swiftkv=False).logits, s_model(ids, swiftkv=True).logits


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


def long_documents(text_path: str | Path, tokenizer, n: int, min_tokens: int, max_tokens: int) -> list[str]:
    """Up to `n` documents cut from the evaluation text, lengths spread evenly over min..max tokens.

    Records of one source (the `source` field of prepared data) are joined in file order and cut into
    consecutive windows, taking sources in turn, so a document stays on one kind of text."""
    if not 0 < min_tokens <= max_tokens:
        raise EvalError(f"long documents need 0 < min tokens <= max tokens, got {min_tokens}..{max_tokens}")
    streams: dict[str, list[int]] = {}
    for rec in load_records(text_path):
        body = rec.get("text") or "\n\n".join(m["content"] for m in rec.get("messages", []))
        if body.strip():
            streams.setdefault(str(rec.get("source", "")), []).extend(
                tokenizer(body.strip() + "\n\n", add_special_tokens=False)["input_ids"])
    sources, cursor, docs = sorted(streams), dict.fromkeys(streams, 0), []
    while len(docs) < n and sources:
        length = min_tokens + (max_tokens - min_tokens) * len(docs) // max(n - 1, 1)
        src = sources[len(docs) % len(sources)]
        if cursor[src] + length > len(streams[src]):
            sources.remove(src)  # this source is used up; the others continue
            continue
        docs.append(tokenizer.decode(streams[src][cursor[src] : cursor[src] + length]).strip())
        cursor[src] += length
    return docs


def rouge_l(candidate: list, reference: list) -> float:
    """ROUGE-L F1: longest common subsequence against both lengths (1.0 for two empty sequences)."""
    if not candidate or not reference:
        return float(candidate == reference)
    prev = [0] * (len(reference) + 1)
    for c in candidate:
        cur = [0]
        for j, r in enumerate(reference):
            cur.append(prev[j] + 1 if c == r else max(prev[j + 1], cur[j]))
        prev = cur
    lcs = prev[-1]
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(candidate), lcs / len(reference)
    return 2 * precision * recall / (precision + recall)


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
    long_docs: int = 8,
    long_min_tokens: int = 1000,
    long_max_tokens: int = 2000,
    answer_tokens: int = 48,
    share: bool | None = None,
) -> dict:
    """`share`: None = one model when the weights allow it, False = always two models (True demands one)."""
    from transformers import AutoTokenizer

    from .modeling_llama_swiftkv import LlamaSwiftKVForCausalLM

    if threads:
        torch.set_num_threads(threads)
    if not Path(text).exists():
        raise DataError(f"evaluation text {str(text)!r} does not exist")
    if long_docs > 0 and answer_tokens < 1:
        raise EvalError(f"answer tokens must be at least 1, got {answer_tokens}")
    if not (Path(teacher) / "config.json").exists():
        raise EvalError(f"model folder {str(teacher)!r} does not exist or has no config.json")
    s_model = _load(student)
    if not isinstance(s_model, LlamaSwiftKVForCausalLM) or s_model.config.num_key_value_layers >= s_model.config.num_hidden_layers:
        raise EvalError(f"{student} is not a SwiftKV checkpoint (num_key_value_layers must be < num_hidden_layers)")
    shared = share is not False and same_base_weights(teacher, student)
    if share and not shared:
        raise EvalError(f"{teacher} does not hold the student's non-SwiftKV weights: cannot share one model")
    t_model = s_model if shared else _load(teacher)
    if t_model.config.vocab_size != s_model.config.vocab_size:
        raise EvalError("teacher and student have different vocabularies")
    tokenizer = AutoTokenizer.from_pretrained(student)
    data = load_packed(text, tokenizer, seq_len, assistant_only=False, max_rows=max(1, max_tokens // seq_len))
    docs = long_documents(text, tokenizer, long_docs, long_min_tokens, long_max_tokens) if long_docs > 0 else []
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else torch.autocast("cpu", enabled=False)
    n = agree = kl_sum = nll_t = nll_s = 0.0
    t0 = time.perf_counter()
    for r in range(len(data)):
        ids = data.ids[r : r + 1]
        mask = loss_mask(data.target[r : r + 1])[0]
        labels = torch.roll(ids[0], -1)[mask]
        with ctx:
            t_logits, s_logits = (x[0][mask].float() for x in _pair_logits(t_model, s_model, ids))
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
    result["shared_lower_layers"] = shared
    with ctx:
        if num_prompts > 0 and gen_tokens > 0:
            result.update(greedy_agreement(t_model, s_model, tokenizer, default_prompts(text, num_prompts), gen_tokens))
        if long_docs > 0:
            t1 = time.perf_counter()
            result.update(long_context_agreement(t_model, s_model, tokenizer, docs, answer_tokens))
            result["long_seconds"] = round(time.perf_counter() - t1, 1)
    result["seconds"] = round(time.perf_counter() - t0, 1)
    return result


def _prefix_share(a: list[int], b: list[int]) -> float:
    same = 0
    for x, y in zip(a, b):
        if x != y:
            break
        same += 1
    return same / max(len(a), 1)


@torch.no_grad()
def greedy_agreement(t_model, s_model, tokenizer, prompts: list[list[dict]], gen_tokens: int) -> dict:
    if not prompts:
        return {}
    exact = prefix = 0.0
    eos = tokenizer.eos_token_id
    for messages in prompts:
        ids = _chat_ids(tokenizer, messages)
        a = t_model.greedy_generate(ids, gen_tokens, swiftkv=False, eos_token_id=eos)
        b = s_model.greedy_generate(ids, gen_tokens, swiftkv=True, eos_token_id=eos)
        exact += a == b
        prefix += _prefix_share(a, b)
    return {"greedy_exact_match": exact / len(prompts), "greedy_token_agreement": prefix / len(prompts), "greedy_prompts": len(prompts)}


@torch.no_grad()
def long_context_agreement(t_model, s_model, tokenizer, docs: list[str], answer_tokens: int) -> dict:
    """The long-prompt metrics (module docstring) over `docs`, requests alternating between LONG_REQUESTS."""
    if not docs:
        return {"long_docs": 0}
    eos = tokenizer.eos_token_id
    agree = total = rouge = exact = prompt_tokens = 0.0
    for k, doc in enumerate(docs):
        ids = _chat_ids(tokenizer, [{"role": "user", "content": f"{doc}\n\n{LONG_REQUESTS[k % len(LONG_REQUESTS)]}"}])
        a = t_model.greedy_generate(ids, answer_tokens, swiftkv=False, eos_token_id=eos)
        b = s_model.greedy_generate(ids, answer_tokens, swiftkv=True, eos_token_id=eos)
        # Position len(ids) - 1 + j predicts the teacher's answer token j, with the teacher's tokens before it;
        # the LM head runs on those positions only.
        hidden, _ = s_model.forward_upper_hidden(s_model.forward_lower(torch.tensor([ids + a[:-1]])), swiftkv=True)
        s_logits = s_model.lm_head(hidden[0, len(ids) - 1 :])
        agree += (s_logits.argmax(-1) == torch.tensor(a)).sum().item()
        total += len(a)
        rouge += rouge_l([t for t in b if t != eos], [t for t in a if t != eos])
        exact += a == b
        prompt_tokens += len(ids)
    return {
        "long_teacher_forced_agreement": agree / total,
        "long_rouge_l": rouge / len(docs),
        "long_exact_match": exact / len(docs),
        "long_docs": len(docs),
        "long_prompt_tokens_mean": round(prompt_tokens / len(docs), 1),
    }
