"""The custom KL estimators of ``examples/configs/custom_kl_ema.yaml``: a job file names one as
``algorithm.overrides.kl_fn: examples/custom_kl.py:capped_k3`` (any ``kl_fn(logp, ref_logp,
mask) -> per-token KL`` works; the trainers compute it in the loss as ``loss/kl``)."""
from __future__ import annotations

from primitives.maths.kl import create_confidence_masked_kl, create_truncated_kl

# each token's k3 estimate capped at 0.02: one surprising token cannot dominate the penalty
capped_k3 = create_truncated_kl(0.02)
# k3 counted only on tokens the policy chose with probability above 0.02
confident_k3 = create_confidence_masked_kl(0.02)
