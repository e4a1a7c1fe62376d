"""`python -m train` on a server's request log (`--data.source LOGDIR`) and from an existing head
(`--model.init_head HEAD`): the log read as conversations (deduplicated, the newest held out,
never regenerated, a note for another target's log), a run that trains and evaluates on it, a
fine-tune that starts from the head's own weights and resumes, and the flags that contradict it."""

from __future__ import annotations

import json
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
from in_process import run_module

import train.__main__ as entry
from peagle_jax.conversations.chat import encode_prompt, encode_training
from peagle_jax.conversations.request_log import Acceptance, Head, Request, shard_files
from peagle_jax.conversations.request_log_writer import RequestLog
from train.data import other_targets, synthetic_conversations
from train.flags import parse_args
from train.loop import load_data
from train.tiny import tokenizer as tiny_tokenizer
from train.trainer import Hook

T0 = 1_700_000_000.0
N = 30  # requests served; the first 4 are asked again later (the same answers): 34 lines
QUIET = ["--loop.progress", "false"]


def served(i: int, conv: list[dict], t: float, target: str) -> Request:
    """A request the server might have logged for synthetic conversation `conv`: every third one
    a chat, a completion of text, a completion of token ids."""
    tok = tiny_tokenizer()
    user, answer = conv[0]["content"], conv[1]["content"]
    common = dict(
        id=f"req-{i}",
        time=t,
        model="tiny",
        target=target,
        head=Head("heads/tiny", "0f" * 8),
        completion=answer,
        completion_ids=tok(answer, add_special_tokens=False)["input_ids"],
        sampling={"temperature": 0.0, "max_tokens": 64},
        finish_reason="stop",
        acceptance=Acceptance(3, [2, 1, 0], 2.0),
        seconds=0.5,
    )
    if i % 3 == 0:
        return Request(kind="chat", messages=conv[:1], prompt=None, prompt_ids=encode_prompt(tok, conv[:1]), **common)
    prompt = user if i % 3 == 1 else None
    return Request(kind="completion", messages=None, prompt=prompt, prompt_ids=tok(user)["input_ids"], **common)


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    from train.tiny import build_tiny_target

    return build_tiny_target(tmp_path_factory.mktemp("tiny") / "target")


@pytest.fixture(scope="module")
def log(tmp_path_factory):
    """(folder, requests in time order) of a log written by `RequestLog`, target "org/other",
    plus one finished shard with a malformed line (skipped and counted)."""
    folder = tmp_path_factory.mktemp("served") / "log"
    convs = synthetic_conversations(N, seed=3)
    requests = [served(i, c, T0 + i, "org/other") for i, c in enumerate(convs)]
    requests += [served(i, convs[i], T0 + N + i, "org/other") for i in range(4)]  # asked again
    with RequestLog(folder, 3000, target="org/other") as writer:
        for r in requests:
            writer.append(r)
    assert len(shard_files(folder)) > 1
    (folder / "requests-20000101T000000Z-999999.jsonl").write_text('{"id": "broken"\n')
    return folder, requests


def _flags(out, target, source, *extra) -> list[str]:
    return ["--preset", "tiny", "--out", str(out), "--model.target", str(target), "--data.source", str(source), *extra]


# ---------------------------------------------------------------------------------------
# the log as training data
def test_the_log_is_read_as_conversations_deduplicated_the_newest_held_out(log, tmp_path):
    folder, requests = log
    tok = tiny_tokenizer()
    cfg = parse_args(_flags(tmp_path / "out", "tiny", folder, "--data.heldout", "5"))
    ds = load_data(cfg, tok, tmp_path / "out")
    assert ds.stats["request_log"] == {
        "requests": N + 4,
        "duplicates": 4,
        "used": N,
        "targets": ["org/other"],
        "regenerated": False,
    }
    assert ds.stats["skipped_malformed"] == 1  # the broken line, named and skipped (data.bad_rows skip)
    assert (len(ds.train), len(ds.heldout)) == (N - 5, 5)

    def encoded(r: Request) -> list[int]:
        if r.kind == "chat":
            return encode_training(tok, r.conversation())[0][: cfg.data.max_len]
        prompt = tok(r.prompt)["input_ids"] if r.prompt is not None else r.prompt_ids
        return (list(prompt) + list(r.completion_ids))[: cfg.data.max_len]

    firsts = requests[:N]  # time order; the repeats are dropped
    assert [e.ids.tolist() for e in ds.heldout] == [encoded(r) for r in firsts[-5:]]  # the newest five
    assert [e.ids.tolist() for e in ds.train] == [encoded(r) for r in firsts[:-5]]
    ids_only = next(e for e, r in zip(ds.train, firsts) if r.kind == "completion" and r.prompt is None)
    n = len(firsts[2].prompt_ids)
    assert not ids_only.mask[:n].any() and ids_only.mask[n:].all()  # the answer alone is supervised

    newest = load_data(
        parse_args(_flags(tmp_path / "o2", "tiny", folder, "--data.max_conversations", "10")), tok, tmp_path
    )
    assert newest.stats["request_log"]["used"] == 10
    assert [e.ids.tolist() for e in newest.heldout] == [encoded(r) for r in firsts[-4:]]


def test_a_log_of_another_target_is_told_apart_by_name():
    assert other_targets(["org/tiny-target"], "tiny", "/runs/x/tiny-target") == []
    assert other_targets(["/models/gemma"], "google/gemma", "/cache/snapshot/abc") == []
    assert other_targets(["org/other", "tiny"], "tiny", "/runs/x/tiny-target") == ["org/other"]


def test_training_on_the_log_trains_and_evaluates_without_regenerating(log, tiny_target, tmp_path):
    folder, _ = log
    out = tmp_path / "out"
    flags = _flags(out, tiny_target, folder, "--loop.steps", "3", "--data.regenerate", "true", *QUIET)
    proc = run_module("train", flags)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 3 and np.isfinite(summary["final_loss"])
    assert summary["data"]["request_log"]["regenerated"] is False and not (out / "regenerated.jsonl").exists()
    assert summary["data"]["heldout"] == 4 and summary["heldout_rounds"]["conversations"] == 4
    assert summary["eval"]["identical_to_greedy"] == 1.0 and summary["eval"]["by_k"]
    assert "not regenerated (data.regenerate skipped)" in proc.stdout
    note = [ln for ln in proc.stdout.splitlines() if "note: the request log" in ln]
    assert len(note) == 1 and "holds answers of org/other, not of model.target" in note[0], proc.stdout
    assert summary["data"]["request_log"]["target_note"] in note[0]


# ---------------------------------------------------------------------------------------
# --model.init_head
@pytest.fixture(scope="module")
def heads(tiny_target, tmp_path_factory):
    """Two saved heads for the tiny target: "tiny" of the tiny preset's shapes (48 draft ids, not
    the data's most frequent ones) and "wide" (2 layers, 56 draft ids)."""
    import peagle_jax as pj

    target = pj.load_target(tiny_target)
    root = tmp_path_factory.mktemp("heads")
    made = {
        "tiny": pj.new_drafter(target, 1, draft_vocab=np.arange(16, 64), seed=7, k_train=4),
        "wide": pj.new_drafter(target, 2, draft_vocab=np.arange(8, 64), seed=8, k_train=4),
    }
    return {name: head.save(root / name) for name, head in made.items()}


def _parsed(argv, capsys):
    """(exit status, the config the run would get, stderr): nothing is trained."""
    got = []
    with mock.patch.object(entry, "train", lambda cfg, hooks=(): got.append(cfg) or 0):
        rc = entry.main(argv)
    return rc, (got[0] if got else None), capsys.readouterr().err


def test_the_heads_settings_replace_the_presets(heads, capsys):
    rc, cfg, _ = _parsed(["--preset", "tiny", "--model.init_head", str(heads["wide"])], capsys)
    assert rc == 0
    assert (cfg.model.num_layers, cfg.model.draft_vocab, cfg.model.mode) == (2, 56, "parallel")
    rc, cfg, _ = _parsed(
        ["--preset", "tiny", "--model.init_head", str(heads["wide"]), "--model.num_layers", "2"], capsys
    )
    assert rc == 0 and cfg.model.num_layers == 2  # given, and the head's: no contradiction


@pytest.mark.parametrize(
    "flags,named",
    [
        (["--model.num_layers", "1"], ("--model.num_layers 1", "num_layers is 2")),
        (["--model.mode", "chain"], ("--model.mode chain", "mode is parallel")),
        (["--model.draft-vocab", "48"], ("--model.draft_vocab 48", "draft_vocab is 56")),
        (["--model.draft_vocab", "0"], ("--model.draft_vocab 0", "draft_vocab is 56")),
        (["--model.init_layer", "-1"], ("--model.init_layer -1", "starts from a trained one")),
    ],
)
def test_a_flag_that_contradicts_the_head_is_one_line_naming_both(heads, flags, named, capsys):
    rc, cfg, err = _parsed(["--preset", "tiny", "--model.init_head", str(heads["wide"]), *flags], capsys)
    lines = err.strip().splitlines()
    assert rc == 2 and cfg is None and len(lines) == 1 and lines[0].startswith("error: "), err
    assert all(part in lines[0] for part in named) and str(heads["wide"]) in lines[0], lines[0]


def test_a_contradicting_config_file_and_a_folder_that_is_no_head(heads, tmp_path, capsys):
    f = tmp_path / "run.yaml"
    f.write_text("model:\n  num_layers: 3\n")
    rc, _, err = _parsed(["--preset", "tiny", "--config", str(f), "--model.init_head", str(heads["wide"])], capsys)
    assert rc == 2 and "--model.num_layers 3 contradicts" in err
    rc, _, err = _parsed(["--preset", "tiny", "--model.init_head", str(tmp_path)], capsys)
    assert rc == 2 and err.startswith(f"error: --model.init_head {tmp_path}: ") and len(err.splitlines()) == 1


def test_the_trainer_starts_from_the_heads_weights(heads, tiny_target, tmp_path):
    import peagle_jax as pj
    from train.trainer import Trainer

    cfg = parse_args(_flags(tmp_path / "out", tiny_target, "synthetic", "--model.init_head", str(heads["tiny"])))
    trainer = Trainer(cfg, pj.load_target(tiny_target), steps=1)
    saved, start = pj.load_drafter(heads["tiny"]).arrays(), trainer.head().arrays()
    assert sorted(saved) == sorted(start)
    for name in saved:  # the parameters before the first update are the saved head's
        np.testing.assert_array_equal(start[name], saved[name], err_msg=str(name))
    assert trainer.drafter.config.k_train == 4 and trainer.drafter.config.verifier == str(tiny_target)


class StopAfter(Hook):
    """A run that fails after `step` (its checkpoint written): what a crash leaves to resume."""

    def __init__(self, step: int):
        self.step = step

    def after_step(self, trainer, rec):
        if trainer.step == self.step:
            raise RuntimeError("stopped by the test")


def test_a_fine_tune_exports_its_heads_shapes_and_resumes(heads, tiny_target, log, tmp_path):
    import peagle_jax as pj

    out = tmp_path / "out"
    flags = [
        *_flags(out, tiny_target, log[0], "--model.init_head", str(heads["tiny"])),
        *[
            "--loop.steps",
            "3",
            "--loop.checkpoint_every",
            "2",
            "--eval.enabled",
            "false",
            "--data.heldout",
            "0",
            *QUIET,
        ],
    ]
    assert entry.main([str(a) for a in flags], hooks=[StopAfter(2)]) == 1
    again = run_module("train", flags)
    assert again.returncode == 0, again.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resumed_from_step"] == 2 and summary["steps"] == 3
    assert summary["init_head"] == str(heads["tiny"])
    head, start = pj.load_drafter(out / "head"), pj.load_drafter(heads["tiny"])
    np.testing.assert_array_equal(head.d2t, start.d2t)  # its draft vocabulary, not the data's top 48
    moved = [k for k, v in start.arrays().items() if not np.array_equal(v, head.arrays()[k])]
    assert moved, "training changed nothing"
    exported = json.loads((Path(summary["vllm_dir"]) / "config.json").read_text())
    assert exported["draft_vocab_size"] == 48


def test_a_head_that_does_not_fit_the_target_is_one_line(tiny_target, tmp_path, capsys):
    import dataclasses

    import peagle_jax as pj

    target = pj.load_target(tiny_target)
    fresh = pj.new_drafter(target, 1, k_train=4)
    narrow = dataclasses.replace(fresh.config, target_hidden_size=32, hidden_size=32, intermediate_size=64)
    folder = pj.Drafter.random(narrow, seed=1).save(tmp_path / "narrow")
    flags = _flags(tmp_path / "out", tiny_target, "synthetic", "--model.init_head", str(folder), *QUIET)
    assert entry.main(flags) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not fit the target" in err[0] and "hidden size 32" in err[0], err
