"""What every process of the project shares beneath the models, none of it importing JAX at import
time but `timing` and `sharding`: `command_line` (one-line errors, exit codes, SIGTERM as an
interrupt), `folders` (atomic folder writes), `sharding` (the mesh and its rules), `distributed`
(processes across hosts), `host` (the allocator and the garbage collector, set up for JAX),
`compile_cache` (JAX's persistent cache) and `timing` (timing programs side by side)."""
