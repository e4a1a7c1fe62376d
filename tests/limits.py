"""The tests' one time limit: a hang guard, never a measure of this machine's speed.

A subprocess a test starts (a command line, a training run, a second process of a multi-host
run) is given HANG_S seconds: far above what any of them needs on a loaded 2-core machine, so
that it only ends a test that hangs. No test asserts how long anything took."""

HANG_S = 1800
