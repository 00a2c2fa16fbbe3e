"""The official `openai` client (2.x) and `langchain-openai` against a running `cmf serve`
(one request at a time, or batched with `--parallel`).

Usage: openai_clients.py BASE_URL EXPECTED_JSON
EXPECTED_JSON holds {"prompt": str, "logprobs": [float]}: the prompt's per-token
log-probabilities (from its second token) from a teacher-forced pass, as `cmf ppl` scores.
Prints SKIPPED (and exits 0) when the clients are not installed.
"""

import json
import sys
from concurrent.futures import ThreadPoolExecutor

try:
    import openai
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field
except ImportError as e:  # the Rust test reports the skip
    print(f"SKIPPED: {e}")
    sys.exit(0)

base, expected_path = sys.argv[1], sys.argv[2]
expected = json.load(open(expected_path))
client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)
MODEL = client.models.list().data[0].id

TOOLS = [
    {"type": "function", "function": {"name": "w", "description": "weather",
     "parameters": {"type": "object",
                    "properties": {"c": {"type": "string", "maxLength": 6},
                                   "d": {"type": "integer", "minimum": 1, "maximum": 7}},
                    "required": ["c", "d"], "additionalProperties": False}}},
]


def tool_round_trip():
    msgs = [{"role": "user", "content": "Weather?"}]
    # One call, then the grammar ends the answer (a random-weight model would otherwise be free
    # to add parallel calls until max_tokens).
    r = client.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS,
                                       tool_choice="required", parallel_tool_calls=False,
                                       max_tokens=100, seed=1)
    m = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls", r
    assert m.tool_calls and m.tool_calls[0].function.name == "w", m
    args = json.loads(m.tool_calls[0].function.arguments)
    assert set(args) == {"c", "d"}, args
    # The history as clients build it: model_dump() with its nulls, then the tool result.
    msgs.append(m.model_dump())
    msgs.append({"role": "tool", "tool_call_id": m.tool_calls[0].id, "content": "22"})
    r2 = client.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, max_tokens=4)
    assert r2.usage.prompt_tokens > r.usage.prompt_tokens

    # Streamed: the deltas add up to the same call (same seed).
    name, arguments = None, ""
    for chunk in client.chat.completions.create(model=MODEL, messages=msgs[:1], tools=TOOLS,
                                                tool_choice="required", parallel_tool_calls=False,
                                                max_tokens=100, seed=1, stream=True):
        for c in chunk.choices:
            for tc in c.delta.tool_calls or []:
                name = tc.function.name or name
                arguments += tc.function.arguments or ""
    assert (name, arguments) == ("w", m.tool_calls[0].function.arguments), (name, arguments)


class Answer(BaseModel):
    name: str = Field(max_length=8)
    count: int = Field(ge=0, le=9)
    ok: bool


def structured_output():
    for i in range(20):
        r = client.chat.completions.parse(model=MODEL, messages=[
            {"role": "user", "content": f"Question {i}?"}], response_format=Answer,
            max_tokens=150, seed=i)
        parsed = r.choices[0].message.parsed
        assert isinstance(parsed, Answer), r


def logprobs_match_ppl():
    r = client.completions.create(model=MODEL, prompt=expected["prompt"], max_tokens=1,
                                  echo=True, logprobs=0, temperature=0)
    got = r.choices[0].logprobs.token_logprobs
    assert got[0] is None
    want = expected["logprobs"]
    assert len(got) >= len(want) + 1
    for i, w in enumerate(want):
        assert abs(got[i + 1] - w) < 1e-3, (i, got[i + 1], w)
    c = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=4, logprobs=True, top_logprobs=2)
    assert all(len(e.top_logprobs) == 2 for e in c.choices[0].logprobs.content)


def choices_and_logprobs():
    # Choice i of n samples with seed + i: it equals a one-choice request with that seed. The
    # one-choice requests go at once, so a batching server runs them in the same steps.
    prompt = "In the beginning God"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, n=3,
                                  temperature=0.9, seed=5, logprobs=2)
    assert len(r.choices) == 3, r
    with ThreadPoolExecutor(3) as pool:
        singles = list(pool.map(lambda i: client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=8, temperature=0.9, seed=5 + i, logprobs=2),
            range(3)))
    for c, one in zip(sorted(r.choices, key=lambda c: c.index), singles):
        assert one.choices[0].text == c.text, (one.choices[0].text, c.text)
        got, want = c.logprobs.token_logprobs, one.choices[0].logprobs.token_logprobs
        assert len(got) == len(want) and all(abs(a - b) < 1e-4 for a, b in zip(got, want)), (
            got, want)
    c = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=6, n=2, logprobs=True, top_logprobs=2,
                                       temperature=0.8, seed=3)
    assert len(c.choices) == 2, c
    assert all(len(e.top_logprobs) == 2 for ch in c.choices for e in ch.logprobs.content), c
    # Streamed choices interleave; each index's deltas add up to its text.
    texts = {}
    for chunk in client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, n=3,
                                           temperature=0.9, seed=5, stream=True):
        for ch in chunk.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
    assert [texts[i] for i in range(3)] == [c.text for c in sorted(r.choices,
                                                                    key=lambda c: c.index)], texts


def langchain():
    llm = ChatOpenAI(base_url=base + "/v1", api_key="unused", model=MODEL, max_tokens=8,
                     stream_usage=True, max_retries=0)
    whole = llm.invoke("Hello")
    total = None
    for chunk in llm.stream("Hello"):
        total = chunk if total is None else total + chunk
    # Usage counted once: the streamed sum equals the whole answer's usage.
    assert total.usage_metadata["input_tokens"] == whole.usage_metadata["input_tokens"], (
        total.usage_metadata, whole.usage_metadata)
    assert total.usage_metadata["output_tokens"] <= 8
    tools = ChatOpenAI(base_url=base + "/v1", api_key="unused", model=MODEL, max_tokens=100,
                       max_retries=0).bind_tools(TOOLS, tool_choice="any")
    msg = tools.invoke("Weather?")
    assert msg.tool_calls and msg.tool_calls[0]["name"] == "w", msg
    structured = ChatOpenAI(base_url=base + "/v1", api_key="unused", model=MODEL,
                            max_tokens=150, max_retries=0).with_structured_output(
        Answer, method="json_schema")
    assert isinstance(structured.invoke("Answer?"), Answer)


for test in (tool_round_trip, structured_output, logprobs_match_ppl, choices_and_logprobs,
             langchain):
    test()
    print(f"ok {test.__name__}")
print(f"openai {openai.__version__}: all passed")
