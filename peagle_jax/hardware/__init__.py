"""What the plan command (`python -m plan`) knows of devices without building a program:
`devices` (memory, bandwidth, peak rates, deviceless topologies), `roofline` (the roofline model)
and `launches` (the kernel launches of a compiled program)."""
