"""Hub ids for targets, heads and data sets (`peagle_jax.sources.hub`), against a loopback stand-in of the
Hub's HTTP API (`hub_server.HubStandIn` on 127.0.0.1): the real `huggingface_hub` download code
runs, in subprocesses started with `HF_ENDPOINT` at the stand-in and `HF_HOME` in tmp_path
(huggingface_hub reads both once, at import). No test reaches the network."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from hub_server import HubStandIn
from limits import HANG_S

from peagle_jax.sources import hub

REPO = Path(__file__).resolve().parents[1]
TARGET, HEAD, DATA, GATED = "someorg/tiny", "someorg/tiny-head", "someorg/chats", "someorg/gated"
SHAPE_ONLY = "someorg/tiny-shape"  # the same folder, loaded with dummy weights
# what a target's snapshot may hold (`hub.patterns("target")`): the tiny target has these of them
TARGET_FILES = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
CLEAN_ENV = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_DATASETS_CACHE")


def sharegpt_rows(n: int, seed: int) -> list[dict]:
    """ShareGPT records over the tiny tokenizer's words."""
    from train.data import synthetic_conversations

    convs = synthetic_conversations(n, seed)
    return [
        {"conversations": [{"from": "human", "value": q["content"]}, {"from": "gpt", "value": a["content"]}]}
        for q, a in convs
    ]


def write_dataset(folder: Path, rows: dict[str, list[dict]]) -> Path:
    """A Hub-style data set folder: one parquet file per split under data/, named by the card's YAML."""
    import datasets

    (folder / "data").mkdir(parents=True)
    files = "".join(f"  - split: {s}\n    path: data/{s}-*\n" for s in rows)
    card = f"---\nconfigs:\n- config_name: default\n  data_files:\n{files}---\n# chats\n\nShareGPT conversations.\n"
    (folder / "README.md").write_text(card)
    for split, recs in rows.items():
        datasets.Dataset.from_list(recs).to_parquet(str(folder / "data" / f"{split}-00000-of-00001.parquet"))
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Local folders served as repos: a tiny target (plus files a download must skip), a vLLM head
    for it, and a data set with two splits."""
    import peagle_jax as pj
    from peagle_jax.formats import export_drafter
    from train.tiny import build_tiny_target

    root = tmp_path_factory.mktemp("hub-folders")
    target = build_tiny_target(root / "target")
    for junk in ("pytorch_model.bin", "original/model.safetensors", "README.md"):
        (target / junk).parent.mkdir(exist_ok=True)
        (target / junk).write_bytes(b"not for this project")
    drafter = pj.new_drafter(pj.load_target(target, dtype="float32"), num_layers=1, k_train=4, seed=3)
    own = drafter.save(root / "head-own")
    head, _ = export_drafter(own, root / "head", "vllm", dtype="float32", target=target)
    data = write_dataset(root / "chats", {"train": sharegpt_rows(16, 0), "test": sharegpt_rows(4, 1)})
    return {"target": target, "head": head, "data": data}


@pytest.fixture(scope="module")
def stand_in(folders):
    with HubStandIn() as h:
        h.add_folder(TARGET, folders["target"])
        h.add_folder(HEAD, folders["head"])
        h.add_folder(DATA, folders["data"], kind="dataset")
        h.add_folder(GATED, folders["target"], gated=True)
        h.add_folder(SHAPE_ONLY, folders["target"])
        yield h


def hub_env(endpoint: str, home: Path, offline: bool = False) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in CLEAN_ENV and not k.startswith("HF_TOKEN")}
    env.update(HF_ENDPOINT=endpoint, HF_HOME=str(home), PYTHONPATH=str(REPO))
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    return env


def run(args: list[str], env: dict, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=HANG_S)


def error_line(r: subprocess.CompletedProcess) -> str:
    """The command's one error line: its last stderr line, with no traceback before it."""
    assert "Traceback" not in r.stderr, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: "), r.stderr
    return last


# A process that loads a target, a head and a data set by the names it is given and prints what it got.
LOAD = """
import json, sys
import numpy as np
import peagle_jax as pj
from train.data import load_conversations
target_name, head_name, data_name, local_head = sys.argv[1:5]
t = pj.load_target(target_name, dtype="float32")
d = pj.load_drafter(head_name)
ref = pj.load_drafter(local_head).arrays()
diff = max(float(np.abs(np.asarray(v, np.float32) - np.asarray(ref[k], np.float32)).max()) for k, v in d.arrays().items())
rows = {s: [r for _, r in load_conversations(data_name, split=s)] for s in ("train", "test")}
out = dict(target=str(t.path), head=str(d.path), head_diff=diff, rows=rows, layers=t.config.num_layers,
           verifier=pj.new_drafter(t, num_layers=1, k_train=2).config.verifier)
print(json.dumps(out))
"""


def load(names: tuple[str, str, str], folders, env, cwd: Path = REPO) -> dict:
    r = run(["-c", LOAD, *names, str(folders["head"])], env, cwd)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def warm(stand_in, folders, tmp_path_factory):
    """HF_HOME after a target, a head and a data set were loaded by id (and what the loads returned)."""
    home = tmp_path_factory.mktemp("hf-home")
    got = load((TARGET, HEAD, DATA), folders, hub_env(stand_in.endpoint, home))
    return home, got


def test_target_head_and_dataset_load_by_id(warm, stand_in, folders):
    home, got = warm
    snapshots = home / "hub" / "models--someorg--tiny" / "snapshots"
    assert Path(got["target"]).parent == snapshots, got["target"]
    assert got["layers"] == 4
    assert Path(got["head"]).parent == home / "hub" / "models--someorg--tiny-head" / "snapshots"
    assert got["head_diff"] == 0.0
    assert got["verifier"] == TARGET  # a head records its Hub target by id
    assert got["rows"] == {"train": sharegpt_rows(16, 0), "test": sharegpt_rows(4, 1)}
    assert stand_in.fetched(TARGET) == TARGET_FILES  # no .bin, original/, README or tiny_target.json
    assert stand_in.fetched(HEAD) == ["config.json", "model.safetensors"]
    assert [p for m, p in stand_in.requests if m == "GET" and p.startswith("/cdn/")], "LFS files come from the CDN"
    assert stand_in.unknown == []


def test_train_end_to_end_by_hub_ids(warm, stand_in, tmp_path):
    home, _ = warm
    out = tmp_path / "run"
    flags = ["--preset", "tiny", "--model.target", TARGET, "--data.source", DATA, "--data.max_conversations", "0"]
    flags += "--loop.steps 2 --loop.checkpoint_every 2 --eval.enabled false --loop.progress false".split()
    r = run(["-m", "train", *flags, "--out", str(out)], hub_env(stand_in.endpoint, home))
    assert r.returncode == 0, r.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["data"]["records"] == 16
    assert summary["serve"].startswith(f"vllm serve {TARGET} ")  # vLLM takes the id
    # what the trainer prints: the same lines as the converter (P-EAGLE: vLLM pinned below 0.34, and this engine)
    assert summary["serve_lines"] == [
        f'pip install "vllm>=0.16,<0.34" && {summary["serve"]}',
        summary["serve_lines"][1],
    ]
    assert summary["serve_lines"][1].startswith(f"python -m infer serve --target {TARGET} --drafter ")
    assert "vLLM 0.34 and later refuse P-EAGLE heads" in summary["serve_note"]
    assert [x for x in r.stdout.splitlines() if x.startswith("serve: ")] == [
        f"serve: {x}" for x in summary["serve_lines"]
    ]
    assert TARGET in (out / "vllm" / "config.json").read_text()  # the head's verifier
    # the lint finds the recorded id's snapshot in the cache, offline
    r = run(
        ["-m", "peagle_jax.convert", "inspect", str(out / "vllm"), "--json", "--vllm-version", "0.33"],
        hub_env(stand_in.endpoint, home, offline=True),
    )
    assert r.returncode == 0, r.stderr
    assert Path(json.loads(r.stdout)["target"]["path"]).parent == home / "hub" / "models--someorg--tiny" / "snapshots"


def test_convert_by_hub_ids_names_the_verifier(warm, stand_in, tmp_path):
    home, _ = warm
    env = hub_env(stand_in.endpoint, home)
    ours, spec = tmp_path / "ours", tmp_path / "spec"
    r = run(["-m", "peagle_jax.convert", "import", HEAD, str(ours), "--target", TARGET], env)
    assert r.returncode == 0, r.stderr
    r = run(["-m", "peagle_jax.convert", "inspect", HEAD, "--target", TARGET, "--json", "--vllm-version", "0.33"], env)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["problems"] == []
    assert report["serve"].startswith(f"vllm serve {TARGET} "), report["serve"]  # the id, not the cache's path
    r = run(
        ["-m", "peagle_jax.convert", "export", str(ours), str(spec), "--format", "speculators", "--target", TARGET], env
    )
    assert r.returncode == 0, r.stderr
    config = json.loads((spec / "config.json").read_text())
    assert config["speculators_config"]["verifier"]["name_or_path"] == TARGET  # no --verifier given


@pytest.mark.parametrize(
    "args, status, words",
    [
        (
            ["-m", "train", "--preset", "tiny", "--model.target", GATED],
            1,
            ["target someorg/gated", "gated", "hf auth login", "HF_TOKEN", "local folder"],
        ),
        (
            ["-m", "peagle_jax.convert", "import", "someorg/missing", "@OUT"],
            1,
            ["head someorg/missing", "no such repo", "hf auth login"],
        ),
        (
            ["-m", "train", "--preset", "tiny", "--model.target", "@TARGET", "--data.source", "someorg/no-data"],
            1,
            ["dataset someorg/no-data", "no such repo"],
        ),
    ],
    ids=["gated-target", "missing-head", "missing-dataset"],
)
def test_gated_or_missing_repo_is_one_line(args, status, words, stand_in, folders, tmp_path):
    out = ["--out", str(tmp_path / "run")] if args[1] == "train" else []
    args = [{"@OUT": str(tmp_path / "out"), "@TARGET": str(folders["target"])}.get(a, a) for a in args]
    r = run([*args, *out], hub_env(stand_in.endpoint, tmp_path / "home"))
    assert r.returncode == status, r.stderr
    line = error_line(r)
    for w in words:
        assert w in line, line
    assert stand_in.unknown == []


def test_no_network_is_one_line(tmp_path):
    with socket.socket() as s:  # a loopback port nothing listens on: connection refused
        s.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{s.getsockname()[1]}"
    env = hub_env(endpoint, tmp_path / "home")
    r = run(["-m", "infer", "generate", "--target", TARGET, "--mode", "none", "--prompt", "w1"], env)
    assert r.returncode == 1, r.stderr
    line = error_line(r)
    assert "target someorg/tiny" in line and "cannot be reached" in line and "local folder" in line, line


def test_offline_with_a_warm_cache_makes_no_request(warm, stand_in, folders, tmp_path):
    home, online = warm
    env = hub_env(stand_in.endpoint, home, offline=True)
    before = len(stand_in.requests)
    assert load((TARGET, HEAD, DATA), folders, env) == online
    gen = ["-m", "infer", "generate", "--target", TARGET, "--drafter", HEAD, "--k", "2", "--max-new-tokens", "4"]
    r = run([*gen, "--prompt", "w1 w2 w3", "--json"], env)
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout)["tokens"]) >= 1
    assert len(stand_in.requests) == before


def test_offline_with_a_cold_cache_is_one_line(stand_in, tmp_path):
    env = hub_env(stand_in.endpoint, tmp_path / "cold", offline=True)
    before = len(stand_in.requests)
    r = run(["-m", "peagle_jax.convert", "inspect", HEAD], env)
    assert r.returncode == 2, r.stderr  # inspect: could not inspect
    line = error_line(r)
    assert "head someorg/tiny-head" in line and "HF_HUB_OFFLINE=1" in line and "local folder" in line, line
    assert len(stand_in.requests) == before


def test_a_local_folder_of_the_same_name_wins(stand_in, folders, tmp_path):
    work = tmp_path / "work"
    shutil.copytree(folders["target"], work / TARGET)
    shutil.copytree(folders["head"], work / HEAD)
    (work / DATA).mkdir(parents=True)
    rows = sharegpt_rows(6, 7)
    (work / DATA / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    before = len(stand_in.requests)
    got = load((TARGET, HEAD, DATA), folders, hub_env(stand_in.endpoint, tmp_path / "home"), work)
    assert got["target"] == TARGET and got["head"] == HEAD  # the relative local folders
    assert got["rows"]["train"] == rows
    assert got["verifier"] == str(Path(TARGET))
    assert stand_in.requests[before:] == []


# ------------------------------------------------------------------------------ names, no requests


@pytest.mark.parametrize(
    "name, ok",
    [
        ("Qwen/Qwen3-8B", True),
        ("amazon/GPT-OSS-20B-P-EAGLE", True),
        ("a/b.c", True),
        ("gemma3-270m", False),
        ("/abs/path", False),
        ("runs/x/head", False),
        ("org/../x", False),
        ("org--x/y", False),
        ("", False),
        (None, False),
    ],
)
def test_is_repo_id(name, ok):
    assert hub.is_repo_id(name) is ok


def test_repo_id_of_a_cache_snapshot(tmp_path):
    snap = tmp_path / "hub" / "models--Qwen--Qwen3-8B" / "snapshots" / ("a" * 40)
    assert hub.repo_id_of(snap) == "Qwen/Qwen3-8B"
    assert hub.repo_id_of(tmp_path / "hub" / "datasets--o--d" / "snapshots" / "c") is None
    assert hub.repo_id_of(tmp_path / "Qwen3-8B") is None
    assert hub.repo_id_of(None) is None


def test_resolve_returns_local_paths_and_non_ids_without_a_request(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert hub.resolve("org/name", "target") == Path("org/name")
    assert hub.resolve(tmp_path / "nowhere", "head") == tmp_path / "nowhere"
    assert hub.resolve("runs/a/b", "dataset") == Path("runs/a/b")
    with pytest.raises(ValueError, match="unknown kind"):
        hub.patterns("model")


def test_dummy_weights_fetch_the_config_and_tokenizer_only(stand_in, tmp_path):
    code = "import sys, peagle_jax as pj; t = pj.load_target(sys.argv[1], load_format='dummy'); "
    code += "print(t.config.num_layers, t.load_format, t.tokenizer is not None)"
    r = run(["-c", code, SHAPE_ONLY], hub_env(stand_in.endpoint, tmp_path / "home"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["4", "dummy", "True"]
    assert stand_in.fetched(SHAPE_ONLY) == [f for f in TARGET_FILES if f != "model.safetensors"]
