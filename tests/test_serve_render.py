"""The server's response side in process: OpenAI's logprobs objects built from constructed
scheduler events (`infer.serve.render`), and the spec-decode counters (`infer.serve.metrics`)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from infer.serve import render
from infer.serve.metrics import ServerMetrics, one_two_five
from infer.serve.scheduler import TokenLogprob

WORDS = {1: "a", 2: "bb", 3: "ccc", 4: "é"}


def decode(token: int) -> str:
    return WORDS[token]


def test_completion_logprobs_tokens_values_tops_and_offsets():
    entries = [
        None,  # a prompt's first token (echo): nothing precedes it
        TokenLogprob(-0.5, ((2, -0.5), (3, -1.5))),
        TokenLogprob(-2.0, ((1, -0.1), (3, -2.0))),
        TokenLogprob(-math.inf, ()),
    ]
    got = render.completion_logprobs([1, 2, 3, 4], entries, decode, offset=10)
    assert got["tokens"] == ["a", "bb", "ccc", "é"]
    assert got["token_logprobs"] == [None, -0.5, -2.0, -9999.0]
    # the emitted token first, then the most likely ones (OpenAI: at most logprobs + 1 entries)
    assert got["top_logprobs"] == [None, {"bb": -0.5, "ccc": -1.5}, {"ccc": -2.0, "a": -0.1}, {"é": -9999.0}]
    assert list(got["top_logprobs"][2]) == ["ccc", "a"]
    assert got["text_offset"] == [10, 11, 13, 16]


def test_chat_logprobs_content_with_bytes_and_top_lists():
    entries = [TokenLogprob(-0.25, ((4, -0.25), (1, -3.0))), TokenLogprob(-1.0, ())]
    got = render.chat_logprobs([4, 1], entries, decode)
    assert got == {
        "content": [
            {
                "token": "é",
                "logprob": -0.25,
                "bytes": [0xC3, 0xA9],
                "top_logprobs": [
                    {"token": "é", "logprob": -0.25, "bytes": [0xC3, 0xA9]},
                    {"token": "a", "logprob": -3.0, "bytes": [97]},
                ],
            },
            {"token": "a", "logprob": -1.0, "bytes": [97], "top_logprobs": []},
        ]
    }


def test_pieces_join_into_one_logprobs_object():
    first = render.completion_logprobs([1], [TokenLogprob(-1.0)], decode, 0)
    second = render.completion_logprobs([2, 3], [TokenLogprob(-2.0), TokenLogprob(-3.0)], decode, 1)
    joined = render.join_logprobs([first, second], chat=False)
    assert joined == render.completion_logprobs([1, 2, 3], [TokenLogprob(-x) for x in (1.0, 2.0, 3.0)], decode, 0)
    chats = [render.chat_logprobs([1], [TokenLogprob(-1.0)], decode), render.chat_logprobs([2], [None], decode)]
    assert [c["token"] for c in render.join_logprobs(chats, chat=True)["content"]] == ["a", "bb"]
    assert render.join_logprobs([], chat=True) is None


def test_chunks_and_choices_have_openais_fields():
    assert render.delta(2, "x", None, None, chat=True) == {
        "index": 2,
        "delta": {"content": "x"},
        "logprobs": None,
        "finish_reason": None,
    }
    assert render.delta(0, "", None, None, chat=True, first=True)["delta"] == {"role": "assistant", "content": ""}
    assert render.delta(1, None, "stop", None, chat=False) == {
        "index": 1,
        "text": "",
        "logprobs": None,
        "finish_reason": "stop",
    }
    assert render.choice(0, "hi", "length", None, chat=True)["message"] == {"role": "assistant", "content": "hi"}
    assert render.envelope("x", 5, "m", chat=False, chunk=True)["object"] == "text_completion"
    assert render.envelope("x", 5, "m", chat=True, chunk=True)["object"] == "chat.completion.chunk"
    assert render.usage(3, 4) == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}


# ---------------------------------------------------------------- spec-decode counters


def counts(m: ServerMetrics) -> tuple:
    labels = {"model_name": "m", "engine": "0"}
    value = m.registry.get_sample_value
    per_pos = [
        value("vllm:spec_decode_num_accepted_tokens_per_pos_total", {**labels, "position": str(p)}) for p in range(3)
    ]
    names = ("drafts", "draft_tokens", "accepted_tokens")
    return tuple(value(f"vllm:spec_decode_num_{n}_total", labels) for n in names) + (per_pos,)


def test_spec_decode_counters_from_round_results():
    m = ServerMetrics(k=3, batch=2, model="m", max_len=64)
    m.drafts(emitted=1, rounds=1, done=False)  # nothing accepted
    m.drafts(emitted=3, rounds=1, done=False)  # positions 0, 1
    m.drafts(emitted=4, rounds=1, done=True)  # all K accepted in its last round: exact
    m.drafts(emitted=2, rounds=1, done=True)  # cut by an eos or the budget: not known, not counted
    assert counts(m) == (3, 9, 0 + 2 + 3, [2, 2, 1])
    m.drafts(emitted=7, rounds=3, done=False)  # several rounds: the sums are exact (7 - 3 accepted)
    assert counts(m)[:3] == (6, 18, 9)


def test_spec_decode_counters_from_the_engines_acceptance_histogram():
    m = ServerMetrics(k=3, batch=2, model="m", max_len=64)
    m.rounds_accepted([2, 1, 0, 3])  # 6 rounds: two accepted nothing, one 1 draft, three all 3
    assert counts(m) == (6, 18, 1 + 9, [4, 3, 3])
    m.rounds_accepted(np.array([0, 0, 1, 0]))
    assert counts(m) == (7, 21, 12, [5, 4, 3])


def test_plain_decoding_has_no_spec_decode_counters():
    m = ServerMetrics(k=0, batch=2, model="m", max_len=64)
    m.drafts(emitted=1, rounds=1, done=False)
    assert b"spec_decode" not in m.text()


@pytest.mark.parametrize(
    "top, want", [(1, (1,)), (64, (1, 2, 5, 10, 20, 50)), (1000, (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000))]
)
def test_request_token_buckets_are_vllms(top, want):
    assert one_two_five(top) == want


def test_the_dashboard_reads_only_metrics_the_server_exposes():
    import json
    import re
    from pathlib import Path

    dashboard = json.loads((Path(__file__).resolve().parent.parent / "docs" / "grafana-dashboard.json").read_text())
    exprs = " ".join(t["expr"] for p in dashboard["panels"] for t in p["targets"])
    names = set(re.findall(r"vllm:[a-z0-9_]+", exprs))
    exposed = ServerMetrics(k=3, batch=2, model="m", max_len=64).text().decode()
    assert len(names) >= 10
    for name in names:
        assert re.search(rf"^{re.escape(name)}[{{ ]", exposed, re.M), name
