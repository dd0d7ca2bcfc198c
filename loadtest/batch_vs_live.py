"""Batch work beside live traffic: does a running batch hurt interactive latency?

One `swiftkv serve` (the embedded default config unless --config: SmolLM2 SwiftKV + base pools, in-process
engines, priority scheduling) is started with a fresh data dir. A steady trickle of live streamed chat
requests is sent twice, at the same times, with prompts of the same lengths (not the same prompts, which
vLLM's prefix cache would serve the second time):
  idle   on the idle platform;
  busy   while a batch of prompt-heavy lines (1,000-token windows of held-out text, 10:1) keeps the engines busy.
Reported: live TTFT p50/p99 in both phases and their ratio (target: p50 within 1.25x), and the batch's
throughput (prompt + output tokens of its lines over its in-progress time, from the Batch object's
timestamps and the output file's usage).

    .venv/bin/python -m loadtest.batch_vs_live [--lines 200] [--live 40] [--interval 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from loadtest.platform_bench import free_port, pct, swiftkv_serve


def documents(text: str, tokenizer, n: int, min_tokens: int, max_tokens: int) -> list[str]:
    """Whole held-out documents of min-max tokens (the live prompts)."""
    from swiftkv_core.evaluate import long_documents

    docs = long_documents(text, tokenizer, n, min_tokens, max_tokens)
    if len(docs) < n:
        raise SystemExit(f"{text} holds only {len(docs)} documents of {min_tokens}-{max_tokens} tokens, {n} needed")
    return docs


def windows(text: str, tokenizer, n: int, tokens: int) -> list[str]:
    """n windows of exactly `tokens` tokens of held-out text (the batch lines: more than the text has whole documents of that size)."""
    from loadtest.workloads import fixed

    return [r.document for r in fixed(text, tokenizer, 1.0, n, tokens, 1)]


def chat(doc: str) -> list[dict]:
    return [{"role": "user", "content": f"{doc}\n\nSummarize the text above in a few sentences."}]


async def trickle(client, model: str, prompts: list[str], interval: float, max_tokens: int) -> list[float]:
    """One streamed request every `interval` seconds (not waiting for the previous one); their TTFTs."""

    async def one(doc: str) -> float:
        t0 = time.perf_counter()
        stream = await client.chat.completions.create(model=model, messages=chat(doc), max_tokens=max_tokens, stream=True,
                                                      temperature=0, extra_body={"ignore_eos": True})
        ttft = None
        async for chunk in stream:
            if ttft is None and chunk.choices and chunk.choices[0].delta.content:
                ttft = time.perf_counter() - t0
        return ttft if ttft is not None else float("nan")

    tasks = []
    for doc in prompts:
        tasks.append(asyncio.create_task(one(doc)))
        await asyncio.sleep(interval)
    return list(await asyncio.gather(*tasks))


def ttft_summary(xs: list[float]) -> dict:
    return {"n": len(xs), "p50_s": round(statistics.median(xs), 4), "p99_s": round(pct(xs, 99), 4), "mean_s": round(statistics.fmean(xs), 4)}


async def measure(args, base: str, live_docs: list[str], batch_docs: list[str]) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=600)
    model = (await client.models.list()).data[0].id

    # Each phase has prompts of its own (the same lengths, interleaved): a prompt sent twice would be served
    # from vLLM's prefix cache the second time.
    warm, idle_docs, busy_docs = live_docs[:2], live_docs[2::2], live_docs[3::2]
    await trickle(client, model, warm, 0.0, args.live_output_tokens)  # warm both code paths
    idle = await trickle(client, model, idle_docs, args.interval, args.live_output_tokens)

    lines = [{"custom_id": f"b{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": model, "messages": chat(d), "max_tokens": args.batch_output_tokens, "ignore_eos": True}}
             for i, d in enumerate(batch_docs)]
    upload = await client.files.create(file=("batch.jsonl", "".join(json.dumps(x) + "\n" for x in lines).encode()), purpose="batch")
    batch = await client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
    while (batch := await client.batches.retrieve(batch.id)).request_counts.completed < 1:  # the engines are busy
        await asyncio.sleep(0.5)
    busy = await trickle(client, model, busy_docs, args.interval, args.live_output_tokens)
    done_during_trickle = batch.request_counts.completed
    batch = await client.batches.retrieve(batch.id)
    still_running = batch.status == "in_progress"
    while batch.status not in ("completed", "failed", "expired", "cancelled"):
        await asyncio.sleep(2)
        batch = await client.batches.retrieve(batch.id)
    if batch.status != "completed" or not batch.output_file_id:
        raise SystemExit(f"batch ended {batch.status}: {batch.errors}")
    out = [json.loads(x) for x in (await client.files.content(batch.output_file_id)).text.splitlines() if x.strip()]
    usage = [o["response"]["body"]["usage"] for o in out]
    prompt_tokens, output_tokens = sum(u["prompt_tokens"] for u in usage), sum(u["completion_tokens"] for u in usage)
    seconds = batch.completed_at - batch.in_progress_at
    metrics = httpx.get(f"{base}/metrics", timeout=10).text
    preempted = sum(s.value for f in text_string_to_metric_families(metrics) for s in f.samples
                    if s.name == "swiftkv_batch_requests_preempted_total")
    return {
        "batch": {"lines": len(lines), "completed": batch.request_counts.completed, "failed": batch.request_counts.failed,
                  "prompt_tokens": prompt_tokens, "output_tokens": output_tokens, "seconds": seconds,
                  "tokens_per_s": round((prompt_tokens + output_tokens) / max(seconds, 1), 1),
                  "prompt_to_output": round(prompt_tokens / max(output_tokens, 1), 1),
                  "requests_aborted_for_live": int(preempted),
                  "still_running_after_busy_trickle": still_running, "lines_done_when_busy_trickle_started": done_during_trickle},
        "live": {"requests_per_phase": len(idle_docs), "interval_s": args.interval, "output_tokens": args.live_output_tokens,
                 "idle": ttft_summary(idle), "busy": ttft_summary(busy),
                 "ttft_p50_ratio": round(statistics.median(busy) / statistics.median(idle), 3),
                 "ttft_p99_ratio": round(pct(busy, 99) / pct(idle, 99), 3)},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", help="platform config (default: the embedded one, SmolLM2 SwiftKV + base)")
    ap.add_argument("--text", default="data/mix/heldout.jsonl", help="held-out text the prompts are cut from")
    ap.add_argument("--tokenizer", default="models/smollm2-135m-instruct")
    ap.add_argument("--lines", type=int, default=200, help="batch lines")
    ap.add_argument("--batch-prompt-tokens", type=int, default=1000, help="each line's document: a window of this many tokens of held-out text")
    ap.add_argument("--batch-output-tokens", type=int, default=100)
    ap.add_argument("--live", type=int, default=40, help="live requests per phase")
    ap.add_argument("--interval", type=float, default=3.0, help="seconds between live requests")
    ap.add_argument("--live-min-tokens", type=int, default=250)
    ap.add_argument("--live-max-tokens", type=int, default=350)
    ap.add_argument("--live-output-tokens", type=int, default=30)
    ap.add_argument("--json", dest="json_out", help="also write the result to this file")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from swiftkv_core.hardware import cpu_info

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)  # the prompts first: a text too short fails before any engine starts
    live_docs = documents(args.text, tokenizer, 2 * args.live + 2, args.live_min_tokens, args.live_max_tokens)
    batch_docs = windows(args.text, tokenizer, args.lines, args.batch_prompt_tokens)
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as work:
        args_ = ["--data-dir", work] + (["--config", args.config] if args.config else [])
        with swiftkv_serve(args_, free_port(), Path(work) / "serve.log", 900) as (base, _):
            result = asyncio.run(measure(args, base, live_docs, batch_docs))
    result |= {"cpu": cpu_info().summary(), "cores": os.cpu_count(), "load_average_1min_at_start": load,
               "command": " ".join(sys.argv)}
    text = json.dumps(result, indent=2)
    print(text)
    if args.json_out:
        Path(args.json_out).write_text(text + "\n")


if __name__ == "__main__":
    main()
