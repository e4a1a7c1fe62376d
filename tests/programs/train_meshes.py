"""`python tests/programs/train_meshes.py TARGET ROOT MESHES`: the trainer's runs on 8 devices (this
process must see 8), for the mesh tests of tests/test_train_mesh.py.

TARGET is the tiny target folder, ROOT the folder the runs are written under, MESHES a JSON list
of (data, fsdp, tensor) meshes. For each mesh it trains `train_runs.flags` into
ROOT/m<data><fsdp><tensor> ((1, 4, 2) with `--model.attention kernels`); it then runs a mesh and a batch that do not fit
(ROOT/bad-mesh, ROOT/bad-batch), resumes the (2, 2, 2) run's step-2 checkpoint on an (8, 1, 1)
mesh (ROOT/resumed) and reads how that run's step-3 checkpoint lies on the mesh. Prints one JSON
line: `errors` (name -> [exit code, stderr]), `resumed_from`, `params` (name -> [shape, spec])
and `opt` ([shape, spec] of each optimizer array). Needs tests/ on the path (train_runs)."""

import contextlib
import io
import json
import shutil
import sys
from pathlib import Path

import jax
import orbax.checkpoint as ocp
import train_runs

from train.__main__ import main as train_main


def spec(m) -> list:
    """An array's partition spec, JSON-ready (tuples as lists)."""
    return [list(a) if isinstance(a, tuple) else a for a in m.sharding.partition_spec]


def main(argv: list[str]) -> int:
    target, root = argv[0], Path(argv[1])
    assert jax.device_count() == 8, jax.devices()
    for mesh in json.loads(argv[2]):
        # (1, 4, 2) with the blockwise kernels (the first layer's slot attention): the dense reference's run
        kernels = ["--model.attention", "kernels"] if mesh == [1, 4, 2] else []
        assert train_main(train_runs.flags(target, root / "m{}{}{}".format(*mesh), mesh) + kernels) == 0, mesh
    report = {"errors": {}}
    for name, extra in {"mesh": ["--mesh.data", "3"], "batch": ["--data.batch_size", "4"]}.items():
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            rc = train_main(
                train_runs.flags(target, root / f"bad-{name}", (8, 1, 1) if name == "batch" else None) + extra
            )
        report["errors"][name] = [rc, err.getvalue()]
    # resume: the (2,2,2) run's step-2 checkpoint continued on an (8,1,1) mesh
    shutil.copytree(root / "m222", root / "resumed")
    shutil.rmtree(root / "resumed" / "checkpoints" / "3")
    assert train_main(train_runs.flags(target, root / "resumed", (8, 1, 1))) == 0
    report["resumed_from"] = json.loads((root / "resumed" / "summary.json").read_text())["resumed_from_step"]
    # how the (2,2,2) run's checkpoint lay on the mesh (orbax records each array's sharding)
    with ocp.StandardCheckpointer() as c:
        md = c.metadata(root / "m222" / "checkpoints" / "3" / "state")
    md = getattr(md, "item_metadata", md)
    report["params"] = {k: [list(v.shape), spec(v)] for k, v in md["params"].items()}
    report["opt"] = [[list(v.shape), spec(v)] for v in md["opt"].values()]
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
