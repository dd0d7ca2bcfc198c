"""Sample one question many times from a running platform (or any OpenAI-compatible server) and count the answers
that contain an expected word, per model: how sampled answers read to a client at the API's default temperature.

    .venv/bin/python scripts/sampled_answers.py --url http://127.0.0.1:8000 --models swiftkv-smollm2-base,swiftkv-smollm2 \
        --samples 128
"""

from __future__ import annotations

import argparse
import asyncio
import json


async def answers(client, model: str, question: str, samples: int, temperature: float | None, max_tokens: int,
                  concurrency: int) -> list[str]:
    gate = asyncio.Semaphore(concurrency)

    async def one() -> str:
        async with gate:
            extra = {} if temperature is None else {"temperature": temperature}
            r = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": question}],
                                                     max_tokens=max_tokens, **extra)
            return r.choices[0].message.content or ""

    return await asyncio.gather(*(one() for _ in range(samples)))


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key", default="none")
    parser.add_argument("--models", required=True, help="comma-separated model names")
    parser.add_argument("--question", default="What is the capital of France?")
    parser.add_argument("--expect", default="Paris")
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=None, help="omitted: the server's default (1.0)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args()
    import openai

    client = openai.AsyncOpenAI(base_url=f"{args.url.rstrip('/')}/v1", api_key=args.api_key, timeout=600, max_retries=0)
    report = {}
    for model in args.models.split(","):
        texts = await answers(client, model, args.question, args.samples, args.temperature, args.max_tokens, args.concurrency)
        hits = sum(args.expect in t for t in texts)
        report[model] = {"hits": hits, "samples": len(texts), "share": hits / len(texts), "examples": texts[:3]}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    asyncio.run(main())
