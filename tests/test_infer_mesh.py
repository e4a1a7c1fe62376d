"""Every inference command on a mesh (--tensor, --data, --devices) of 8 simulated CPU devices:
`serve` at tensor 2 x data 2 and at tensor 4 (real processes on 127.0.0.1), the server's slots at
data 2 and at tensor 2, `generate`, `bench` and `cost` (one 8-device subprocess,
tests/programs/infer_meshes.py): every request, greedy and seeded-sampled, streaming and not,
gives the tokens one-device `SpeculativeDecoder.generate` gives its prompt alone; flags that do
not fit the target or the machine are one line and exit 2, before anything loads.

The servers and the program start together (module fixture) and run beside the references."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import hf_tiny
import pytest
import xla_env
from in_process import run_module
from limits import HANG_S
from serve_support import OnFirstUse, ServerProcess, alone, ask, mixed_requests, shown

import peagle_jax as pj
from infer import SpeculativeDecoder
from infer.cost import step_bytes
from peagle_jax.runtime.sharding import tensor_problem

ROOT = Path(__file__).resolve().parents[1]
K = 3
SERVERS = {"tensor2-data2": ["--tensor", "2", "--data", "2"], "tensor4": ["--tensor", "4"]}
BANNERS = {"tensor2-data2": "on tensor 2 x data 2 (4 cpu devices)", "tensor4": "on tensor 4 (4 cpu devices)"}
# tensor x data: the slow tier (~80 s of the 2-core CI); the fast one has data-parallel slots below
LAYOUTS = [pytest.param("tensor2-data2", marks=pytest.mark.slow), "tensor4"]
BENCH = ["--prompts", "synthetic:8,20", "--limit", "4", "--batch-size", "2", "--max-new-tokens", "8"]


REQUESTS = mixed_requests()


class Started:
    """The 8-device program, running; its report once it ended."""

    def __init__(self, root: Path):
        env = {**xla_env.simulated_devices(8), "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
        requests = json.dumps([r[:4] for r in REQUESTS])
        cmd = [sys.executable, str(ROOT / "tests" / "programs" / "infer_meshes.py"), str(root), requests]
        self.proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self._report = None

    def report(self) -> dict:
        if self._report is None:
            out, err = self.proc.communicate(timeout=HANG_S)
            assert self.proc.returncode == 0, out[-2000:] + err[-4000:]
            self._report = json.loads(out.strip().splitlines()[-1])
        return self._report


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("mesh")
    hf_tiny.build("llama-gqa2-tied-llama3", root / "target")  # 4 attention heads, 2 KV heads
    hf_tiny.word_tokenizer(root / "target")
    target = pj.load_target(root / "target", dtype="float32")
    pj.new_drafter(target, num_layers=1, mode="parallel", seed=1).save(root / "drafter")
    prompts = [r[0] for r in REQUESTS[::4][:2]]
    (root / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    return root, target


@pytest.fixture(scope="module")
def started(assets):
    """(layout -> its server, a future while it starts; the program), all started at once: the
    references are computed while they come up."""
    root, _ = assets
    program = Started(root)
    model = ["--target", str(root / "target"), "--drafter", str(root / "drafter"), "--k", str(K)]
    env = xla_env.simulated_devices(8)

    def server(name):
        argv = [*model, *SERVERS[name], "--max-batch", "4", "--max-len", "128"]
        return ServerProcess(argv, root / f"{name}.log", "tiny", env=env)

    servers = OnFirstUse(server, eager=["tensor4"])
    yield servers, program
    if program.proc.poll() is None:
        program.proc.kill()
    for proc in servers.results().values():
        assert proc.stop() == 0, proc.stderr()
        assert "Traceback" not in proc.stderr(), proc.stderr()


@pytest.fixture(scope="module")
def reference(assets):
    """Each request's tokens from one-device `generate` of its prompt alone (seed s: row_key(s, 0))."""
    root, target = assets
    return alone(target, root / "drafter", K, REQUESTS)


# ---------------------------------------------------------------- serve


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_request_on_a_mesh_equals_generate_alone(started, reference, layout):
    server = started[0][layout].result()
    assert BANNERS[layout] in server.stderr()
    with ThreadPoolExecutor(len(REQUESTS)) as pool:  # more requests than slots: they queue and reuse slots
        got = list(pool.map(lambda r: ask(server, r), REQUESTS))
    wrong = [i for i, (g, want) in enumerate(zip(got, reference)) if g != shown(want)]
    assert not wrong, [(i, REQUESTS[i][1:], got[i], reference[i]) for i in wrong]
    assert any(a != b for a, b in zip(reference[::4], reference[2::4]))  # the sampled requests did sample


# ---------------------------------------------------------------- the slots, generate, bench, cost


@pytest.mark.parametrize("layout, spec", [("data2", ["data"]), ("tensor2", [None, None, "tensor"])])
def test_slots_on_a_mesh_equal_generate_alone_and_split_the_cache(started, reference, layout, spec):
    report = started[1].report()[layout]
    assert report["tokens"] == reference
    while report["cache_spec"] and report["cache_spec"][-1] is None:  # P("data") == P("data", None, None, None)
        report["cache_spec"].pop()
    assert report["cache_spec"] == spec  # rows over data; 2 KV heads over tensor 2


def test_generate_on_every_device_equals_one_device(started, assets):
    root, target = assets
    prompts = [json.loads(line) for line in (root / "prompts.jsonl").read_text().splitlines()]
    want = SpeculativeDecoder(target, pj.load_drafter(root / "drafter"), k=K).generate(prompts, max_new_tokens=10)
    got = started[1].report()["generate"]
    assert [o["tokens"] for o in got["outputs"]] == want.tokens
    rc, err = started[1].report()["auto"]  # 8 devices, the target's 4 heads: refused before loading
    assert rc == 2 and err.strip() == "error: --devices auto: the target's 4 attention heads are not divisible by 8"


def test_bench_on_a_mesh_measures_what_one_device_does(started, assets, tmp_path):
    root, _ = assets
    model = ["--target", root / "target", "--drafter", root / "drafter", "--k", K]
    assert run_module("infer", ["bench", *model, *BENCH, "--json", tmp_path / "one.json"]).returncode == 0
    started[1].report()
    one, mesh = (json.loads(p.read_text()) for p in (tmp_path / "one.json", root / "bench-mesh.json"))
    assert one["mesh"] == {"tensor": 1, "data": 1, "devices": 1}
    assert mesh["mesh"] == {"tensor": 1, "data": 2, "devices": 2}
    assert mesh["identical_greedy_outputs"] is True and mesh["greedy_mismatches"] == 0
    for key in ("new_tokens", "acceptance_length", "per_position_acceptance"):
        assert mesh[key] == one[key], key
    assert mesh["baseline"]["new_tokens"] == one["baseline"]["new_tokens"]


def test_cost_on_a_mesh_reports_each_devices_bytes(started, assets):
    root, target = assets
    started[1].report()
    cost = json.loads((root / "cost-mesh.json").read_text())
    assert cost["mesh"] == {"tensor": 2, "data": 1, "devices": 2}
    (plain,) = cost["plain"]
    assert (plain["batch"], plain["prompt_len"]) == (2, 16) and plain["step_ms"] > 0
    assert abs(plain["step_bytes"] - step_bytes(target, 2, 16) / 2) <= 1  # weights and KV heads over tensor 2
    (row,) = cost["rounds"]
    assert (row["mode"], row["k"]) == ("parallel", 1) and row["round_ms"] > 0
    assert row["break_even_acceptance_length"] > 0 and not cost["refused"]


# ---------------------------------------------------------------- flags that do not fit


def _argv(assets, command: str) -> list:
    root, _ = assets
    if command == "cost":
        return ["cost", "--target", root / "target"]
    model = [command, "--target", root / "target", "--drafter", root / "drafter", "--k", K]
    return model + {"generate": ["--prompt-ids", "5,6"], "bench": ["--prompts", "synthetic:8"], "serve": []}[command]


BAD = [
    ("generate", ["--tensor", "2"], "--tensor 2: needs tensor 2 x data 1 = 2 devices, this machine has 1"),
    ("generate", ["--tensor", "3"], "--tensor 3: the target's 4 attention heads are not divisible by 3"),
    ("serve", ["--tensor", "2", "--devices", "auto"], "argument --devices: not allowed with argument --tensor"),
    ("serve", ["--data", "2", "--max-batch", "3"], "--max-batch 3: not divisible by --data 2"),
    ("serve", ["--devices", "auto", "--data", "2"], "--devices auto --data 2: --data 2 does not divide the 1 local"),
    ("bench", ["--data", "2", "--batch-size", "3"], "--batch-size 3: not divisible by --data 2"),
    ("cost", ["--data", "2", "--batch", "2,3"], "--batch 3: not divisible by --data 2"),
    ("cost", ["--data", "0"], "argument --data: expected a positive integer, got '0'"),
]


@pytest.mark.parametrize("command, flags, message", BAD, ids=[f"{b[0]} {' '.join(b[1])}" for b in BAD])
def test_a_mesh_that_does_not_fit_is_one_line_before_anything_loads(assets, command, flags, message):
    res = run_module("infer", [*_argv(assets, command), *flags])
    assert res.returncode == 2, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr  # nothing loaded: no progress line
    assert message in res.stderr


def test_tensor_problem_follows_the_rule_table():
    def config(heads=8, kv=2, hidden=64, vocab=96):
        return types.SimpleNamespace(num_heads=heads, num_kv_heads=kv, hidden_size=hidden, vocab_size=vocab)

    assert tensor_problem(config(), 1) is None
    assert tensor_problem(config(kv=8), 8) is None  # a KV head per device
    assert tensor_problem(config(kv=2), 8) is None  # fewer KV heads than devices: each kept by 4 devices
    assert (
        tensor_problem(config(heads=12, kv=3), 4)
        == "the target's 3 KV heads are neither divisible by 4 nor a divisor of it"
    )
    assert tensor_problem(config(vocab=100), 8) == "the target's vocabulary (100 tokens) is not divisible by 8"
    assert tensor_problem(config(hidden=60), 8) == "the target's hidden size 60 is not divisible by 8"
