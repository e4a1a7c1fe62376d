"""Independent check of the window rule and of the exported window keys: speculators' own
PyTorch P-EAGLE model (its `create_peagle_mask_mod` with `sliding_window`, eager attention)
loads our speculators export of a head with sliding layers and gives the same COD-row logits
as `cod_rows_forward` (the harness and its pinned rows: tests/test_speculators_parity.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytestmark = [pytest.mark.speculators, pytest.mark.filterwarnings("ignore::FutureWarning")]

pytest.importorskip("torch")
pytest.importorskip("speculators", exc_type=ImportError, reason="needs the speculators package")

import jax.numpy as jnp  # noqa: E402
from test_speculators_parity import ANCHOR, DEPTH, DOC_IDS, HT, TOL, V, random_drafter, speculators_logits  # noqa: E402

from peagle_jax.formats.convert import main  # noqa: E402
from peagle_jax.models.eagle import cod_rows_forward  # noqa: E402


def test_speculators_applies_our_window_the_same_way(tmp_path, monkeypatch):
    kw = dict(layer_types=("sliding_attention", "full_attention"), sliding_window=2)
    drafter = random_drafter(2, V, **kw)
    own, out = tmp_path / "own", tmp_path / "spec"
    drafter.save(own)
    assert main(["export", str(own), str(out), "--format", "speculators", "--dtype", "float32"]) == 0
    layer = json.loads((out / "config.json").read_text())["transformer_layer_config"]
    assert layer["layer_types"] == list(kw["layer_types"])
    assert layer["sliding_window"] == 2

    rng = np.random.default_rng(1)
    input_ids = rng.integers(0, V, len(DOC_IDS))
    aux = rng.standard_normal((len(DOC_IDS), 3 * HT)).astype(np.float32)
    theirs, _ = speculators_logits(out, aux, input_ids, monkeypatch)

    def ours(d):
        rows = (input_ids, aux, ANCHOR, DEPTH, DOC_IDS[ANCHOR])
        return np.asarray(cod_rows_forward(d.model, *(jnp.asarray(x)[None] for x in rows))[0])

    windowed = ours(drafter)
    assert float(np.abs(theirs - windowed).max()) <= TOL
    free = ours(random_drafter(2, V))  # the same weights without the window: other logits
    assert float(np.abs(free - windowed).max()) > 1e-2
