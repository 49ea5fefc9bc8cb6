"""Drives `hmoe serve --embeddings --pooling last` with the official `openai` Python package.

Run by tests/embeddings.rs. `client.embeddings.create` asks for base64 unless told otherwise
and decodes it itself, so the default call checks the base64 answer and `encoding_format=
"float"` the JSON numbers; both must be the same f32 values. Exit status 0 when every check
passed; prints 'N passed, M failed'.
"""

import argparse
import array

import openai
from openai import OpenAI
from openai_client import run_checks

CHECKS = []


def check(fn):
    CHECKS.append(fn)
    return fn


def f32(values):
    """The values rounded to f32, as the server computed them."""
    return array.array("f", values).tolist()


@check
def single_input_is_normalized(ctx):
    r = ctx.client.embeddings.create(model=ctx.model, input="I believe the meaning of life is")
    assert len(r.data) == 1 and r.data[0].index == 0, r
    v = r.data[0].embedding
    assert len(v) == ctx.n_embd, len(v)
    assert abs(sum(x * x for x in v) - 1) < 1e-3
    assert r.usage.prompt_tokens == r.usage.total_tokens > 0, r.usage


@check
def base64_and_float_agree(ctx):
    b64 = ctx.client.embeddings.create(model=ctx.model, input="hello world").data[0].embedding
    flt = ctx.client.embeddings.create(model=ctx.model, input="hello world", encoding_format="float")
    assert f32(flt.data[0].embedding) == b64


@check
def several_inputs_in_order(ctx):
    r = ctx.client.embeddings.create(model=ctx.model, input=["a b", "c d", "a b"])
    assert [d.index for d in r.data] == [0, 1, 2]
    assert r.data[0].embedding == r.data[2].embedding
    assert r.data[0].embedding != r.data[1].embedding


@check
def token_id_inputs(ctx):
    r = ctx.client.embeddings.create(model=ctx.model, input=[[1, 2, 3], [4, 5]])
    assert len(r.data) == 2
    assert r.usage.prompt_tokens == 5, r.usage


@check
def refusals_are_400(ctx):
    for bad in ([], [[ctx.n_vocab]]):
        try:
            ctx.client.embeddings.create(model=ctx.model, input=bad)
        except openai.BadRequestError:
            continue
        raise AssertionError(f"input {bad!r} accepted")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--base-url", required=True, help="http://HOST:PORT/v1")
    p.add_argument("--model", required=True)
    p.add_argument("--n-embd", type=int, required=True)
    p.add_argument("--n-vocab", type=int, required=True)
    ctx = p.parse_args()
    ctx.client = OpenAI(base_url=ctx.base_url, api_key="none", max_retries=0, timeout=60)
    run_checks(CHECKS, ctx)


if __name__ == "__main__":
    main()
