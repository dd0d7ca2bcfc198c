"""The reference model: teacher == stock transformers Llama, student layout == Snowflake's format."""

import pytest
import torch
from transformers import LlamaForCausalLM

from swiftkv_core.config import swiftkv_config_from_base
from swiftkv_core.modeling_llama_swiftkv import LlamaSwiftKVForCausalLM, load_model

torch.manual_seed(0)


def _ids(n=2, t=19, vocab=300):
    return torch.randint(0, vocab, (n, t))


def test_teacher_equals_transformers_llama(tiny_swiftkv, tiny_base):
    reference = LlamaForCausalLM.from_pretrained(tiny_base).eval()
    model = load_model(str(tiny_swiftkv))
    ids = _ids()
    with torch.no_grad():
        assert torch.equal(model(ids, swiftkv=False).logits, reference(ids).logits)


def test_student_with_l_equal_L_is_the_teacher(tiny_base):
    model = load_model(str(tiny_base))  # a plain Llama loads as SwiftKV with l = L
    assert model.config.num_key_value_layers == model.config.num_hidden_layers
    ids = _ids()
    with torch.no_grad():
        assert torch.equal(model(ids, swiftkv=True).logits, model(ids, swiftkv=False).logits)


def test_student_differs_from_teacher_when_layers_are_skipped(tiny_swiftkv):
    model = load_model(str(tiny_swiftkv))
    ids = _ids()
    with torch.no_grad():
        assert not torch.allclose(model(ids, swiftkv=True).logits, model(ids, swiftkv=False).logits)


def test_parameter_names_follow_snowflake_format(tiny_base):
    from transformers import AutoConfig

    config = swiftkv_config_from_base(AutoConfig.from_pretrained(tiny_base), num_key_value_layers=4, key_value_group_size=2)
    names = set(LlamaSwiftKVForCausalLM(config).swiftkv_parameters())
    expected = {"model.norm_swiftkv.weight"}
    expected |= {f"model.layers.{i}.self_attn.q_proj_swiftkv.weight" for i in range(4, 8)}
    expected |= {f"model.layers.{i}.self_attn.{p}_proj_swiftkv.weight" for i in (4, 6) for p in "kv"}
    assert names == expected


def test_last_token_alone_through_later_layers_gives_the_student_logits(tiny_swiftkv_across):
    """What the engine does: prompt tokens stop at layer l, only the last token runs the later layers,
    attending to K/V projected from norm_swiftkv(h_l) of every token. Same logits as the full forward."""
    import torch.nn.functional as F

    model = load_model(str(tiny_swiftkv_across))
    config = model.config
    ids = _ids(1, 24)
    with torch.no_grad():
        full = model(ids, swiftkv=True).logits[0, -1]
        state = model.forward_lower(ids)
        kv_input = model.model.norm_swiftkv(state.hidden)
        h = state.hidden[:, -1:]
        cos_last, sin_last = state.cos[:, -1:], state.sin[:, -1:]
        for i in config.swiftkv_layers:
            layer = model.model.layers[i]
            attn = layer.self_attn
            if config.kv_group_leader(i) == i:
                k, v = attn.project_kv(kv_input, state.cos, state.sin, swiftkv=True)
            x = layer.input_layernorm(h)
            q = attn._heads(attn.q_proj_swiftkv(x), attn.num_heads)
            half = q.shape[-1] // 2
            q = q * cos_last.unsqueeze(1) + torch.cat((-q[..., half:], q[..., :half]), -1) * sin_last.unsqueeze(1)
            out = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # the last token sees everything
            h = h + attn.o_proj(out.transpose(1, 2).reshape(1, 1, -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        last_only = model.lm_head(model.model.norm(h))[0, -1]
    assert torch.allclose(full, last_only, atol=1e-4, rtol=1e-4)


def test_forward_halves_compose_to_forward(tiny_swiftkv):
    model = load_model(str(tiny_swiftkv))
    ids = _ids()
    with torch.no_grad():
        split = model.forward_upper(model.forward_lower(ids), swiftkv=True, output_hidden_states=True)
        assert torch.equal(split.logits, model(ids, swiftkv=True).logits)
    assert len(split.hidden_states) == 4


def test_greedy_generate_matches_argmax_of_forward(tiny_swiftkv):
    model = load_model(str(tiny_swiftkv))
    prompt = [5, 17, 42, 7]
    out = model.greedy_generate(prompt, 3, swiftkv=True)
    with torch.no_grad():
        first = int(model(torch.tensor([prompt]), swiftkv=True).logits[0, -1].argmax())
    assert len(out) == 3 and out[0] == first


@pytest.mark.slow
def test_cached_greedy_equals_uncached_token_for_token(tiny_swiftkv, tiny_swiftkv_across):
    prompts = [[5, 17, 42, 7], list(range(40, 90)), [3]]
    for path in (tiny_swiftkv, tiny_swiftkv_across):
        model = load_model(str(path))  # the fixtures' SwiftKV tensors are perturbed, as after distillation
        for swiftkv in (False, True):
            for prompt in prompts:
                cached = model.greedy_generate(prompt, 12, swiftkv=swiftkv)
                assert cached == model.greedy_generate(prompt, 12, swiftkv=swiftkv, use_cache=False), (path, swiftkv, prompt)
                assert len(cached) == 12
        # The perturbed SwiftKV tensors make the student's answers differ from the teacher's somewhere, so both modes were exercised.
        assert any(model.greedy_generate(p, 12, swiftkv=True) != model.greedy_generate(p, 12, swiftkv=False) for p in prompts)


def test_cached_logits_match_the_full_forward(tiny_swiftkv_across):
    from swiftkv_core.modeling_llama_swiftkv import KVCache

    model = load_model(str(tiny_swiftkv_across))
    ids = _ids(1, 20)
    with torch.no_grad():
        for swiftkv in (False, True):
            full = model(ids, swiftkv=swiftkv).logits[0]
            cache = KVCache()
            steps = [model.forward_cached(ids[:, :12], cache, swiftkv)]  # the prefill: the last prompt token's logits
            steps += [model.forward_cached(ids[:, t : t + 1], cache, swiftkv) for t in range(12, 20)]
            assert torch.allclose(torch.cat(steps), full[11:], atol=2e-4, rtol=1e-4)  # prefill vs one-token matmuls: float noise
            assert cache.length == 20 and len(cache.kv) == (8 if not swiftkv else 4 + 2)
            with pytest.raises(ValueError, match="one token per call"):
                model.forward_cached(ids[:, :2], cache, swiftkv)
