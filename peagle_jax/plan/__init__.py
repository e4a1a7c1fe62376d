"""`python -m peagle_jax.plan`: compile a user's program for a named GPU or TPU without one, and
read the compiler's verdict and memory plan (`devices`: the devices; `programs`: the programs;
`presets`: built-in target shapes)."""
