"""``laserlm profile``: does a technique pay on this model and machine, before any calibration?

- :mod:`.timing`: per-layer decode time (the measured costs);
- :mod:`.quality`: raw / quick-lens exit agreement, Block Influence, attention / MLP skip sensitivity;
- :mod:`.sparse`: block-sparse attention density vs context length;
- :mod:`.costs`: break-even exit rates and acceptance, predicted speedups;
- :mod:`.run`: :func:`profile`, everything on one loaded model; :mod:`.report`: tables and plot;
- :mod:`.precision`: float16 / bfloat16 beside float32, layer by layer and head by head (``--precision``; seed 004
  §5.3); the float16 guard itself is a runtime piece, :mod:`laserlm.runtime.ranges`;
- :mod:`.cli`: the subcommand.
"""

from .run import profile

__all__ = ["profile"]
