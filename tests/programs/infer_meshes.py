"""`python tests/programs/infer_meshes.py ROOT REQUESTS`: the inference commands on meshes of the 8
devices this process must see, for tests/test_infer_mesh.py.

ROOT holds the tiny target (ROOT/target, with its word tokenizer) and its head (ROOT/drafter);
REQUESTS is a JSON list of [prompt ids, max tokens, temperature, seed]. The program runs, in this
process, `python -m infer generate` on --devices auto --data 2 (tensor 4 x data 2) of the
prompts in ROOT/prompts.jsonl, `bench` on --data 2, `cost` on --tensor 2 with dummy weights (their JSON in ROOT),
and `--devices auto` alone (the target's 4 attention heads do not split 8 ways); then the
server's `Slots` at data 2 and at tensor 2, each serving every request as a server does. Prints
one JSON line: `generate` (the command's JSON), `auto` ([exit status, stderr]), and per layout
(`data2`, `tensor2`) each request's tokens and the state's KV cache partition spec."""

import contextlib
import io
import json
import sys
from pathlib import Path

import jax

import peagle_jax as pj
from infer.__main__ import main as infer_main
from peagle_jax.engine import Engine, SamplingParams, Slots, row_key
from peagle_jax.runtime.sharding import make_mesh

K = 3


def command(argv: list) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = infer_main([str(a) for a in argv])
    return rc, out.getvalue(), err.getvalue()


def served(root: Path, requests: list, tensor: int, data: int) -> dict:
    """Every request through 4 slots on a tensor x data mesh, admitted into free slots between
    steps over every slot (`test_serve_slots.drain`'s loop): each request's tokens, and where
    the KV cache lies."""
    target = pj.load_target(root / "target", dtype="float32", mesh=make_mesh(tensor=tensor, data=data))
    slots = Slots(Engine(target, pj.load_drafter(root / "drafter"), k=K), 4, 128)
    got, waiting = [[] for _ in requests], list(range(len(requests)))
    while waiting or slots.holders:
        admitted, waiting = waiting[: len(slots.free())], waiting[len(slots.free()) :]
        for i in admitted:
            ids, n, temperature, seed = requests[i]
            params = SamplingParams(n, temperature, 0.95 if temperature else 1.0, seed=seed)
            slots.admit([(ids, params, row_key(seed, 0))], [i])
        news = slots.prefill() if slots.filling else []
        news += slots.step(slots.batch) if slots.running else []  # every row: one compile
        for n in news:
            got[n.holder] += n.ids
    spec = jax.tree.leaves(slots.state.target_cache)[0].sharding.spec
    return {"tokens": got, "cache_spec": [a if a is None or isinstance(a, str) else list(a) for a in spec]}


def main(argv: list[str]) -> int:
    root, requests = Path(argv[0]), json.loads(argv[1])
    assert jax.device_count() == 8, jax.devices()
    model = ["--target", root / "target", "--drafter", root / "drafter", "--k", K]
    report = {}
    rc, out, err = command(["generate", *model, "--prompt-ids", root / "prompts.jsonl", "--max-new-tokens", 10,
                            "--json", "--devices", "auto", "--data", 2])  # fmt: skip
    assert rc == 0, err
    report["generate"] = json.loads(out)
    bench = ["--prompts", "synthetic:8,20", "--limit", 4, "--batch-size", 2, "--max-new-tokens", 8]
    rc, _, err = command(["bench", *model, *bench, "--json", root / "bench-mesh.json", "--data", 2])
    assert rc == 0, err
    cost = ["--modes", "parallel", "--k", 1, "--batch", 2, "--prompt-len", 16, "--reps", 1]
    cost += ["--load-format", "dummy", "--json", root / "cost-mesh.json", "--tensor", 2]
    rc, _, err = command(["cost", "--target", root / "target", *cost])
    assert rc == 0, err
    report["auto"] = command(["generate", *model, "--prompt-ids", "5,6", "--devices", "auto"])[::2]
    report["data2"] = served(root, requests, tensor=1, data=2)
    report["tensor2"] = served(root, requests, tensor=2, data=1)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
