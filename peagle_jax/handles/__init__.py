"""The handles users hold (`peagle_jax.load_target`, `new_drafter`, `load_drafter`): `target`
(Target: load, forward, tokenizer, caches), `drafter` (Drafter: new, load, save) and
`drafter_init` (a head's first layer from a target layer). They stand on both wings: they read
through `formats` and hand the engine what it runs."""
