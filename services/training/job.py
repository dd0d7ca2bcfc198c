"""One fine-tuning job's work, run as its own process (locally or as a Ray job's entrypoint):

    python -m services.training.job RUN_DIR

RUN_DIR/job.json holds the distillation settings and the evaluation settings. The distillation resumes
from RUN_DIR/out/state.pt when an earlier attempt saved one. At the end RUN_DIR/eval.json holds the
student-vs-teacher figures and RUN_DIR/done marks the attempt complete. Everything it writes is in RUN_DIR,
so the service (or the cluster) may be restarted at any point."""

from __future__ import annotations

import json
import sys
from pathlib import Path

STOPPED = 75  # exit status of a job stopped by SIGTERM at a step boundary, its state saved (EX_TEMPFAIL)


def run(run_dir: Path) -> int:
    from swiftkv_core.config import SwiftKVConfigError
    from swiftkv_core.data import DataError
    from swiftkv_core.distill import DistillConfig, DistillError, DistillStopped, distill
    from swiftkv_core.evaluate import EvalError, evaluate

    spec = json.loads((run_dir / "job.json").read_text())
    cfg = DistillConfig(**spec["distill"])
    try:
        out = distill(cfg)
        ev = spec.get("eval")
        if ev:
            result = evaluate(cfg.base, out, ev["text"], seq_len=ev["seq_len"], max_tokens=ev["max_tokens"],
                              num_prompts=ev["num_prompts"], gen_tokens=ev["gen_tokens"], long_docs=0)
            tmp = run_dir / "eval.json.tmp"
            tmp.write_text(json.dumps(result, indent=2))
            tmp.replace(run_dir / "eval.json")
    except DistillStopped as e:  # the service is stopping: the state is saved, the next start resumes
        print(f"stopped: {e}", file=sys.stderr, flush=True)
        return STOPPED
    except (SwiftKVConfigError, DistillError, DataError, EvalError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    (run_dir / "done").write_text("ok\n")
    return 0


if __name__ == "__main__":
    sys.exit(run(Path(sys.argv[1])))
