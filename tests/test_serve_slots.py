"""The engine's decode slots (`peagle_jax.engine.slots`), in process: rows inserted and released
between rounds decode exactly as each prompt alone, and a row's sampling is its own."""

from __future__ import annotations

import hf_tiny
import numpy as np
import pytest

import peagle_jax as pj
from infer import SpeculativeDecoder
from peagle_jax.engine import Slots

K, NEW = 3, 12
ROWS, LENGTH = 3, 128  # one shape for every test: one compile of each program


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("slots") / "target"
    hf_tiny.build("llama-gqa2-tied-llama3", folder)
    target = pj.load_target(folder, dtype="float32")
    return SpeculativeDecoder(target, pj.new_drafter(target, num_layers=1, mode="parallel", seed=1), k=K)


def drain(slots: Slots, requests: list[tuple]) -> list[list[int]]:
    """Every request through `slots`, admitted into free rows between rounds, as a server does."""
    got = [[] for _ in requests]
    waiting, running = list(range(len(requests))), {}
    while waiting or running:
        for slot in [s for s in range(slots.batch) if s not in running]:
            if not waiting:
                break
            i = waiting.pop(0)
            row = slots.prefill(*requests[i])
            first, done = slots.first_tokens(row)
            got[i] += first
            if not done:
                slots.insert(row, slot)
                running[slot] = i
        if running:
            slots.round()
            news = slots.tokens()
            for slot, i in list(running.items()):
                got[i] += news.new(slot)
                if news.done[slot]:
                    del running[slot]
    return got


def test_rows_that_come_and_go_decode_as_each_prompt_alone(decoder):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, hf_tiny.VOCAB, size=int(n)).tolist() for n in (3, 70, 9, 1, 40, 17, 5)]
    budgets = [NEW, 4, NEW, 1, 7, NEW, 2]
    want = [decoder.generate([p], max_new_tokens=n).tokens[0] for p, n in zip(prompts, budgets)]
    got = drain(Slots(decoder, ROWS, LENGTH), [(p, n) for p, n in zip(prompts, budgets)])
    assert got == want


def test_sampled_rows_keep_their_draws_and_leave_greedy_rows_alone(decoder):
    prompt = [5, 6, 7, 8]
    alone = drain(Slots(decoder, ROWS, LENGTH), [(prompt, NEW, 0.9, 0.9, 42)])[0]
    crowd = [(prompt, NEW, 0.9, 0.9, 42), ([9, 10], NEW, 1.0, 1.0, 7), (prompt, NEW), ([11], NEW, 0.7, 0.5, 3)]
    got = drain(Slots(decoder, ROWS, LENGTH), crowd)
    assert got[0] == alone
    assert got[2] == decoder.generate([prompt], max_new_tokens=NEW).tokens[0]
    others = drain(Slots(decoder, ROWS, LENGTH), [(prompt, NEW, 0.9, 0.9, s) for s in (43, 44, 45)])
    assert any(o != alone for o in others)  # the seed is used


def test_a_released_row_stops_and_its_slot_takes_the_next_prompt(decoder):
    slots = Slots(decoder, ROWS, LENGTH)
    row = slots.prefill([5, 6], NEW)
    slots.first_tokens(row)
    slots.insert(row, 0)
    slots.release([0])
    slots.round()
    news = slots.tokens()
    assert news.new(0) == [] and news.done[0]
    assert drain(slots, [([7, 8, 9], NEW)])[0] == decoder.generate([[7, 8, 9]], max_new_tokens=NEW).tokens[0]


def test_a_prompt_that_does_not_fit_is_refused(decoder):
    slots = Slots(decoder, 1, 64)
    assert slots.max_new_tokens(64 - 2 * K - 2) == 0
    with pytest.raises(ValueError, match="do not fit 64 slots"):
        slots.prefill([1] * 60, 10)
