"""`--data.cache_features DIR`: the target's features of each training sequence, computed once
(the first time a sequence is used) and read back on every later epoch.

One file per (example, length bucket): `{index}-{length}.npz` with aux [L, 3H] and the
final-norm states y [L, H] (float32, as the step receives them), written to a temporary name
and renamed. `meta.json` records what the features depend on (target, tokenization, lengths);
a folder made for other settings is refused rather than silently reused.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax.numpy as jnp
import numpy as np

__all__ = ["FeatureCache", "FeatureCacheError"]


class FeatureCacheError(ValueError):
    """A feature folder made for other settings (one-line message)."""


class FeatureCache:
    def __init__(self, folder: Path, stepper, target_path, cfg):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.stepper = stepper
        meta = {
            "target": str(Path(target_path).absolute()),
            "dtype": cfg.model.dtype,
            "source": cfg.data.source,
            **{k: getattr(cfg.data, k) for k in ("split", "subset", "revision")},  # a Hub dataset's part
            "max_conversations": cfg.data.max_conversations,
            "template": cfg.data.template,
            "max_len": cfg.data.max_len,
            "too_long": cfg.data.too_long,
            "aux_layer_ids": list(stepper.aux_ids),
        }
        path = self.folder / "meta.json"
        if path.exists():
            old = json.loads(path.read_text())
            for k, v in meta.items():
                if old.get(k) != v:
                    raise FeatureCacheError(
                        f"data.cache_features {self.folder}: made for {k}={old.get(k)!r}, "
                        f"this run has {v!r} (use another folder)"
                    )
        else:
            path.write_text(json.dumps(meta, indent=2))
        self.hits = self.misses = 0

    def _one(self, example, tokens, positions):
        length = tokens.shape[-1]
        path = self.folder / f"{example.index}-{length}.npz"
        if path.exists():
            self.hits += 1
            with np.load(path) as z:
                return z["aux"], z["y"]
        self.misses += 1
        aux, y = self.stepper.features(tokens[None], positions[None])
        aux, y = np.asarray(aux[0], np.float32), np.asarray(y[0], np.float32)
        tmp = path.with_name(path.name + ".tmp.npz")
        np.savez(tmp, aux=aux, y=y)
        os.replace(tmp, path)
        return aux, y

    def get(self, examples, batch):
        parts = [self._one(e, batch.tokens[i], batch.positions[i]) for i, e in enumerate(examples)]
        return jnp.asarray(np.stack([p[0] for p in parts])), jnp.asarray(np.stack([p[1] for p in parts]))
