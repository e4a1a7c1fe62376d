"""The fields real clients send, through the official `openai` client against `python -m infer
serve` on 127.0.0.1: n > 1 and several prompts (independent rows, OpenAI's choice indices),
echo, logprobs, max_completion_tokens, message content as parts / null, role tool, vLLM's
sampling extensions, continuous usage, the defaults of max_tokens, refusals that name the
field, unknown fields named in one log line, and vLLM's metric names.

One server (tiny random target, word tokenizer, random head, K=2, 2 slots) serves every test.
Here the protocol (what is accepted, refused and rendered), logprobs checked against the target's
own forward pass, and each sampling extension reaching the engine (its exact law: tests/test_engine.py)."""

from __future__ import annotations

import numpy as np
import pytest
from serve_support import ServerProcess, request, tiny_assets

openai = pytest.importorskip("openai")

K, SLOTS, MAX_LEN = 2, 2, 128  # the shapes of tests/test_serve_http.py: its compiled programs are read back
PROMPT = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-fields")
    return root, tiny_assets(root)


@pytest.fixture(scope="module")
def server(assets):
    root, _ = assets
    argv = ["--target", root / "target", "--drafter", root / "drafter", "--k", K]
    argv += ["--max-batch", SLOTS, "--max-len", MAX_LEN]
    proc = ServerProcess([str(a) for a in argv], root / "server.log", "tiny")
    yield proc
    assert proc.stop() == 0, proc.stderr()
    assert "Traceback" not in proc.stderr(), proc.stderr()


def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def complete(server, **kw):
    return client(server).completions.create(model="tiny", **{"max_tokens": 8, "temperature": 0, **kw})


def chat(server, messages, **kw):
    return client(server).chat.completions.create(model="tiny", messages=messages, **{"max_tokens": 6, **kw})


# ---------------------------------------------------------------- rows


def test_n_choices_are_independent_rows_keyed_by_seed_and_index(server):
    """Choice i of a request seeded s draws with row_key(s, i), as row i of `generate([p] * n, seed=s)`:
    choice 0 is the request alone, the choices differ, and the same request draws the same again."""
    res = complete(server, prompt=PROMPT, n=3, temperature=1.0, seed=40)
    assert [c.index for c in res.choices] == [0, 1, 2]
    texts = [c.text for c in res.choices]
    assert texts[0] == complete(server, prompt=PROMPT, temperature=1.0, seed=40).choices[0].text
    assert len(set(texts)) > 1  # independent draws
    assert [c.text for c in complete(server, prompt=PROMPT, n=3, temperature=1.0, seed=40).choices] == texts
    assert res.usage.prompt_tokens == len(PROMPT) and res.usage.completion_tokens == 3 * 8
    greedy = complete(server, prompt=PROMPT, n=2)
    assert greedy.choices[0].text == greedy.choices[1].text == complete(server, prompt=PROMPT).choices[0].text


@pytest.mark.parametrize("prompts", [["w5 w6", "w7"], [[5, 6], [7]]], ids=["texts", "token ids"])
def test_several_prompts_in_one_request(server, prompts):
    res = complete(server, prompt=prompts, n=2)
    assert [c.index for c in res.choices] == [0, 1, 2, 3]  # prompt i, choice j: i * n + j
    for i, p in enumerate(prompts):
        one = complete(server, prompt=p).choices[0].text
        assert res.choices[2 * i].text == res.choices[2 * i + 1].text == one
    assert res.usage.prompt_tokens == 3 and res.usage.completion_tokens == 4 * 8


def test_several_prompts_stream_each_choice_to_its_end(server):
    chunks = list(complete(server, prompt=["w5", "w6 w7"], stream=True, stream_options={"include_usage": True}))
    texts = {0: "", 1: ""}
    for ch in chunks[:-1]:
        texts[ch.choices[0].index] += ch.choices[0].text
    assert texts == {i: complete(server, prompt=p).choices[0].text for i, p in enumerate(["w5", "w6 w7"])}
    ends = [ch.choices[0].index for ch in chunks[:-1] if ch.choices[0].finish_reason == "length"]
    assert sorted(ends) == [0, 1] and chunks[-1].usage.completion_tokens == 16


# ---------------------------------------------------------------- echo, logprobs


def test_echo_prepends_the_prompt_and_logprobs_cover_every_token(server):
    plain = complete(server, prompt="w5 w6").choices[0].text
    res = complete(server, prompt="w5 w6", echo=True, logprobs=2)
    assert res.choices[0].text == "w5 w6" + plain
    lp = res.choices[0].logprobs
    assert lp.tokens == ["w5", "w6", *plain.split()]
    assert lp.token_logprobs[0] is None  # nothing precedes the prompt's first token
    assert len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 2 + 8
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert all(v is None or v <= 0 for v in lp.token_logprobs)


def log_softmax(target, ids: list[int]) -> np.ndarray:
    logits = np.asarray(target.forward(np.asarray([ids])).logits[0], np.float64)
    logits -= logits.max(-1, keepdims=True)
    return logits - np.log(np.exp(logits).sum(-1, keepdims=True))


def test_logprobs_are_the_targets_log_softmax_prompt_and_completion(server, assets):
    """Every token's log-probability, echoed prompt and completion alike, and its top 3, equal the
    target's log-softmax there, computed here by a plain forward over the whole text."""
    _, target = assets
    res = complete(server, prompt=PROMPT, echo=True, logprobs=3, max_tokens=10)
    lp = res.choices[0].logprobs
    ids = [int(t[1:]) for t in lp.tokens]  # the word tokenizer's tokens: w<id>
    assert ids[: len(PROMPT)] == PROMPT and len(ids) == len(PROMPT) + 10
    lsm = log_softmax(target, ids)
    np.testing.assert_allclose(lp.token_logprobs[1:], lsm[np.arange(len(ids) - 1), ids[1:]], atol=2e-4)
    for i, top in enumerate(lp.top_logprobs[1:]):  # the 3 likeliest, and the token itself (vLLM's)
        want = set(np.argsort(-lsm[i])[:3].tolist()) | {ids[i + 1]}
        got = {int(t[1:]): v for t, v in top.items()}
        assert set(got) == want, i
        np.testing.assert_allclose([got[t] for t in sorted(want)], lsm[i, sorted(want)], atol=2e-4)


def test_the_sampling_extensions_reach_the_engine(server):
    greedy = complete(server, prompt=PROMPT, max_tokens=12).choices[0].text.split()
    assert (
        complete(server, prompt=PROMPT, max_tokens=12, temperature=1.5, seed=3, extra_body={"top_k": 1})
        .choices[0]
        .text.split()
        == greedy
    )
    penalized = complete(server, prompt=PROMPT, max_tokens=12, extra_body={"presence_penalty": 2.0})
    assert penalized.choices[0].text.split() != greedy
    stop = next(t for i, t in enumerate(greedy) if t not in greedy[:i] and i >= 2)  # first comes at i
    cut = complete(server, prompt=PROMPT, max_tokens=12, extra_body={"stop_token_ids": [int(stop[1:])]})
    assert cut.choices[0].text.split() == greedy[: greedy.index(stop)] and cut.choices[0].finish_reason == "stop"
    held = complete(
        server, prompt=PROMPT, max_tokens=12, extra_body={"stop_token_ids": [int(stop[1:])], "min_tokens": 12}
    )
    assert (
        held.choices[0].finish_reason == "length" and stop not in held.choices[0].text.split()[: greedy.index(stop) + 1]
    )


def test_completion_logprobs_streamed_and_whole_agree(server):
    whole = complete(server, prompt=PROMPT, logprobs=1).choices[0]
    assert whole.logprobs.tokens == whole.text.split()
    chunks = list(complete(server, prompt=PROMPT, logprobs=1, stream=True))
    tokens = [t for ch in chunks for t in (ch.choices[0].logprobs.tokens if ch.choices[0].logprobs else [])]
    assert tokens == whole.logprobs.tokens


def test_chat_logprobs_and_top_logprobs(server):
    res = chat(server, [{"role": "user", "content": "w5 w6"}], temperature=0, logprobs=True, top_logprobs=2)
    content = res.choices[0].logprobs.content
    assert [c.token for c in content] == res.choices[0].message.content.split()
    assert all(c.bytes == list(c.token.encode()) for c in content)
    off = chat(server, [{"role": "user", "content": "w5 w6"}], temperature=0, logprobs=False)
    assert off.choices[0].logprobs is None and off.choices[0].message.content == res.choices[0].message.content


# ---------------------------------------------------------------- chat messages, budgets


def test_content_parts_null_content_and_the_tool_role(server):
    messages = [
        {"role": "developer", "content": [{"type": "text", "text": "w5"}, {"type": "text", "text": " w6"}]},
        {"role": "assistant", "content": None},
        {"role": "tool", "content": "w7", "tool_call_id": "call-1"},
    ]
    res = chat(server, messages, temperature=0)
    # the word tokenizer's template: w2 <content> w3 per message, then w4
    assert res.usage.prompt_tokens == len([2, 5, 6, 3, 2, 3, 2, 7, 3, 4])


def test_max_tokens_defaults_and_max_completion_tokens(server):
    res = client(server).completions.create(model="tiny", prompt=PROMPT, temperature=0)
    assert res.usage.completion_tokens == 16 and res.choices[0].finish_reason == "length"  # OpenAI's default
    res = client(server).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "w5"}], temperature=0, max_completion_tokens=5
    )
    assert res.usage.completion_tokens == 5
    res = client(server).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "w5"}], temperature=0
    )
    room = MAX_LEN - res.usage.prompt_tokens - 2 * K  # the slot's room: prompt + new tokens + 2K positions
    assert res.choices[0].finish_reason == "length" and 0 < room - res.usage.completion_tokens <= 2 * K


# ---------------------------------------------------------------- vLLM's extensions


def test_vllm_sampling_extensions_are_accepted(server):
    extra = {
        "ignore_eos": False,
        "min_tokens": 2,
        "top_k": 5,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "stop_token_ids": [],
        "skip_special_tokens": True,
        "include_stop_str_in_output": False,
    }
    res = complete(server, prompt=PROMPT, presence_penalty=0, frequency_penalty=0, logit_bias={}, extra_body=extra)
    assert res.choices[0].text == complete(server, prompt=PROMPT).choices[0].text


def test_include_stop_str_in_output_and_skip_special_tokens(server):
    words = complete(server, prompt=PROMPT, max_tokens=12).choices[0].text.split()
    j = next(j for j in range(2, 12) if words[j] not in words[:j])
    cut = complete(server, prompt=PROMPT, max_tokens=12, stop=[words[j]])
    kept = complete(
        server, prompt=PROMPT, max_tokens=12, stop=[words[j]], extra_body={"include_stop_str_in_output": True}
    )
    assert cut.choices[0].text.split() == words[:j] and kept.choices[0].text.split() == words[: j + 1]
    assert cut.choices[0].finish_reason == kept.choices[0].finish_reason == "stop"
    # w0 is the word tokenizer's special (unknown) token: shown only when not skipped
    shown = complete(server, prompt=[0, 5], echo=True, max_tokens=1, extra_body={"skip_special_tokens": False})
    hidden = complete(server, prompt=[0, 5], echo=True, max_tokens=1)
    assert shown.choices[0].text.startswith("w0 w5") and hidden.choices[0].text.startswith("w5")


def test_continuous_usage_is_in_every_chunk(server):
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(complete(server, prompt=PROMPT, stream=True, stream_options=options))
    done = [ch.usage.completion_tokens for ch in chunks]
    assert all(ch.usage is not None for ch in chunks) and done == sorted(done) and done[-1] == 8
    assert chunks[-1].choices == []


# ---------------------------------------------------------------- refusals, unknown fields


def test_what_is_not_served_is_a_400_naming_the_field(server):
    with pytest.raises(openai.BadRequestError, match="response_format"):
        chat(server, [{"role": "user", "content": "w5"}], response_format={"type": "json_object"})
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with pytest.raises(openai.BadRequestError, match="tools"):
        chat(server, [{"role": "user", "content": "w5"}], tools=[tool])
    with pytest.raises(openai.BadRequestError, match="image"):
        chat(server, [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}])
    with pytest.raises(openai.BadRequestError, match="min_tokens"):
        complete(server, prompt=PROMPT, max_tokens=2, extra_body={"min_tokens": 3})
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        complete(server, prompt=PROMPT, logit_bias={"100000": 1})


def test_unknown_fields_are_served_and_named_in_one_log_line(server):
    status, _, text = request(
        server, "POST", "/v1/completions", {"model": "tiny", "prompt": "w5", "guided_regex": "x", "priority": 1}
    )
    assert status == 200, text
    lines = [line for line in server.stderr().splitlines() if "unknown fields were ignored" in line]
    assert len(lines) == 1 and "guided_regex" in lines[0] and "priority" in lines[0]


# ---------------------------------------------------------------- vLLM's metric names


def test_vllm_metric_names_count_what_was_served(server):
    labels = 'engine="0",model_name="tiny"'
    length = 'vllm:request_success_total{engine="0",finished_reason="length",model_name="tiny"}'
    before = server.metric(length)
    tokens = server.metric(f"vllm:generation_tokens_total{{{labels}}}")
    complete(server, prompt=PROMPT, max_tokens=9)
    assert server.metric(length) == before + 1
    assert server.metric(f"vllm:generation_tokens_total{{{labels}}}") == tokens + 9
    for name in (
        "vllm:prompt_tokens_total",
        "vllm:time_to_first_token_seconds_count",
        "vllm:inter_token_latency_seconds_count",
        "vllm:e2e_request_latency_seconds_count",
        "vllm:request_queue_time_seconds_count",
        "vllm:request_prompt_tokens_count",
        "vllm:request_generation_tokens_count",
        "vllm:spec_decode_num_drafts_total",
        "vllm:spec_decode_num_draft_tokens_total",
    ):
        assert server.metric(f"{name}{{{labels}}}") > 0, name
    drafts = server.metric(f"vllm:spec_decode_num_drafts_total{{{labels}}}")
    assert server.metric(f"vllm:spec_decode_num_draft_tokens_total{{{labels}}}") == K * drafts
    accepted = server.metric(f"vllm:spec_decode_num_accepted_tokens_total{{{labels}}}")
    per_pos = [
        server.metric(f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{labels},position="{p}"}}')
        for p in range(K)
    ]
    assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True)  # position p needs 0..p-1
    for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
        assert server.metric(f"{gauge}{{{labels}}}") == 0
    text = request(server, "GET", "/metrics")[2]
    assert "# TYPE vllm:time_to_first_token_seconds histogram" in text and "_created" not in text
