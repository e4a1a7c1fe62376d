"""The server's request side in process: bodies (`infer.serve.protocol`), the API key and Host
checks (`infer.serve.guard.Access`) and the test-only fault hook (`infer.serve.scheduler.Faults`)."""

from __future__ import annotations

import json

import pytest

from infer.serve.guard import Access
from infer.serve.protocol import MAX_DEPTH, ApiError, ChatRequest, CompletionRequest, parse
from infer.serve.scheduler import Faults


def completion(**fields) -> bytes:
    return json.dumps({"model": "m", "prompt": "w1", **fields}).encode()


def chat(**fields) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": "w1"}], **fields}).encode()


def refused(raw: bytes, kind=CompletionRequest, strict=False) -> ApiError:
    with pytest.raises(ApiError) as err:
        parse(raw, kind, strict)
    return err.value


# ---------------------------------------------------------------- malformed JSON is a 400, never a 500


@pytest.mark.parametrize(
    "raw, says",
    [
        (b"[" * 10_000 + b"]" * 10_000, "nested deeper"),
        (b'{"model": "m", "prompt": ' + b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1) + b"}", "nested deeper"),
        (b'{"model": "m", "prompt": "w1", "seed": ' + b"9" * 5000 + b"}", "5000 digits"),
        (b'{"model": "m", "prompt": "\\ud800"}', "lone surrogate"),
        (b'{"model": "m", "prompt": "w1", "\\udfff": 1}', "lone surrogate"),
        (b'{"model": "m", "prompt": "w1", "temperature": NaN}', "NaN is not JSON"),
        (b'{"model": "m", "prompt": "w1", "temperature": -Infinity}', "-Infinity is not JSON"),
        (b'{"model": "m", "prompt": "\xff\xfe"}', "not valid JSON"),
        (b'{"model": "m", "prompt": ', "not valid JSON"),
        (b"[1, 2]", "must be a JSON object"),
    ],
    ids=[
        "deep 10000",
        "deep 33",
        "5000 digits",
        "surrogate",
        "surrogate key",
        "NaN",
        "-Infinity",
        "bad utf-8",
        "cut",
        "list",
    ],
)
def test_malformed_json_is_a_400_naming_why(raw, says):
    err = refused(raw)
    assert err.status == 400 and says in err.message and "\n" not in err.message


def test_a_body_as_deep_as_allowed_parses():
    nested = {"model": "m", "prompt": "w1"}
    extra = 1
    for _ in range(MAX_DEPTH - 1):
        extra = [extra]
    body, unknown = parse(json.dumps({**nested, "x": extra}).encode(), CompletionRequest)
    assert body.prompt == "w1" and unknown == ["x"]


# ---------------------------------------------------------------- fields


def test_explicit_off_values_are_accepted():
    body, unknown = parse(
        completion(
            logprobs=False,
            echo=False,
            response_format={"type": "text"},
            presence_penalty=0,
            frequency_penalty=0,
            logit_bias={},
            stream_options=None,
            temperature=None,
            top_p=None,
            max_tokens=None,
            best_of=1,
            suffix=None,
        ),
        CompletionRequest,
    )
    assert unknown == [] and body.logprob_count() is None
    body, _ = parse(chat(logprobs=False, top_logprobs=None, tools=None, tool_choice="none"), ChatRequest)
    assert body.logprob_count() is None
    body, _ = parse(chat(logprobs=True, top_logprobs=3), ChatRequest)
    assert body.logprob_count() == 3


def test_vllm_extensions_and_openai_fields_parse():
    body, unknown = parse(
        completion(
            ignore_eos=True,
            min_tokens=2,
            top_k=-1,
            min_p=0.1,
            repetition_penalty=1.1,
            skip_special_tokens=False,
            include_stop_str_in_output=True,
            stop_token_ids=[3],
            logprobs=2,
            echo=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        ),
        CompletionRequest,
    )
    assert unknown == [] and body.logprob_count() == 2 and body.stream_options.continuous_usage_stats


@pytest.mark.parametrize(
    "prompt, prompts",
    [("w1", ["w1"]), ([1, 2], [[1, 2]]), (["w1", "w2"], ["w1", "w2"]), ([[1], [2, 3]], [[1], [2, 3]])],
)
def test_prompts_in_every_shape(prompt, prompts):
    body, _ = parse(completion(prompt=prompt), CompletionRequest)
    assert body.prompts() == prompts


def test_chat_content_parts_null_and_tool_role():
    messages = [
        {"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": None},
        {"role": "tool", "content": "r", "tool_call_id": "c1"},
    ]
    body, unknown = parse(json.dumps({"model": "m", "messages": messages}).encode(), ChatRequest)
    assert unknown == []
    assert body.conversation() == [
        {"role": "system", "content": "ab"},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": ""},
        {"role": "tool", "content": "r"},
    ]


@pytest.mark.parametrize(
    "raw, kind, param",
    [
        (completion(n=0), CompletionRequest, "n"),
        (completion(n=17), CompletionRequest, "n"),
        (completion(stop=["x"] * 17), CompletionRequest, "stop"),
        (completion(stop="x" * 257), CompletionRequest, "stop"),
        (completion(stop=[""]), CompletionRequest, "stop"),
        (completion(stop_token_ids=list(range(65))), CompletionRequest, "stop_token_ids"),
        (completion(logit_bias={"x1": 1}), CompletionRequest, "logit_bias"),
        (completion(response_format={"type": "json_object"}), CompletionRequest, "response_format"),
        (completion(max_tokens=0), CompletionRequest, "max_tokens"),
        (completion(prompt=[]), CompletionRequest, "prompt"),
        (completion(prompt=["w1"] * 65), CompletionRequest, "prompt"),
        (completion(suffix="tail"), CompletionRequest, "suffix"),
        (completion(best_of=3), CompletionRequest, "best_of"),
        (chat(tools=[{"type": "function", "function": {"name": "f"}}]), ChatRequest, "tools"),
        (chat(tool_choice="required"), ChatRequest, "tool_choice"),
        (chat(top_logprobs=2), ChatRequest, "top_logprobs"),
        (chat(messages=[]), ChatRequest, "messages"),
        (chat(max_completion_tokens=0), ChatRequest, "max_tokens"),
        (
            chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
            ChatRequest,
            "messages.0.content.0",
        ),
    ],
)
def test_values_not_served_are_a_400_naming_the_field(raw, kind, param):
    err = refused(raw, kind)
    assert (err.status, err.param) == (400, param) and err.message.startswith(param)


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"max_tokens": "5"}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"logit_bias": {"1": 101}}, "logit_bias.1"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": True}, "logprobs"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"seed": -1}, "seed"),
        ({"prompt": 5}, "prompt"),
        ({"stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    ],
)
def test_wrong_types_and_ranges_are_a_422_naming_the_field(fields, param):
    err = refused(completion(**fields))
    assert (err.status, err.param) == (422, param) and err.message.startswith(param)


def test_unknown_fields_are_named_and_strict_refuses_them():
    raw = chat(guided_json={"a": 1}, messages=[{"role": "user", "content": "w1", "reasoning": "x"}])
    _, unknown = parse(raw, ChatRequest)
    assert sorted(unknown) == ["guided_json", "messages.0.reasoning"]
    err = refused(raw, ChatRequest, strict=True)
    assert err.status == 422 and err.param in unknown and "unknown field" in err.message


# ---------------------------------------------------------------- keys, hosts, the fault hook


def test_api_keys_bearer_only_every_key():
    access = Access(keys=(b"key-one", b"key-two"))
    assert access.key_ok("Bearer key-one") and access.key_ok("bearer key-two")
    for header in ("", "Bearer", "Bearer key-three", "Basic key-one", "key-one", "Bearer key-on", "Bearer key-one2"):
        assert not access.key_ok(header), header
    assert access.needs_key("/v1/completions") and access.needs_key("/v1") and not access.needs_key("/health")
    assert Access(keys=(b"k",), open_probes=False).needs_key("/metrics")
    assert not Access().needs_key("/v1/completions")


def test_host_allow_list():
    access = Access(hosts=("localhost", "127.0.0.1", "::1"))
    for host in ("localhost:8000", "LOCALHOST", "127.0.0.1", "[::1]:80"):
        assert access.host_ok(host), host
    for host in ("evil.example:8000", "", "127.0.0.2"):
        assert not access.host_ok(host), host
    assert Access().host_ok("anything")


def test_fault_hook_raises_at_the_nth_and_refuses_a_bad_spec():
    faults = Faults("step:3")
    faults.hit("step")
    faults.hit("prefill")
    faults.hit("step")
    with pytest.raises(RuntimeError, match="injected fault"):
        faults.hit("step")
    faults.hit("step")  # once only
    Faults(None).hit("prefill")
    both = Faults("prefill:1,step:2")
    both.hit("step")
    with pytest.raises(RuntimeError, match="prefill 1"):
        both.hit("prefill")
    with pytest.raises(RuntimeError, match="step 2"):
        both.hit("step")
    for spec in ("step", "step:0", "round:1", "prefill:x"):
        with pytest.raises(ValueError, match="PEAGLE_SERVE_FAULT"):
            Faults(spec)
