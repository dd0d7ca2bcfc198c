"""scripts/frontier_report.py: rows recorded on other machines and rows in runs/ make one table."""

import importlib.util
from pathlib import Path

spec = importlib.util.spec_from_file_location("frontier_report", Path(__file__).resolve().parent.parent / "scripts" / "frontier_report.py")
frontier_report = importlib.util.module_from_spec(spec)
spec.loader.exec_module(frontier_report)


def _row(name, l, g, speedup, how, top1=0.9):
    return {"name": name, "l": l, "g": g, "init": "lstsq", "temperature": 2.0, "tokens": 256_000, "train_tok_s": 200,
            "machine": "-", "speedup": speedup, "speedup_how": how, "heldout": {"top1_agreement": top1}, "manpages": None,
            "curve": []}


def test_a_fresh_row_replaces_its_record_and_takes_its_layouts_measured_speedup():
    recorded = [_row("l22", 22, 1, 1.31, "measured", top1=0.887), _row("l20", 20, 1, 1.60, "measured")]
    fresh = [_row("l22", 22, 1, 1.45, "bound", top1=0.95), _row("l22-t1", 22, 1, 1.45, "bound"), _row("l18", 18, 1, 1.9, "bound")]
    rs = {r["name"]: r for r in frontier_report.merged(recorded, fresh)}
    assert rs["l22"]["heldout"]["top1_agreement"] == 0.95  # the fresh run wins
    assert (rs["l22-t1"]["speedup"], rs["l22-t1"]["speedup_how"]) == (1.31, "measured")  # nobody measured l22 now, but it was
    assert (rs["l18"]["speedup"], rs["l18"]["speedup_how"]) == (1.9, "bound")  # no measurement of l = 18 anywhere
    assert [r["name"] for r in frontier_report.merged(recorded, fresh)] == ["l18", "l20", "l22", "l22-t1"]
    assert "| l22-t1 (-) | 22 | 1 | lstsq | 2 | - | 256,000 | 1.31 (measured) | 0.900 / - |" in frontier_report.table(list(rs.values()))


def test_the_recipe_column_names_what_a_row_adds_to_the_common_recipe():
    assert frontier_report.recipe({"data": "data/mix/train.jsonl", "hidden_weight": 0.0}) == "-"
    assert frontier_report.recipe({"data": "data/mix/train.jsonl", "hidden_weight": 1.0}) == "hidden MSE x1"
    assert frontier_report.recipe({"data": "data/mix/answers.jsonl", "hidden_weight": 0.0}) == "data answers.jsonl"


def test_a_layout_measured_in_runs_replaces_every_recorded_speedup_of_that_layout(tmp_path):
    (tmp_path / "speed-l20-g1.json").write_text('{"prefill_speedup": 1.45}')
    (tmp_path / "speed-l18-g1.json").write_text('{"prefill_speedup": 1.56}')
    now = frontier_report.measurements(tmp_path)
    assert now == {(20, 1): 1.45, (18, 1): 1.56}
    recorded = [_row("l20", 20, 1, 1.60, "measured"), _row("l20-t1", 20, 1, 1.47, "bound"), _row("l22", 22, 1, 1.31, "measured")]
    rs = {r["name"]: r for r in frontier_report.merged(recorded, [_row("l18", 18, 1, 1.62, "bound")], now)}
    assert [(rs[n]["speedup"], rs[n]["speedup_how"]) for n in ("l18", "l20", "l20-t1", "l22")] == [
        (1.56, "measured"), (1.45, "measured"), (1.45, "measured"), (1.31, "measured")]


def test_plain_rows_at_t1_make_the_budget_series_of_their_layout():
    def row(name, l, tokens, recipe="-", t=1.0):
        return _row(name, l, 1, 1.3, "measured") | {"tokens": tokens, "recipe": recipe, "temperature": t,
                                                     "manpages": {"top1_agreement": 0.88}}
    rs = [row("l22-t1-8m", 22, 8_000_000, "data mix-large, batch 32"), row("l22-t1", 22, 256_000), row("l22", 22, 256_000, t=2.0),
          row("l22-lora", 22, 256_000, "adapters r16 on o"), row("l20-t1-8m", 20, 8_000_000, "data mix-large, batch 32")]
    series = frontier_report.budget_series(rs)
    assert {l: [r["name"] for r in v] for l, v in series.items()} == {20: ["l20-t1-8m"], 22: ["l22-t1", "l22-t1-8m"]}


def test_rows_trained_on_a_gpu_machine_unpack_into_run_folders_the_report_reads(tiny_base, train_text, tmp_path):
    """scripts/frontier_cuda.py --unpack: what the GPU machine sends back (trained tensors + rows.json) becomes a run
    folder with the assembled checkpoint, its settings, summary and curve, read like a row trained here."""
    import json

    from swiftkv_core.distill import DistillConfig, distill
    from swiftkv_core.shipped import export_trained

    spec_cuda = importlib.util.spec_from_file_location("frontier_cuda", Path(__file__).resolve().parent.parent / "scripts" / "frontier_cuda.py")
    frontier_cuda = importlib.util.module_from_spec(spec_cuda)
    spec_cuda.loader.exec_module(frontier_cuda)
    settings = {"num_key_value_layers": 4, "temperature": 1.0, "init": "lstsq", "lr": 1e-3, "batch_size": 2, "seq_len": 32, "max_steps": 2,
                "progress": False}
    run = distill(DistillConfig(base=str(tiny_base), out=str(tmp_path / "gpu-run"), data=str(train_text), device="cpu", **settings))
    sent = tmp_path / "sent"
    export_trained(run, sent / "l4-t1-tiny.safetensors")
    curve = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x]
    summary = json.loads((run / "summary.json").read_text()) | {"device": "NVIDIA H100 80GB HBM3"}
    (sent / "rows.json").write_text(json.dumps({"l4-t1-tiny": {"settings": settings, "summary": summary, "curve": curve}}))

    frontier_cuda.unpack(sent, tmp_path / "runs", tiny_base, train_text)
    folder = tmp_path / "runs" / "l4-t1-tiny"
    assert json.loads((folder / "config.json").read_text())["num_key_value_layers"] == 4  # the assembled checkpoint
    (row,) = frontier_report.rows(tmp_path / "runs")
    assert (row["name"], row["l"], row["temperature"], row["tokens"]) == ("l4-t1-tiny", 4, 1.0, summary["tokens"])
    assert row["machine"].startswith("NVIDIA H100") and len(row["curve"]) == len(curve)


def test_a_bundles_parts_unpack_into_the_gguf_checked_by_its_hash(tmp_path):
    """scripts/frontier_bundle.sh unpack, part by part as they arrive: the text unpacked with the first, the GGUF joined
    and checked with the last; a piece changed on the way is refused."""
    import hashlib
    import subprocess
    import tarfile

    script = Path(__file__).resolve().parent.parent / "scripts" / "frontier_bundle.sh"
    gguf = bytes(range(256)) * 300
    for corrupt in (False, True):
        bundle, stash = tmp_path / f"bundle-{corrupt}", tmp_path / f"stash-{corrupt}"
        (bundle / "part-1").mkdir(parents=True)
        (bundle / "part-2").mkdir()
        (tmp_path / "train-large.jsonl").write_text('{"text": "a line"}\n')
        with tarfile.open(bundle / "part-1" / "data.tar.xz", "w:xz") as tar:
            tar.add(tmp_path / "train-large.jsonl", arcname="train-large.jsonl")
        (bundle / "part-1" / "gguf.part-0").write_bytes(gguf[:40_000])
        (bundle / "part-2" / "gguf.part-1").write_bytes(gguf[40_000:] + (b"x" if corrupt else b""))
        (bundle / "part-2" / "manifest").write_text(f"{hashlib.sha256(gguf).hexdigest()}\ngguf.part-0 gguf.part-1 \n")
        first = subprocess.run(["bash", str(script), "unpack", str(stash), str(bundle / "part-1")], capture_output=True, text=True)
        assert first.returncode == 0, first.stderr
        assert (stash / "train-large.jsonl").read_text() == '{"text": "a line"}\n' and not (stash / "data.tar.xz").exists()
        last = subprocess.run(["bash", str(script), "unpack", str(stash), str(bundle / "part-2")], capture_output=True, text=True)
        joined = stash / "SmolLM2-135M-Instruct.Q4_1.gguf"
        if corrupt:
            assert last.returncode != 0 and "FAILED" in last.stdout + last.stderr
        else:
            assert last.returncode == 0, last.stderr
            assert joined.read_bytes() == gguf and not (stash / "gguf.part-0").exists()
