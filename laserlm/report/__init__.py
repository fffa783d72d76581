"""Reports that combine the tools (``laserlm report``): :mod:`.seeds` reproduces both seeds' result tables with
laserlm's figures from one run, driving evaluation (:mod:`laserlm.evaluation`) and measurement
(:mod:`laserlm.bench`). It sits above the tools in the package's layers, so the tools stay independent."""
