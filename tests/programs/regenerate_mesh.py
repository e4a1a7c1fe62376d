"""`python tests/programs/regenerate_mesh.py FOLDER CACHE_DIR`: `--data.regenerate` in process on a
data-4 mesh of the 4 devices this process must see, against one device, for the tiny target in the
HF folder FOLDER; prints one JSON line: whether the answers are the same (`same`), how many
conversations were answered (`answered`), and over how many devices the engine's first decode
state spreads its rows of a batch of 4 on the mesh (`row_shards`)."""

import json
import sys
from pathlib import Path

import jax

import peagle_jax as pj
from peagle_jax.engine import SpeculativeDecoder
from peagle_jax.runtime.sharding import device_mesh
from train.data import synthetic_conversations
from train.regenerate import regenerate


def main(argv: list[str]) -> int:
    folder, caches = argv[0], Path(argv[1])
    assert len(jax.devices()) == 4, jax.devices()
    records = [(f"row {i}", {"messages": c}) for i, c in enumerate(synthetic_conversations(10, seed=3))]
    answers = {}
    for mesh in (None, device_mesh(-1, 1, 1)):
        target = pj.load_target(folder, dtype="float32")
        cache = caches / f"mesh-{mesh is not None}.jsonl"
        answers[mesh is not None] = regenerate(records, target, cache, 6, batch=4, mesh=mesh)
    _, _, state = SpeculativeDecoder(target, mode="none").start([[2, 9, 7]] * 4, max_new_tokens=4)
    rows = {str(s.index) for s in state.length.addressable_shards}
    print(
        json.dumps({"same": answers[True] == answers[False], "answered": len(answers[True]), "row_shards": len(rows)})
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
