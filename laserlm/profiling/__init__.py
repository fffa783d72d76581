"""``laserlm profile``: does a technique pay on this model and machine, before any calibration?

- :mod:`.timing`: per-layer decode time (the measured costs);
- :mod:`.quality`: raw / quick-lens exit agreement, Block Influence, attention / MLP skip sensitivity;
- :mod:`.sparse`: block-sparse attention density vs context length;
- :mod:`.costs`: break-even exit rates and acceptance, predicted speedups;
- :mod:`.run`: :func:`profile`, everything on one loaded model; :mod:`.report`: tables and plot;
- :mod:`.cli`: the subcommand.
"""

from .run import profile

__all__ = ["profile"]
