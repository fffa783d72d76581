"""Precision profile (seed 004 §5.3): float16 and bfloat16 beside float32, layer by layer and head by head
(:mod:`laserlm.precision.profile`; ``laserlm profile --precision MODEL``, :mod:`laserlm.precision.cli`). The float16
guard and the range monitor themselves are runtime pieces: :mod:`laserlm.runtime.ranges`."""
