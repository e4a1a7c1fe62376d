"""`python tests/programs/lockstep_exchange.py PROCESS PORT`: one of two processes (jax.distributed
on 127.0.0.1:PORT) exchanging through `infer.serve.lockstep.Channel` payloads of each size the
channel treats apart (none, inline, the head's room exactly and one byte past it, several blocks),
process 1 asking to stop in the last exchange. Prints one JSON line: whether each payload arrived
whole, and who asked to stop in each exchange."""

import json
import sys

import numpy as np

from peagle_jax.runtime.distributed import DistConfig, setup

process, port = int(sys.argv[1]), sys.argv[2]
setup(DistConfig(f"127.0.0.1:{port}", num_processes=2, process_id=process, heartbeat_timeout=20), shutdown_timeout=60)

from infer.serve.lockstep import BLOCK_BYTES, INLINE_BYTES, Channel  # noqa: E402 - after jax.distributed

sizes = [0, 10, INLINE_BYTES, INLINE_BYTES + 1, INLINE_BYTES + 3 * BLOCK_BYTES + 5]
payloads = [np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes]
channel = Channel()
got = [
    channel.exchange(payload if process == 0 else b"", stop=process == 1 and i == len(sizes) - 1)
    for i, payload in enumerate(payloads)
]
print(
    json.dumps({"whole": [data == payload for (data, _), payload in zip(got, payloads)], "asked": [a for _, a in got]})
)
