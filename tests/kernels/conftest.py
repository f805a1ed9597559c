"""Hypothesis profile for benchmarks/gpu_check.sh: no shrinking, so that a failing GPU test
reports its (unshrunk) example at once instead of spending the machine's minutes shrinking."""

from hypothesis import Phase, settings

settings.register_profile("gpu_check", phases=[Phase.explicit, Phase.reuse, Phase.generate])
