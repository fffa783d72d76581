"""Calibration: train exit heads, exit gates and the router on a frozen model, and calibrate the
exit thresholds to a quality target with a statistical guarantee (``laserlm calibrate``).

Pipeline (each stage a small module):

- :mod:`.collect`: hidden states at the exit points, collected once from the frozen model with the
  engine primitives (``Engine.begin / run_layers / head``) on local valid/dev text;
- :mod:`.heads` / :mod:`.train`: identity-initialised affine or low-rank "tuned lens" adapters per
  exit point, trained by KL distillation to the full model's next-token distribution;
- :mod:`.gates`: a tiny classifier per exit point predicting "exit head top-1 == full-model top-1"
  (focal loss);
- :mod:`.router`: labels and training of seed 004's DynamicRouter (:mod:`laserlm.depth.router`);
- :mod:`.thresholds`: Learn-then-Test threshold calibration with a binomial-tail guarantee;
- the result is one laser file (:mod:`laserlm.depth.laser_file`) tied to the base model's weight hash.
"""
