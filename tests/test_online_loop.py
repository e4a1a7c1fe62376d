"""bench.online_loop's decisions made before anything runs (the prompt split, the requests, the
fine-tune's steps), the swap's verdict, and (slow tier) the whole loop on the tiny preset target:
a head trained, traffic served and logged, a fine-tune on the log, the swap under traffic and
both heads measured."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import online_plan as plan
from bench.online_swap import verdict

ROOT = Path(__file__).resolve().parents[1]


def test_the_split_holds_out_prompts_never_served_and_is_the_same_for_a_seed():
    served, heldout = plan.split_prompts(164, 34, seed=0)
    assert len(heldout) == 34 and len(served) == 130 and not set(served) & set(heldout)
    assert (served, heldout) == plan.split_prompts(164, 34, seed=0) != plan.split_prompts(164, 34, seed=1)
    with pytest.raises(ValueError, match="--heldout must be between 1 and 163"):
        plan.split_prompts(164, 164, seed=0)


def test_each_served_prompt_is_first_greedy_then_sampled_with_seeds_of_its_own():
    served = list(range(0, 20, 2))
    requests = plan.plan_requests(served, 25, max_tokens=64, temperature=0.7, seed=3)
    assert [r["index"] for r in requests] == list(range(25))
    first = requests[: len(served)]
    assert sorted(r["prompt"] for r in first) == served and all(r["temperature"] == 0 for r in first)
    later = requests[len(served) :]
    assert all(r["temperature"] == 0.7 and r["seed"] == r["index"] for r in later)
    assert {r["prompt"] for r in later} <= set(served)


def test_the_step_time_leaves_out_the_compile_and_the_budget_holds_whole_steps(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    ends, tokens = [30.0, 32.0, 34.0, 36.0, 38.0], 100  # a 30 s first step, then 2 s a step
    lines = [{"step": i, "tokens": tokens, "tokens_per_second": tokens * (i + 1) / end} for i, end in enumerate(ends)]
    metrics.write_text("".join(json.dumps(x) + "\n" for x in lines) + json.dumps({"eval": 1}) + "\n")
    assert plan.step_seconds(metrics) == pytest.approx(2.0)
    assert plan.steps_for(600, 2.0) == 300 and plan.steps_for(1, 2.0) == 1


def test_the_verdict_counts_drops_and_changed_greedy_answers_across_the_swap():
    def res(index, sent, end, ok=True, text="a"):
        return {"index": index, "sent": sent, "end": end, "ok": ok, "text": text, "status": 200, "error": None}

    results = [
        ({"prompt": 0, "temperature": 0}, res(0, 0.0, 1.0)),  # before the swap
        ({"prompt": 0, "temperature": 0}, res(1, 1.0, 5.0, text="b")),  # across it, changed
        ({"prompt": 1, "temperature": 0.7}, res(2, 2.0, 6.0, ok=False)),  # across it, dropped
    ]
    swap = {"swap_started": 2.5, "swap_done": 3.0, "results": results, "status": 200, "swap_seconds": 0.5}
    got = verdict(swap | {"compiles": 0}, {0: "a", 1: "c"})
    assert got["wave"] == {"requests": 3, "greedy": 2, "dropped": 1, "changed": 1}
    assert got["across_swap"] == {"requests": 2, "greedy": 1, "dropped": 1, "changed": 1}
    assert got["compiles"] == 0 and len(got["failures"]) == 1


@pytest.mark.slow  # the whole loop on the tiny preset target: about two minutes of the 2-core CI
def test_the_smoke_loop_swaps_without_a_drop_or_a_compile_and_measures_both_heads(tmp_path):
    out = tmp_path / "loop.json"
    cmd = [sys.executable, "-m", "bench.online_loop", "--smoke", "--work", str(tmp_path / "work"), "--json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    raw = json.loads(out.read_text())["raw"]
    swap = raw["swap"]
    assert swap["compiles"] == 0 and swap["across_swap"]["requests"] > 0
    # greedy answers are compared for dropped requests only: on this random target (near-tied
    # logits) an answer can change with the rows it shares a step with, swap or not
    assert swap["wave"]["dropped"] == 0 and swap["across_swap"]["dropped"] == 0
    for name in ("heldout", "other"):  # greedy: the target's tokens whoever drafts
        assert raw["acceptance"][name]["identical"] == raw["acceptance"][name]["prompts"]
    assert raw["traffic"]["failed"] == 0 and raw["traffic"]["logged"] > 0
