"""What the plan command (the top-level `plan` package, `python -m peagle_jax.plan`) knows without
building a program: the devices (`devices`: memory, bandwidth, peak rates, deviceless topologies),
the roofline model (`roofline`) and the kernel launches of a compiled program (`launches`)."""
