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
