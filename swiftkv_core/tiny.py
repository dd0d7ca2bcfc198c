"""Tiny random Llama checkpoints with a locally trained tokenizer: for tests, benchmarks and demos
on machines without a model hub. Nothing here downloads anything."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

_CORPUS = """
SwiftKV reduces the prefill compute of large language models by computing the key value cache of the
later layers from the output of an earlier layer. Prompt tokens skip the later layers entirely, while
decode tokens still run every layer. Retrieval augmented generation, summarization, code completion and
text to SQL send about ten prompt tokens for every generated token, so prefill dominates their cost.
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. How vexingly quick
daft zebras jump! Sphinx of black quartz, judge my vow. 0 1 2 3 4 5 6 7 8 9 10 100 1000.
SELECT name, count(*) FROM users WHERE created_at > now() - interval '1 day' GROUP BY name ORDER BY 2;
def add(a, b):\n    return a + b\nclass Cache:\n    pass\n{"role": "user", "content": "hello"}
The capital of France is Paris. The capital of Italy is Rome. Water boils at one hundred degrees.
"""


def train_tokenizer(vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on a built-in corpus, with ChatML special tokens and template."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


def build_tiny_llama(
    out_dir: str | Path,
    num_hidden_layers: int = 8,
    hidden_size: int = 128,
    intermediate_size: int = 256,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    vocab_size: int = 512,
    max_position_embeddings: int = 4096,
    tie_word_embeddings: bool = True,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> Path:
    """Write a random-weight Llama checkpoint (safetensors + tokenizer + chat template) and return its path.

    Weights are scaled up from the usual 0.02 to 0.2 so that logits are far from uniform and greedy decoding
    is decisive: parity tests then compare clearly separated argmaxes, not near-ties.
    """
    out = Path(out_dir)
    tokenizer = train_tokenizer(vocab_size)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        initializer_range=0.2,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(dtype)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def perturb_swiftkv(swiftkv_dir: str | Path, scale: float = 0.2, seed: int = 1) -> Path:
    """Add deterministic noise to every SwiftKV tensor of a converted checkpoint, in place; return its path.

    A fresh conversion copies its SwiftKV tensors from the base model (q_proj_swiftkv == q_proj,
    norm_swiftkv == layer l's input norm, k/v_proj_swiftkv == the layer's own with g = 1), so a loader that
    read the wrong one of such a pair would still produce the right logits. The noise (`scale` times each
    projection's standard deviation; norm weights multiplied by 1 + `scale` * N(0, 1)) makes every SwiftKV
    tensor differ from every other tensor while the model stays a sane, decisive tiny Llama.
    """
    from safetensors.torch import load_file, save_file

    from .convert import SWIFTKV_SHARD

    shard = Path(swiftkv_dir) / SWIFTKV_SHARD
    gen = torch.Generator().manual_seed(seed)
    noisy = {}
    for name, t in sorted(load_file(shard).items()):
        noise = scale * torch.randn(t.shape, generator=gen)
        if t.dim() == 1:  # RMSNorm weight
            noisy[name] = (t.float() * (1 + noise)).to(t.dtype)
        else:
            noisy[name] = (t.float() + noise * t.float().std()).to(t.dtype)
    save_file(noisy, shard, metadata={"format": "pt"})
    return Path(swiftkv_dir)
