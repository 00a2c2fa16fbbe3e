"""Prefix reuse on a running `cmf serve`: time to first token of a request with a ~2,000-token
system prompt, then of a second request with the same system prompt and another question.
Each round uses a new system prompt, so its first request finds nothing cached. Needs the
`openai` package. One JSON line per round.

usage: python3 bench/prefix_ttft.py BASE_URL ROUNDS [WORDS]
  WORDS: words of the system prompt (default 1900: ~1,930 tokens with SmolLM2's tokenizer; a
  model with a smaller vocabulary needs fewer for the same token count)
  e.g. cmf serve smollm2-135m-instruct.cmf --parallel 4 --port 18571 -t 2 &
       python3 bench/prefix_ttft.py http://127.0.0.1:18571 3
"""
import json, random, sys, time
import openai

base = sys.argv[1]
client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=600)
model = client.models.list().data[0].id
words = ("the of and to in a is that for it as was with be by on not he this are or his from at "
         "which but have an they you were her she there been one all we their has would when if "
         "so no will more out up into do any your what some can only other new time could these "
         "two may first then its also after way many must before years where most such").split()

n_words = int(sys.argv[3]) if len(sys.argv) > 3 else 1900

def system_prompt(seed):
    r = random.Random(seed)
    return "You are a helpful assistant. Background notes: " + " ".join(
        r.choice(words) for _ in range(n_words)) + "."

def ask(system, question):
    t0 = time.perf_counter()
    ttft, usage = None, None
    for chunk in client.chat.completions.create(
            model=model, messages=[{"role": "system", "content": system},
                                   {"role": "user", "content": question}],
            max_tokens=8, temperature=0, stream=True, stream_options={"include_usage": True}):
        if ttft is None and chunk.choices and chunk.choices[0].delta.content:
            ttft = time.perf_counter() - t0
        if chunk.usage:
            usage = chunk.usage
    return ttft, usage.prompt_tokens

rows = []
for seed in range(int(sys.argv[2])):
    system = system_prompt(seed)
    t1, p1 = ask(system, "Summarise the notes.")
    t2, p2 = ask(system, "What is the first word?")
    rows.append((seed, p1, t1, p2, t2))
    print(json.dumps({"round": seed, "first_prompt_tokens": p1, "first_ttft_ms": round(t1 * 1e3, 1),
                      "second_prompt_tokens": p2, "second_ttft_ms": round(t2 * 1e3, 1),
                      "ratio": round(t2 / t1, 3)}), flush=True)
