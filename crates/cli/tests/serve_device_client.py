"""Drives `hmoe serve` with the official `openai` package (crates/cli/tests/serve_device.rs):
greedy chat requests one at a time and then all at once, and a two-turn chat. Prints one JSON
object with what came back; the Rust test compares."""

import argparse
import json
from concurrent.futures import ThreadPoolExecutor

from openai import OpenAI


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--api-key", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--n", type=int, default=8)
    args = ap.parse_args()
    client = OpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0)

    def chat(messages):
        return client.chat.completions.create(
            model=args.model, messages=messages, temperature=0, max_tokens=16
        )

    def ask(question):
        return chat([{"role": "user", "content": question}]).choices[0].message.content

    questions = [f"Question {i}: what comes after {i * 7}?" for i in range(args.n)]
    alone = [ask(q) for q in questions]
    with ThreadPoolExecutor(args.n) as pool:
        together = list(pool.map(ask, questions))

    first_turn = [{"role": "user", "content": "Name a colour."}]
    first = chat(first_turn).choices[0].message.content
    second = chat(
        first_turn
        + [
            {"role": "assistant", "content": first},
            {"role": "user", "content": "And another one?"},
        ]
    )
    extra = second.model_extra or {}
    print(
        json.dumps(
            {
                "alone": alone,
                "together": together,
                "second_timings": extra.get("timings"),
                "second_usage": second.usage.model_dump() if second.usage else None,
            }
        )
    )


if __name__ == "__main__":
    main()
