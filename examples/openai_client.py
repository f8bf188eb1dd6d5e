"""Talk to Dyad with the official ``openai`` Python client: Dyad is just another OpenAI base URL.

    make demo                                              # in one terminal (gateway on :8000)
    .venv/bin/python examples/openai_client.py             # in another
    .venv/bin/python examples/openai_client.py --url http://127.0.0.1:9000/v1 --api-key sk-team-a

The model defaults to the first one the gateway lists (``GET /v1/models``).
"""

from __future__ import annotations

import argparse
import sys

from openai import OpenAI


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8000/v1", help="the gateway's base URL, ending in /v1")
    p.add_argument("--api-key", default="none", help="a client key (any string when auth is off)")
    p.add_argument("--model", help="model name (default: the first one the gateway serves)")
    args = p.parse_args()

    client = OpenAI(base_url=args.url, api_key=args.api_key, max_retries=0, timeout=60)
    model = args.model or client.models.list().data[0].id
    messages = [{"role": "system", "content": "You are a terse assistant."},
                {"role": "user", "content": "Name three prime numbers."}]

    # One answer, all at once.
    reply = client.chat.completions.create(model=model, messages=messages, max_tokens=16)
    print(f"[{model}] {reply.choices[0].message.content!r} ({reply.usage.completion_tokens} tokens)")

    # The same request streamed: chunks arrive as the engine produces them (Server-Sent Events).
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=16, stream=True)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
    print()

    # The legacy completions endpoint works too.
    done = client.completions.create(model=model, prompt="Once upon a time", max_tokens=8)
    print(repr(done.choices[0].text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
