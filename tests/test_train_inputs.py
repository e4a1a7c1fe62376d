"""Bad input to `python -m train`: one clear line and a non-zero exit, or skipped and counted."""

from __future__ import annotations

import json

import pytest

from peagle_jax.runtime.command_line import UsageError
from train import config as C
from train.__main__ import main
from train.data import DataError, load_conversations, tokenize
from train.flags import parse_args
from train.tiny import tokenizer as tiny_tokenizer

GOOD = {"messages": [{"role": "user", "content": "w1 w2"}, {"role": "assistant", "content": "w3 w4 w5 w6"}]}


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    from train.tiny import build_tiny_target

    return str(build_tiny_target(tmp_path_factory.mktemp("tiny") / "target"))


def _err_line(capsys):
    err = capsys.readouterr().err.strip().splitlines()
    lines = [ln for ln in err if ln.startswith("error:")]
    assert len(lines) == 1, err
    return lines[0]


def test_unknown_field_names_the_closest(capsys):
    assert main(["--optim.lrr", "3e-4"]) == 2
    line = _err_line(capsys)
    assert "--optim.lrr" in line and "--optim.lr" in line


def test_unknown_field_in_a_config_file(tmp_path, capsys):
    f = tmp_path / "c.yaml"
    f.write_text("optim:\n  lr: 0.001\n  warmpu_steps: 3\n")
    assert main(["--config", str(f)]) == 2
    line = _err_line(capsys)
    assert "optim.warmpu_steps" in line and "optim.warmup_steps" in line


def test_config_file_and_overrides_precedence(tmp_path):
    f = tmp_path / "c.json"
    f.write_text(json.dumps({"optim": {"lr": 0.002, "clip": 1.0}, "loop": {"steps": 7}}))
    cfg = parse_args(["--preset", "tiny", "--config", str(f), "--optim.lr", "0.005"])
    assert (cfg.optim.lr, cfg.optim.clip, cfg.loop.steps, cfg.model.target) == (0.005, 1.0, 7, "tiny")


def test_unknown_preset_and_bad_values():
    with pytest.raises(UsageError, match="tiny"):
        parse_args(["--preset", "tin"])
    with pytest.raises(UsageError, match="data.too_long"):
        parse_args(["--data.too_long", "cut"])


def test_bool_words_as_the_docs_write_them():
    cfg = parse_args(["--eval.enabled", "false", "--data.regenerate=TRUE", "--loop.progress", "no"])
    assert (cfg.eval.enabled, cfg.data.regenerate, cfg.loop.progress) == (False, True, False)


def test_a_bad_value_is_one_line_naming_the_flag(capsys):
    assert main(["--loop.steps", "many"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:"), err  # tyro's multi-line box is not printed
    assert "--loop.steps" in err[0] and "many" in err[0]


def test_help_lists_fields_with_defaults(capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for name in ("--optim.lr", "--data.cache-features", "--model.draft-vocab", "--loop.keep", "--eval.ks"):
        assert name in out, name
    assert "default: 0.002" in out  # optim.lr


def _jsonl(tmp_path, rows):
    f = tmp_path / "d.jsonl"
    f.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return f


BAD_ROWS = [GOOD, "{not json", {"messages": "x"}, {"messages": [{"role": "user", "content": "w1"}]}, GOOD]


def test_malformed_rows_are_skipped_and_counted(tmp_path):
    f = _jsonl(tmp_path, BAD_ROWS)
    ex, stats = tokenize(
        load_conversations(str(f)), tiny_tokenizer(), template="auto", max_len=64, too_long="truncate", bad_rows="skip"
    )
    assert len(ex) == 2
    assert stats["skipped_malformed"] == 2 and stats["skipped_no_assistant"] == 1


def test_malformed_row_is_named_when_asked(tmp_path):
    f = _jsonl(tmp_path, BAD_ROWS)
    with pytest.raises(DataError, match=r"d.jsonl: line 2: invalid JSON"):
        tokenize(
            load_conversations(str(f)),
            tiny_tokenizer(),
            template="auto",
            max_len=64,
            too_long="truncate",
            bad_rows="error",
        )


def test_too_long_truncate_or_drop(tmp_path):
    long = {"messages": [{"role": "user", "content": "w1"}, {"role": "assistant", "content": " ".join(["w2"] * 80)}]}
    f = _jsonl(tmp_path, [GOOD, long])
    ex, stats = tokenize(
        load_conversations(str(f)), tiny_tokenizer(), template="auto", max_len=32, too_long="truncate", bad_rows="skip"
    )
    assert [len(e.ids) for e in ex][1] == 32 and stats["truncated"] == 1
    ex, stats = tokenize(
        load_conversations(str(f)), tiny_tokenizer(), template="auto", max_len=32, too_long="drop", bad_rows="skip"
    )
    assert len(ex) == 1 and stats["dropped_too_long"] == 1


def test_sharegpt_truncated_file_yields_its_complete_records(tmp_path):
    recs = [
        {"id": str(i), "conversations": [{"from": "human", "value": "w1"}, {"from": "gpt", "value": "w2 w3"}]}
        for i in range(3)
    ]
    text = json.dumps(recs)
    f = tmp_path / "s.json"
    f.write_text(text[: len(text) - 30])  # cut inside the last record
    got = list(load_conversations(str(f)))
    assert len(got) == 2
    ex, _ = tokenize(got, tiny_tokenizer(), template="auto", max_len=64, too_long="truncate", bad_rows="error")
    assert len(ex) == 2


def test_hf_datasets_parquet_folder(tmp_path):
    datasets = pytest.importorskip("datasets")
    d = tmp_path / "pq"
    d.mkdir()
    datasets.Dataset.from_list([GOOD, GOOD]).to_parquet(str(d / "part-0.parquet"))
    ex, _ = tokenize(
        load_conversations(str(d)), tiny_tokenizer(), template="auto", max_len=64, too_long="truncate", bad_rows="error"
    )
    assert len(ex) == 2


def test_empty_dataset_is_one_line(tmp_path, capsys, tiny_target):
    f = _jsonl(tmp_path, [{"messages": [{"role": "user", "content": "w1"}]}])
    assert (
        main(
            ["--preset", "tiny", "--out", str(tmp_path / "run"), "--model.target", tiny_target, "--data.source", str(f)]
        )
        == 1
    )
    assert "dataset is empty" in _err_line(capsys)


def test_target_the_drafter_does_not_fit(tmp_path, capsys, tiny_target):
    assert (
        main(
            [
                "--preset",
                "tiny",
                "--out",
                str(tmp_path / "run"),
                "--model.target",
                tiny_target,
                "--model.draft_vocab",
                "1000",
            ]
        )
        == 1
    )
    line = _err_line(capsys)
    assert "model.draft_vocab=1000" in line and "64" in line


def test_missing_source_is_one_line(tmp_path, capsys, tiny_target):
    assert (
        main(
            [
                "--preset",
                "tiny",
                "--out",
                str(tmp_path / "run"),
                "--model.target",
                tiny_target,
                "--data.source",
                str(tmp_path / "nope"),
            ]
        )
        == 2  # judged with the flags, before the target loads
    )
    assert "no such file" in _err_line(capsys)


def _saved_run(out, tiny_target, checkpoint: bool):
    """OUT as a run of the tiny preset leaves it: its config.json, and a checkpoint folder or not."""
    out.mkdir()
    saved = C.to_dict(parse_args(["--preset", "tiny", "--model.target", tiny_target]))
    (out / "config.json").write_text(json.dumps(saved))
    if checkpoint:
        (out / "checkpoints" / "20").mkdir(parents=True)


def test_changed_settings_refuse_to_resume(tmp_path, capsys, tiny_target):
    out = tmp_path / "run"
    _saved_run(out, tiny_target, checkpoint=True)
    assert main(["--preset", "tiny", "--out", str(out), "--model.target", tiny_target, "--optim.lr", "0.5"]) == 1
    line = _err_line(capsys)
    assert "optim.lr" in line
    assert "another --out" in line


BAD_VALUES = [
    ("--optim.lr", "inf"),
    ("--optim.lr", "nan"),
    ("--optim.clip", "-1"),
    ("--optim.warmup_steps", "-1"),
    ("--optim.b1", "2"),
    ("--optim.min_lr_ratio", "1.5"),
    ("--optim.weight_decay", "-0.1"),
    ("--loop.epochs", "inf"),
    ("--loop.eval_every", "-5"),
    ("--loop.chain_decay", "0"),
    ("--data.heldout", "-1"),
    ("--data.max_conversations", "-3"),
    ("--data.row_factor", "inf"),
    ("--data.max_anchors", "0"),
    ("--eval.num_prompts", "0"),
    ("--eval.max_new_tokens", "0"),
    ("--eval.ks", "0"),
    ("--model.mask_token_id", "-2"),
]


@pytest.mark.parametrize("flag,value", BAD_VALUES, ids=[f"{f}={v}" for f, v in BAD_VALUES])
def test_training_values_are_checked_before_any_work(flag, value, tmp_path, capsys):
    out = tmp_path / "never"
    assert main(["--preset", "tiny", "--out", str(out), flag, value]) == 2
    assert flag[2:] in _err_line(capsys)
    assert not out.exists()  # refused before OUT was made


def test_out_that_is_a_file_is_a_usage_error(tmp_path, capsys):
    f = tmp_path / "a-file"
    f.write_text("x")
    assert main(["--preset", "tiny", "--out", str(f)]) == 2
    assert "exists and is not a folder" in _err_line(capsys)
    assert main(["--preset", "tiny", "--out", str(f / "below")]) == 2
    assert "--out" in _err_line(capsys)


def test_a_run_without_a_checkpoint_leaves_an_out_the_corrected_command_reuses(tmp_path, capsys, tiny_target):
    """...and a time budget ends that run after its first step, with a checkpoint and a head."""
    out = tmp_path / "run"
    _saved_run(out, tiny_target, checkpoint=False)
    flags = ["--preset", "tiny", "--out", str(out), "--model.target", tiny_target, "--eval.enabled", "false"]
    steps = ["--loop.steps", "500", "--loop.progress", "false", "--loop.max_seconds", "1e-9"]
    assert main([*flags, *steps, "--optim.lr", "0.002"]) == 0
    assert json.loads((out / "config.json").read_text())["optim"]["lr"] == 0.002
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 1
    assert summary["stopped_early"] is True
    assert (out / "vllm" / "config.json").exists()
    kept = [int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit()]
    assert kept == [1]


def test_a_non_finite_loss_stops_training_and_exports_nothing(tmp_path, capsys, tiny_target):
    out = tmp_path / "nan"
    flags = ["--preset", "tiny", "--out", str(out), "--model.target", tiny_target, "--eval.enabled", "false"]
    steps = ["--loop.steps", "8", "--loop.checkpoint_every", "1", "--loop.progress", "false"]
    assert main([*flags, *steps, "--optim.lr", "1e30", "--optim.warmup_steps", "0"]) == 1
    line = _err_line(capsys)
    assert "not finite" in line
    assert line.startswith("error: step ")
    step = int(line.split()[2].rstrip(":"))
    assert not (out / "vllm").exists()
    assert not (out / "head").exists()
    folder = out / "checkpoints"
    kept = sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit()) if folder.exists() else []
    assert (kept[-1] if kept else 0) == step - 1  # the bad step was never checkpointed (step 1: none at all)
