"""The engine's decode slots (`peagle_jax.engine.slots`), in process: rows inserted and released
between rounds decode exactly as each prompt alone, and a row's sampling is its own."""

from __future__ import annotations

import hf_tiny
import numpy as np
import pytest

import peagle_jax as pj
from infer import SpeculativeDecoder
from peagle_jax.engine import SamplingParams, Slots, row_key

K, NEW = 3, 12
ROWS, LENGTH = 3, 128  # one shape for every test: one compile of each program


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("slots") / "target"
    hf_tiny.build("llama-gqa2-tied-llama3", folder)
    hf_tiny.edit_config(folder, lambda c: c.update(max_position_embeddings=1024))  # long prompts; rope does not read it
    target = pj.load_target(folder, dtype="float32")
    return SpeculativeDecoder(target, pj.new_drafter(target, num_layers=1, mode="parallel", seed=1), k=K)


def params(n, temperature=0.0, top_p=1.0, seed=0) -> SamplingParams:
    return SamplingParams(n, temperature, top_p, seed=seed)


def drain(slots: Slots, requests: list[tuple]) -> list[list[int]]:
    """Every request through `slots`, admitted into free rows between steps and prefilled piece
    by piece beside the decoding ones, as a server does."""
    got = [[] for _ in requests]
    waiting = list(range(len(requests)))
    while waiting or slots.holders:
        free = slots.free()
        admitted, waiting = waiting[: len(free)], waiting[len(free) :]
        asked = [(requests[i][0], params(*requests[i][1:])) for i in admitted]
        slots.admit([(ids, p, row_key(p.seed, 0)) for ids, p in asked], admitted)
        news = slots.prefill() if slots.filling else []
        news += slots.step() if slots.running else []
        for n in news:
            got[n.holder] += n.ids
    return got


def test_rows_that_come_and_go_decode_as_each_prompt_alone(decoder):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, hf_tiny.VOCAB, size=int(n)).tolist() for n in (3, 70, 9, 1, 40, 17, 5)]
    budgets = [NEW, 4, NEW, 1, 7, NEW, 2]
    want = [decoder.generate([p], max_new_tokens=n).tokens[0] for p, n in zip(prompts, budgets)]
    got = drain(Slots(decoder.engine, ROWS, LENGTH), [(p, n) for p, n in zip(prompts, budgets)])
    assert got == want


def test_sampled_rows_keep_their_draws_and_leave_greedy_rows_alone(decoder):
    prompt = [5, 6, 7, 8]
    alone = drain(Slots(decoder.engine, ROWS, LENGTH), [(prompt, NEW, 0.9, 0.9, 42)])[0]
    crowd = [(prompt, NEW, 0.9, 0.9, 42), ([9, 10], NEW, 1.0, 1.0, 7), (prompt, NEW), ([11], NEW, 0.7, 0.5, 3)]
    got = drain(Slots(decoder.engine, ROWS, LENGTH), crowd)
    assert got[0] == alone
    assert got[2] == decoder.generate([prompt], max_new_tokens=NEW).tokens[0]
    others = drain(Slots(decoder.engine, ROWS, LENGTH), [(prompt, NEW, 0.9, 0.9, s) for s in (43, 44, 45)])
    assert any(o != alone for o in others)  # the seed is used


def test_a_released_row_stops_and_its_slot_takes_the_next_prompt(decoder):
    slots = Slots(decoder.engine, ROWS, LENGTH)
    slots.admit([([5, 6], params(NEW), row_key(0, 0))], ["a"])
    slots.prefill()
    before = slots.engine.read(slots.state, slots.start, 4)
    slots.release([0])
    assert slots.step(1) == [] and slots.free() == list(range(ROWS))
    after = slots.engine.read(slots.state, slots.start, 4)
    assert after.end[0] == before.end[0] and after.done[0]
    assert drain(slots, [([7, 8, 9], NEW)])[0] == decoder.generate([[7, 8, 9]], max_new_tokens=NEW).tokens[0]


def test_long_prompts_prefilled_in_pieces_decode_as_each_prompt_alone(decoder):
    """A prefill call runs at most 128 prompt tokens, fewer while rows decode (`Slots.budget`):
    prompts of up to 200 tokens go in pieces (several prompts a call when they are short), beside
    rows that decode."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(1, hf_tiny.VOCAB, size=int(n)).tolist() for n in (200, 3, 130, 64, 65, 7)]
    budgets = [NEW, NEW, 5, NEW, 1, NEW]
    want = [decoder.generate([p], max_new_tokens=n).tokens[0] for p, n in zip(prompts, budgets)]
    slots = Slots(decoder.engine, ROWS, 256, prefill_tokens=128)
    assert drain(slots, [(p, n) for p, n in zip(prompts, budgets)]) == want
    assert slots.shapes()["prefill"] == [
        (1, 16),
        (1, 32),
        (1, 64),
        (1, 128),
        (2, 16),
        (2, 32),
        (2, 64),
        (3, 16),
        (3, 32),
    ]


def test_a_prefill_call_takes_a_steps_worth_beside_a_full_batch_and_more_while_it_fills(decoder):
    slots = Slots(decoder.engine, 16, 256, prefill_tokens=512, abstract=True)
    step = decoder.engine.k + 1  # tokens a decoding slot verifies a step

    def budget(decoding: int) -> int:
        slots.holders = dict.fromkeys(range(decoding), "x")
        return slots.budget()

    assert budget(0) == 512
    assert budget(1) == 512  # 15 of 16 slots empty: 480 tokens, the next power of two
    assert budget(8) == 256
    assert budget(13) == 128  # 96 tokens
    assert budget(15) == max(16, 1 << (15 * step).bit_length() - 1)  # a full batch: a step's worth
    assert budget(16) == 1 << (16 * step).bit_length() - 1


def test_a_request_asking_for_its_prompts_logprobs_gets_them_piece_by_piece(decoder):
    prompt = [3 + i * 7 % 90 for i in range(147)]  # 147 tokens: three pieces of 64
    slots = Slots(decoder.engine, ROWS, 256, prefill_tokens=64)
    p = SamplingParams(4, prompt_logprobs=2)
    slots.admit([(prompt, p, row_key(0, 0))], ["x"])
    news = []
    while not news:
        news = slots.prefill()
    got = news[0].prompt_logprobs
    logits = np.asarray(decoder.target.forward(np.asarray([prompt])).logits[0], np.float64)
    lsm = logits - logits.max(-1, keepdims=True)
    lsm -= np.log(np.exp(lsm).sum(-1, keepdims=True))
    assert len(got) == len(prompt) - 1
    np.testing.assert_allclose([lp for lp, _ in got], lsm[np.arange(len(prompt) - 1), prompt[1:]], atol=1e-4)
    assert [[t for t, _ in top] for _, top in got] == np.argsort(-lsm[:-1], axis=-1)[:, :2].tolist()


def test_a_prompt_that_does_not_fit_is_refused(decoder):
    slots = Slots(decoder.engine, 1, 64)
    assert slots.max_new_tokens(64 - 2 * K - 2) == 0
    with pytest.raises(ValueError, match="does not fit the KV cache of 64 positions"):
        slots.admit([([1] * 60, params(10), row_key(0, 0))], [None])
    assert slots.free() == [0]
