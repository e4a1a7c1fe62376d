"""Independent check of the speculators export: vllm-project's own PyTorch P-EAGLE model
(PyPI `speculators`, eager attention, f32, CPU) loads a folder written by
`python -m peagle_jax.convert export --format speculators` and gives the same draft logits as
our drafter (`peagle_jax.models.eagle.cod_rows_forward`) on the same COD rows.

The rows are pinned (speculators samples them at random inside `forward`: its sampler is
replaced by one returning our anchors/depths), its loss is stubbed out (the default one needs
Triton; no logits are returned, so `lm_head` is hooked). Its `from_pretrained` wants the
verifier on a hub and silently fills a missing `mask_hidden` with random values, so the model
is built from the config and loaded with `load_state_dict(strict=False)`, and the
missing/unexpected keys are checked here.

Install (transformers is pinned by this project above what speculators 0.9.0 declares, so
speculators goes in without its dependency resolution):
    .venv/bin/pip install -e '.[speculators]'
    .venv/bin/pip install --no-deps speculators==0.9.0
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytestmark = [pytest.mark.speculators, pytest.mark.filterwarnings("ignore::FutureWarning")]

torch = pytest.importorskip("torch")
speculators = pytest.importorskip(
    "speculators",
    exc_type=ImportError,  # absent, or present without its import-time dependencies
    reason="needs the speculators package: pip install -e '.[speculators]' && pip install --no-deps speculators==0.9.0",
)

import jax.numpy as jnp  # noqa: E402
from speculators.config import SpeculatorModelConfig  # noqa: E402
from speculators.models.peagle import PEagleDraftModel  # noqa: E402
from speculators.models.peagle import core as peagle_core  # noqa: E402

from peagle_jax.config.drafter_config import DrafterConfig  # noqa: E402
from peagle_jax.config.target_config import RopeConfig  # noqa: E402
from peagle_jax.formats.convert import main  # noqa: E402
from peagle_jax.handles.drafter import Drafter  # noqa: E402
from peagle_jax.models.eagle import abstract_drafter, cod_rows_forward, flat_state  # noqa: E402

V, H, HT, T = 64, 32, 32, 12
TOL = 1e-4
LLAMA3 = RopeConfig(
    theta=10000.0,
    type="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=8,
)
CASES = {
    "1layer-V": dict(num_layers=1, vd=V),
    "1layer-Vd<V": dict(num_layers=1, vd=40, norm_before_residual=True),
    "2layer-V": dict(num_layers=2, vd=V, rope=LLAMA3),
    "2layer-Vd<V": dict(num_layers=2, vd=40, attention_bias=True),
}
# pinned COD rows over one packed sequence of two documents (positions 0-6 and 7-11): every
# depth-0 row, then nested chains (a depth-d row exists only with its depth d-1 parent).
DOC_IDS = np.array([0] * 7 + [1] * 5)
ANCHOR = np.array(list(range(T)) + [1, 2, 4, 7, 8, 9] + [1, 4, 8] + [4, 8])
DEPTH = np.array([0] * T + [1] * 6 + [2] * 3 + [3] * 2)


def random_drafter(num_layers: int, vd: int, seed: int = 0, **flags) -> Drafter:
    cfg = DrafterConfig(
        hidden_size=H,
        target_hidden_size=HT,
        num_layers=num_layers,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        intermediate_size=48,
        vocab_size=V,
        draft_vocab_size=vd,
        rms_norm_eps=1e-6,
        max_position_embeddings=64,
        mode="parallel",
        mask_token_id=V - 3,
        aux_layer_ids=(1, 3, 5),
        k_train=4,
        target_model_type="llama",
        verifier="tiny/llama",
        **flags,
    )
    rng = np.random.default_rng(seed)
    arrays = {}
    for path, var in flat_state(abstract_drafter(cfg)[1]).items():
        name = path[-2] if path[-1] in ("weight", "kernel", "bias", "embedding") else path[-1]
        if path[-1] == "weight":  # norms: around the identity, so a (1 + w) mix-up shows
            arrays[path] = 1.0 + 0.3 * rng.standard_normal(var.shape)
        elif name in ("embed_tokens", "mask_hidden"):
            arrays[path] = rng.standard_normal(var.shape)
        elif path == ("d2t",):
            used = np.sort(rng.choice(V, vd, replace=False)) if vd < V else np.arange(V)
            arrays[path] = used - np.arange(vd)
        else:
            arrays[path] = rng.standard_normal(var.shape) / np.sqrt(var.shape[0])
    return Drafter.from_arrays(
        cfg, {k: np.asarray(v, np.float32 if k != ("d2t",) else np.int32) for k, v in arrays.items()}
    )


def speculators_logits(folder: Path, aux: np.ndarray, input_ids: np.ndarray, monkeypatch):
    """(draft logits [N, Vd], the loaded torch model) from vllm-project's implementation."""
    from safetensors.torch import load_file

    raw = json.loads((folder / "config.json").read_text())
    cfg = SpeculatorModelConfig.from_dict(raw)  # its own schema validation
    assert type(cfg).__name__ == "PEagleSpeculatorConfig"
    cfg.transformer_layer_config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = PEagleDraftModel(cfg).eval()
    state = load_file(str(folder / "model.safetensors"))
    res = model.load_state_dict(state, strict=False)
    assert sorted(res.missing_keys) == ["verifier_lm_head.weight", "verifier_norm.weight"], res.missing_keys
    assert res.unexpected_keys == [], res.unexpected_keys
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if not name.startswith("verifier_") and t.is_floating_point():
            assert torch.isfinite(t).all(), f"{name} was not loaded"
    assert torch.equal(model.mask_hidden.detach(), state["mask_hidden"])

    monkeypatch.setattr(
        peagle_core, "generate_cod_sample_indices", lambda **kw: (torch.as_tensor(ANCHOR), torch.as_tensor(DEPTH))
    )
    monkeypatch.setattr(peagle_core, "compute_metrics", lambda **kw: (torch.zeros(()), {}))
    captured = {}
    hook = model.lm_head.register_forward_hook(lambda mod, args, out: captured.__setitem__("logits", out))
    try:
        with torch.no_grad():
            model(
                hidden_states=torch.as_tensor(aux)[None],
                input_ids=torch.as_tensor(input_ids)[None],
                document_ids=torch.as_tensor(DOC_IDS)[None],
                loss_mask=torch.ones(1, T),
                verifier_last_hidden_states=torch.zeros(1, T, HT),
                num_depths=int(DEPTH.max()) + 1,
            )
    finally:
        hook.remove()
    return captured["logits"][0].numpy(), model


@pytest.mark.parametrize("case", list(CASES))
def test_speculators_loads_our_export_with_the_same_logits(case, tmp_path, monkeypatch):
    spec = dict(CASES[case])
    drafter = random_drafter(spec.pop("num_layers"), spec.pop("vd"), **spec)
    own, out = tmp_path / "own", tmp_path / "spec"
    drafter.save(own)
    assert main(["export", str(own), str(out), "--format", "speculators", "--dtype", "float32"]) == 0

    rng = np.random.default_rng(1)
    input_ids = rng.integers(0, V, T)
    aux = rng.standard_normal((T, 3 * HT)).astype(np.float32)
    theirs, model = speculators_logits(out, aux, input_ids, monkeypatch)

    ours = cod_rows_forward(
        drafter.model,
        jnp.asarray(input_ids)[None],
        jnp.asarray(aux)[None],
        jnp.asarray(ANCHOR)[None],
        jnp.asarray(DEPTH)[None],
        jnp.asarray(DOC_IDS[ANCHOR])[None],
    )
    ours = np.asarray(ours[0])
    assert theirs.shape == ours.shape == (len(ANCHOR), drafter.config.draft_vocab_size)
    diff = float(np.abs(theirs - ours).max())
    print(f"\n[speculators parity] {case}: max |logits diff| = {diff:.3g} (logits scale {np.abs(ours).max():.3g})")
    assert diff <= TOL, f"{case}: max abs diff {diff}"
    # the draft -> target id map they would apply
    if drafter.config.draft_vocab_size < V:
        np.testing.assert_array_equal(model.d2t.numpy(), drafter.d2t)
        np.testing.assert_array_equal(model.t2d.numpy(), drafter.t2d)
    else:
        assert model.d2t is None
        assert model.t2d is None
