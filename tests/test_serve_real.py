"""`python -m infer serve` on the real Gemma-3-270M: concurrent chat requests, each equal to
`SpeculativeDecoder.generate` of its conversation alone (a random P-EAGLE head: the engine is
lossless whatever the head drafts)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from serve_support import ServerProcess

pytestmark = pytest.mark.real
openai = pytest.importorskip("openai")

K, NEW = 3, 10
QUESTIONS = ["What is the capital of France?", "Write a Python function that adds two numbers.", "Name three colours."]


def test_concurrent_chats_equal_generate_alone(tmp_path):
    import peagle_jax as pj
    from infer import SpeculativeDecoder
    from peagle_jax.sources.assets import prepare

    folder = prepare("gemma3-270m")
    target = pj.load_target(folder, dtype="float32")
    drafter = pj.new_drafter(target, num_layers=1, mode="parallel", seed=0, draft_vocab=np.arange(32768))
    drafter.save(tmp_path / "head")
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
    dec = SpeculativeDecoder(target, drafter, k=K, mode="parallel")
    want = dec.generate(conversations, max_new_tokens=NEW).texts  # a padded batch decodes each row as alone

    argv = ["--target", str(folder), "--drafter", str(tmp_path / "head"), "--k", str(K)]
    # two slots for three requests: one waits in the queue and takes the slot the first to end frees;
    # prompts in pieces of 16 (two prefill programs to compile, each prompt in two or more calls)
    argv += ["--max-batch", "2", "--max-len", "256", "--prefill-chunk", "16"]
    server = ServerProcess(argv, tmp_path / "server.log", "gemma")
    try:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)

        def chat(c):
            res = client.chat.completions.create(model="gemma", messages=c, max_tokens=NEW, temperature=0)
            return res.choices[0].message.content

        with ThreadPoolExecutor(len(conversations)) as pool:
            got = list(pool.map(chat, conversations))
    finally:
        assert server.stop() == 0, server.stderr()
    assert got == want
    assert all(want)  # something was generated
