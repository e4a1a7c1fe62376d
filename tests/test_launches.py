"""Kernel launches counted in a compiled program's optimized HLO (`peagle_jax.hardware.launches`): fusion
bodies and reducers are not launches, loop bodies count once, free instructions never."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from peagle_jax.hardware.launches import Launches, count_launches

HLO = """HloModule m, entry_computation_layout={(f32[4]{0})->f32[]}

%fused_computation (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  %e = f32[4]{0} exponential(%p)
  ROOT %n = f32[4]{0} negate(%e)
}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

ENTRY %main (x: f32[4]) -> f32[] {
  %x = f32[4]{0} parameter(0)
  %f = f32[4]{0} fusion(%x), kind=kLoop, calls=%fused_computation
  %c = f32[4]{0} custom-call(%f), custom_call_target="__cublas$gemm"
  %t = (f32[4]{0}) tuple(%c)
  %g = f32[4]{0} get-tuple-element(%t), index=0
  %z = f32[] constant(0)
  ROOT %r = f32[] reduce(%g, %z), dimensions={0}, to_apply=%add
}
"""


def test_a_hand_written_module():
    assert count_launches(HLO) == Launches(fusions=1, custom_calls=1, other=1)
    assert count_launches(HLO).total == 3
    assert count_launches("") == Launches(0, 0, 0)


def _compiled(steps: int, layers: int) -> str:
    def f(x, w):
        for _ in range(layers):  # unrolled: a launch per layer
            x = jnp.tanh(x @ w)
        return jax.lax.fori_loop(0, steps, lambda i, c: jnp.sin(c @ w), x).sum()

    return jax.jit(f).lower(jnp.ones((8, 64)), jnp.ones((64, 64))).compile().as_text()


def test_compiled_programs_count_unrolled_layers_not_loop_trips():
    one, three = count_launches(_compiled(5, 1)), count_launches(_compiled(5, 3))
    assert one.total > 0 and one.fusions > 0
    assert three.total > one.total  # two more layers, two more launches at least
    assert count_launches(_compiled(50, 1)) == one  # a loop body counts once, whatever its trip count
