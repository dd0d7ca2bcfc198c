"""FLOPs (paper Table 1), KV bytes, SimScore (Eq. 1)."""

import json

import pytest
from typer.testing import CliRunner

from services.cli import app
from swiftkv_core.analysis import PRESETS, flops_report, kv_cache_report, prefill_flops, sim_scores

# Paper Table 1, Llama-3.1-70B, GFLOPs per prefill token at S = 128K: (l, g) -> vocab, K/V, Q/O, MLP, attn, total, rel.
TABLE_1 = {
    (80, 1): (4.3, 2.6, 22, 113, 160, 302, 1.000),
    (60, 1): (4.3, 2.6, 16, 85, 120, 228, 0.755),
    (40, 1): (4.3, 2.6, 11, 56, 80, 154, 0.510),
    (40, 4): (4.3, 1.7, 11, 56, 80, 153, 0.507),
}


@pytest.mark.parametrize("layout", TABLE_1)
def test_flops_reproduce_paper_table_1(layout):
    l, g = layout
    report = flops_report(PRESETS["llama-3.1-70b"], 131072, l, g, convention="paper")
    *components, total, rel = TABLE_1[layout]
    ours = [report["gflops"][c] for c in ("vocab", "kv", "qo", "mlp", "attn")]
    for got, want in zip(ours, components):
        # The table prints 2-3 significant digits and rounds Q,O (21.47) up to 22.
        assert got == pytest.approx(want, rel=0.025, abs=0.11)
    assert report["total_gflops"] == pytest.approx(total, abs=1.0)
    assert report["relative"] == pytest.approx(rel, abs=0.002)


def test_exact_convention_counts_lm_head_once_and_decimal_attention():
    exact = prefill_flops(PRESETS["llama-3.1-70b"], 131072)
    paper = prefill_flops(PRESETS["llama-3.1-70b"], 131072, convention="paper")
    assert exact["vocab"] == pytest.approx(paper["vocab"] / 2)
    assert exact["attn"] == pytest.approx(paper["attn"] * 2**30 / 1e9)
    assert exact["mlp"] == paper["mlp"] and exact["qo"] == paper["qo"]


def test_smollm2_prefill_limit_near_1_9_at_2k():
    report = flops_report(PRESETS["smollm2-135m"], 2048, 15)
    assert report["max_prefill_speedup"] == pytest.approx(1.91, abs=0.01)


def test_kv_cache_savings_match_paper():
    shape = PRESETS["llama-3.1-70b"]
    assert kv_cache_report(shape, 40, 4)["saving"] == pytest.approx(0.375)
    assert kv_cache_report(shape, 40, 2, kv_dtype="fp8")["saving"] == pytest.approx(0.625)
    assert kv_cache_report(shape, 80, 1)["saving"] == 0
    with pytest.raises(ValueError, match="kv_dtype must be one of"):
        kv_cache_report(shape, 40, 1, kv_dtype="int3")


def test_cli_flops_json_has_the_documented_keys():
    args = ["analyze", "flops", "--preset", "llama-3.1-70b", "--seq-len", "131072", "--num-key-value-layers", "40",
            "--key-value-group-size", "4", "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert {"total_gflops", "baseline_total_gflops", "relative", "gflops", "baseline_gflops"} <= set(data)
    assert set(data["gflops"]) == {"vocab", "kv", "qo", "mlp", "attn"}
    assert data["relative"] == pytest.approx(0.504, abs=0.002)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--preset", "gpt-5"], "unknown preset 'gpt-5'"),
        ([], "give exactly one of --preset"),
        (["--preset", "smollm2-135m", "--num-key-value-layers", "31"], "num_key_value_layers must be an integer in [1, 30]"),
        (["--preset", "smollm2-135m", "--convention", "vibes"], "convention must be 'exact' or 'paper'"),
    ],
)
def test_cli_flops_errors(args, message):
    result = CliRunner().invoke(app, ["analyze", "flops", *args])
    assert result.exit_code == 2 and message in result.output


def test_cli_kv_table_runs():
    result = CliRunner().invoke(app, ["analyze", "kv", "--preset", "smollm2-135m", "--num-key-value-layers", "14", "--key-value-group-size", "4"])
    assert result.exit_code == 0 and "40.0%" in result.output


PROSE = (
    "The river ran quietly past the old mill, where the miller's daughter kept the accounts for the village. "
    "Every morning she walked along the bank counting the boats that carried grain to the market town, and every "
    "evening she wrote the numbers into a heavy book bound in green leather. Engineers who build large systems "
    "learn early that the hardest problems are rarely the ones in the textbook. A database that answers a query "
    "in a millisecond on a laptop may take a minute when a thousand users ask at once. Good engineers measure "
    "before they optimise, write down what they measured, and keep the numbers honest even when they disappoint. "
    "In the mountains the snow arrives in October and stays until May; the shepherds bring their flocks down "
    "to the valley before the first storm, and travellers who cross the pass carry bread, cheese and a little wine."
)


@pytest.mark.smollm2
def test_simscore_increases_with_depth_on_smollm2(smollm2_dir, tmp_path):
    text = tmp_path / "prose.txt"
    text.write_text(PROSE * 3)
    result = CliRunner().invoke(app, ["analyze", "similarity", "--model", str(smollm2_dir), "--text", str(text), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output[result.output.index("{"):])
    scores = report["sim_scores"][1:]  # l = 0 compares raw embeddings, the paper's curves start at layer 1
    third = len(scores) // 3
    early, late = sum(scores[:third]) / third, sum(scores[-third:]) / third
    assert late > early + 0.1
    # Rank correlation with depth (Spearman, no ties in practice).
    ranks = sorted(range(len(scores)), key=scores.__getitem__)
    rank_of = {idx: r for r, idx in enumerate(ranks)}
    n = len(scores)
    rho = 1 - 6 * sum((rank_of[i] - i) ** 2 for i in range(n)) / (n * (n * n - 1))
    assert rho > 0.6
    assert n // 3 <= report["suggested_num_key_value_layers"] < n


def test_simscore_of_identical_layers_is_one(tiny_base):
    """A model whose layers add nothing (zeroed output projections) keeps x_l constant: SimScore = 1."""
    import torch

    from swiftkv_core.modeling_llama_swiftkv import load_model

    model = load_model(str(tiny_base))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    scores = sim_scores(model, [torch.randint(0, 300, (1, 16))])
    assert scores[1:] == pytest.approx([1.0] * (len(scores) - 1), abs=1e-5)
