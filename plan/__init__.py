"""`python -m plan` (also `python -m peagle_jax.plan`): the programs a user runs (the trainer's step of
each head kind, the serving rounds and the plain decode step), compiled for a named GPU or TPU
without one, or for this machine's devices and run (`--run`). It builds the trainer's own step,
so it sits above `train/` and the library; what it knows of devices, the roofline and kernel
launches stays in `peagle_jax.plan`."""
