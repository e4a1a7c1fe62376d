"""A folder of the wrong kind (issue 58): a drafter head (this project's format, vLLM,
speculators), a target model or a training run's folder given where another kind is expected is
named as such, in one `error:` line, by every command line and the Python API, before anything
is written; a folder the command would write into is left as it was. The command lines run
their main in the test process (`in_process`) on a tiny target and heads built once."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import hf_tiny
import pytest
from in_process import run_module

import peagle_jax as pj
from peagle_jax.config.target_config import ConfigError
from peagle_jax.formats import export_speculators, export_vllm
from train import config as C


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> Path:
    """target/, own/ (a head of this project's format), vllm/, spec/ (speculators), run/ (a
    training run's folder: its config.json and its head), other/ (a config.json of neither)."""
    root = tmp_path_factory.mktemp("folders")
    hf_tiny.build("llama-gqa2-tied-llama3", root / "target")
    target = pj.load_target(root / "target", dtype="float32")
    drafter = pj.new_drafter(target, num_layers=1, mode="parallel", seed=1)
    drafter.save(root / "own")
    export_vllm(drafter, root / "vllm")
    export_speculators(drafter, root / "spec")
    (root / "run").mkdir()
    (root / "run" / "config.json").write_text(json.dumps(C.to_dict(C.TrainConfig(out=str(root / "run")))))
    drafter.save(root / "run" / "head")
    (root / "other").mkdir()
    (root / "other" / "config.json").write_text('{"learning_rate": 3}')
    return root


def digest(folder: Path) -> str:
    """Every file's path and bytes under `folder`: equal before and after = nothing was written."""
    h = hashlib.sha256()
    for p in sorted(folder.rglob("*")):
        h.update(str(p.relative_to(folder)).encode())
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


TRAIN = ["train", "--preset", "tiny", "--loop.progress", "false", "--out"]
GENERATE = ["infer", "generate", "--prompt-ids", "1,2,3"]
CONVERT = ["peagle_jax.convert"]
# (case, argv with {root} / {out}, exit status, what the error line says, a folder left as it was)
CASES = [
    ("train --out a vLLM head", TRAIN + ["{root}/vllm"], 2, "a vLLM drafter head (architectures", "vllm"),
    ("train --out a speculators head", TRAIN + ["{root}/spec"], 2, "a speculators drafter head", "spec"),
    ("train --out our head", TRAIN + ["{root}/own"], 2, "a drafter head in this project's format", "own"),
    (
        "train --out a target",
        TRAIN + ["{root}/target"],
        2,
        "--out {root}/target: a Hugging Face model folder",
        "target",
    ),
    ("train --out another config.json", TRAIN + ["{root}/other"], 2, "holds a config.json that is not a", "other"),
    (
        "infer --target a run",
        GENERATE + ["--target", "{root}/run", "--drafter", "{root}/own"],
        1,
        "{root}/run: a training run's folder (python -m train --out: its head is {root}/run/head",
        "run",
    ),
    (
        "infer --drafter a run",
        GENERATE + ["--target", "{root}/target", "--drafter", "{root}/run"],
        1,
        "{root}/run: a training run's folder, not a drafter head (its head is {root}/run/head)",
        "run",
    ),
    ("inspect a run", CONVERT + ["inspect", "{root}/run"], 2, "a training run's folder, not a drafter head", "run"),
    (
        "export a run",
        CONVERT + ["export", "{root}/run", "{out}/x", "--format", "vllm"],
        1,
        "a training run's folder, not a drafter head",
        "run",
    ),
    (
        "export-target of a vLLM head",
        CONVERT + ["export-target", "{root}/vllm", "{out}/x"],
        1,
        "{root}/vllm: a vLLM drafter head (architectures ['LlamaForCausalLMEagle3']), not a target model",
        "vllm",
    ),
    (
        "import-target of a run",
        CONVERT + ["import-target", "{root}/run", "{out}/x"],
        1,
        "a training run's folder (python -m train --out",
        "run",
    ),
    (
        "export-target --overwrite onto a run",
        CONVERT + ["export-target", "{root}/target", "{root}/run", "--overwrite"],
        2,
        "OUT {root}/run: a training run's folder (python -m train --out: its head is {root}/run/head, its vLLM "
        "export {root}/run/vllm); a converter never replaces a run's folder",
        "run",
    ),
]


@pytest.mark.parametrize("argv, code, says, kept", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_folder_of_the_wrong_kind_is_named(folders, tmp_path, argv, code, says, kept):
    fill = {"root": folders, "out": tmp_path}
    before = digest(folders / kept)
    module, *args = (a.format(**fill) for a in argv)
    proc = run_module(module, args)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == code, proc.stderr
    assert len(errors) == 1 and says.format(**fill) in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr
    assert digest(folders / kept) == before  # nothing written into it (train used to replace config.json)
    assert not (tmp_path / "x").exists()


def test_python_api_names_a_run_folder(folders):
    """load_target and load_drafter say what a training run's folder is, and where its head is."""
    run = folders / "run"
    with pytest.raises(ConfigError, match="a training run's folder .*not a target model"):
        pj.load_target(run)
    with pytest.raises(ConfigError, match=f"a training run's folder, not a drafter head \\(its head is {run}/head\\)"):
        pj.load_drafter(run)


def test_train_api_refuses_a_head_as_out(folders):
    """A config built in Python (no flags parsed) is checked where the run makes OUT."""
    from peagle_jax.runtime.command_line import UsageError
    from train.flags import from_dict
    from train.loop import prepare_out

    before = digest(folders / "vllm")
    with pytest.raises(UsageError, match="a vLLM drafter head"):
        prepare_out(from_dict({"out": str(folders / "vllm")}))
    assert digest(folders / "vllm") == before
