"""This project's exports under vLLM's own code (0.33.0 and 0.34.0, on a CPU: tests/vllm_oracle.py).

Each head is exported by the converter and given to vLLM exactly as the printed serve command
says (its --speculative-config dict); vLLM builds its SpeculativeConfig (the config translation,
speculators configs included) and, where it accepts the head, makes the draft model and loads the
folder with its own loader. What is checked, per release:
- P-EAGLE (both formats): 0.33 serves it with parallel drafting, every tensor in place bit for
  bit, mask_hidden included; 0.34 refuses it with the errors `engines.VLLM_RELEASES` names, and
  `inspect --vllm-version` agrees with vLLM on every export (exit 1 exactly where vLLM refuses).
- A native P-EAGLE folder served as plain eagle3 on 0.34: loaded, mask_hidden skipped (its warning).
- `export --as eagle3`, EAGLE-3 and DFlash heads (both formats, full and draft vocabularies):
  loaded by both releases with every tensor where vLLM puts it, bit for bit, none left at its init;
  DFlash's causality translation as `dflash_causality` states it.
vLLM's drafters are not run: their forward passes need its compiled attention ops (vllm._C and
the V2 runner's GPU kernels for DFlash's input preparation), which a CPU without them lacks.
"""

from __future__ import annotations

import json
import shutil

import pytest
from head_folders import folder_tensors, random_drafter, run, write_target_config
from test_dflash_formats import head as dflash_head
from vllm_oracle import RELEASES, loaded_as_exported, run_oracle

from peagle_jax.formats import export_drafter
from peagle_jax.formats.engines import VLLM_RELEASES, parse_vllm_version

V, VD = 64, 40
# name: (how the head is made, export format, --as)
HEADS = {
    "peagle-vllm": ("parallel", "vllm", None),
    "peagle-speculators": ("parallel", "speculators", None),
    "peagle-as-eagle3": ("parallel", "vllm", "eagle3"),
    "eagle3-vllm": ("chain", "vllm", None),
    "eagle3-speculators": ("chain", "speculators", None),
    "dflash-vllm": ("dflash", "vllm", None),
    "dflash-speculators": ("dflash", "speculators", None),
    "dflash-speculators-draft-vocab": ("dflash-vd", "speculators", None),
}
PARALLEL = {n for n, (kind, _, as_kind) in HEADS.items() if kind == "parallel" and as_kind is None}


def make_head(kind: str):
    if kind.startswith("dflash"):
        return dflash_head(VD if kind == "dflash-vd" else V)
    return random_drafter(vd=VD, mode=kind, max_position_embeddings=4096)


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """{name: (folder, its spec as the printed serve command gives it)} and the target folder."""
    root = tmp_path_factory.mktemp("vllm-oracle")
    target = write_target_config(root / "target", num_key_value_heads=2, torch_dtype="float32")
    out = {}
    for name, (kind, fmt, as_kind) in HEADS.items():
        make_head(kind).save(root / "own" / name)
        folder, report = export_drafter(
            root / "own" / name, root / name, fmt, dtype="bfloat16", target=target, as_kind=as_kind
        )
        out[name] = (folder, json.loads(report["serve"].split("'")[1]))
    # speculators' own default, which makes vLLM run the layers of a head trained bidirectionally causally
    causal = shutil.copytree(out["dflash-speculators"][0], root / "dflash-speculators-swnc-false")
    cfg = json.loads((causal / "config.json").read_text())
    (causal / "config.json").write_text(json.dumps({**cfg, "sliding_window_non_causal": False}))
    out[causal.name] = (causal, {**out["dflash-speculators"][1], "model": str(causal)})
    return root, target, out


RELEASE = RELEASES[-1]  # tests/test_vllm_oracle_033.py runs these tests on vLLM 0.33.0 (its own worker)


@pytest.fixture(scope="module")
def served(request, exports):
    """(release, {name: what vLLM made of the head}, the exports): the module's RELEASE."""
    root, target, heads = exports
    release = request.module.RELEASE
    cases = [
        {
            "name": n,
            "target": str(target),
            "spec": spec,
            "load": n in HEADS,
            "npz": str(root / f"{release}-{n}.npz"),
        }
        for n, (_, spec) in heads.items()
    ]
    plain = {k: v for k, v in heads["peagle-vllm"][1].items() if k != "parallel_drafting"}  # a P-EAGLE folder as eagle3
    cases.append({**cases[0], "name": "peagle-vllm-plain", "spec": plain, "npz": str(root / f"{release}-p.npz")})
    got = run_oracle(release, cases, root / "work")
    for case in cases:
        got[case["name"]]["npz"] = case["npz"]
    return release, got, exports


def check_loaded(name: str, result: dict, folder, shared=frozenset()) -> set[str]:
    """The folder's tensors vLLM did not load (t2d aside: vLLM skips it by design); every
    parameter it made must hold its tensors bit for bit, and only `shared` come from the target."""
    tensors = folder_tensors(folder)
    used, wrong, from_target = loaded_as_exported(result["npz"], tensors)
    assert wrong == [], (name, wrong)
    assert from_target == set(shared), (name, from_target)
    return set(tensors) - used - {"t2d"}


def test_peagle_heads_are_served_by_0_33_and_refused_by_0_34(served):
    release, got, (_, _, heads) = served
    refusals = {fmt: r for (mode, fmt), r in VLLM_RELEASES[-1].refusals.items() if mode == "parallel"}
    for name in sorted(PARALLEL):
        fmt = HEADS[name][1]
        r = got[name]
        if release == "0.33.0":
            assert "error" not in r, (name, r)
            assert r["method"] == "eagle3" and r["parallel_drafting"] is True, (name, r)
            assert check_loaded(name, r, heads[name][0]) == set(), name  # mask_hidden loaded too
        else:
            assert "error" in r, (name, r)
            assert r["error"].split(": ", 1)[1] in refusals[fmt], (name, r["error"], refusals[fmt])


def test_a_native_peagle_folder_as_plain_eagle3_loads_without_mask_hidden(served):
    release, got, (_, _, heads) = served
    r = got["peagle-vllm-plain"]
    assert "error" not in r, r
    assert not r["parallel_drafting"]
    assert any("Skipping loading mask_hidden" in w for w in r["warnings"]), r["warnings"]
    assert check_loaded("peagle-vllm-plain", r, heads["peagle-vllm"][0]) == {"mask_hidden"}


@pytest.mark.parametrize("name", [n for n in HEADS if n not in PARALLEL])
def test_eagle3_and_dflash_exports_load_bit_exact(served, name):
    release, got, (_, _, heads) = served
    r = got[name]
    assert "error" not in r, (name, r)
    assert not any("mask_hidden" in w for w in r["warnings"]), r["warnings"]
    kind = HEADS[name][0]
    # speculators' DFlash layout ships no embed_tokens (and no lm_head with the full vocabulary): the target's
    shared = {"model.embed_tokens.weight", "lm_head.weight"} if name == "dflash-speculators" else set()
    shared |= {"model.embed_tokens.weight"} if name == "dflash-speculators-draft-vocab" else set()
    assert check_loaded(name, r, heads[name][0], shared) == set(), name
    assert r["method"] == ("dflash" if kind.startswith("dflash") else "eagle3")
    if kind.startswith("dflash"):
        # the head as trained (bidirectional inside the block): our exports keep vLLM from running it causally
        assert r["dflash_config"]["causal"] is False, r["dflash_config"]


def test_dflash_causality_translation_is_unchanged(served, capsys):
    """`sliding_window_non_causal: false` (speculators' default) makes every release run every layer
    causally (vLLM PR #56692 is open): vLLM's translation and the lint say the same."""
    release, got, (_, _, heads) = served
    r = got["dflash-speculators-swnc-false"]
    assert "error" not in r and r["dflash_config"]["causal"] is True, r
    version = ".".join(release.split(".")[:2])
    rc, out, _ = run(capsys, "inspect", heads["dflash-speculators-swnc-false"][0], "--vllm-version", version)
    assert rc == 1 and "sliding_window_non_causal false: vLLM (<= 0.34) runs full_attention layers" in out, out


def test_inspect_agrees_with_vllm_on_every_export(served, capsys):
    release, got, (_, target, heads) = served
    version = ".".join(release.split(".")[:2])
    assert parse_vllm_version(release) == parse_vllm_version(version)
    for name, (folder, _) in heads.items():
        if name not in HEADS:
            continue  # edited by hand (test_dflash_causality_translation_is_unchanged)
        rc, out, err = run(capsys, "inspect", folder, "--target", target, "--vllm-version", version)
        refused = "error" in got[name]
        assert rc == int(refused), (name, release, out, err)
        if refused:
            assert f"vLLM {version} refuses P-EAGLE heads" in out, out
