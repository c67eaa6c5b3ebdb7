"""A loss of the user's own (docs/layers.md): cross-entropy against labels smoothed toward the
uniform, a classifier's loss that takes an option from the job:

    modules: [mylosses.py]
    model:
      loss: {kind: "mylosses:smooth_ce", smoothing: 0.1}

With ``smoothing: 0`` it is raysinga's own ``softmax_cross_entropy``.
"""

from raysinga import kernels as K


def smooth_ce(logits, labels, denom, smoothing=0.1):
    """``(loss, d_loss/d_logits)``: ``logits`` ``(N, ..., k)``, integer class ``labels`` of
    the logits' shape without the last axis. Summed over the batch (and positions) and
    divided by ``denom`` (and the positions per sample), as raysinga's own: a worker passes
    its group's batch size, so that the group's gradient is the sum of its workers'."""
    if isinstance(smoothing, bool) or not isinstance(smoothing, (int, float)):
        raise ValueError(f"smoothing must be a number in [0, 1), got {smoothing!r}")
    if not 0 <= smoothing < 1:
        raise ValueError(f"smoothing must be in [0, 1), got {smoothing!r}")
    xp = K.get_array_module(logits)
    k = logits.shape[-1]
    positions = logits[0].size // k if len(logits) else 1
    z = logits - logits.max(axis=-1, keepdims=True)
    logp = z - xp.log(xp.exp(z).sum(axis=-1, keepdims=True))
    eye = xp.eye(k, dtype=logits.dtype)
    target = eye[labels.reshape(logits.shape[:-1])] * logits.dtype.type(1 - smoothing)
    target += logits.dtype.type(smoothing / k)
    scale = logits.dtype.type(1.0 / (denom * positions))
    loss = -(target * logp).sum() * scale
    return loss, (xp.exp(logp) - target) * scale


smooth_ce.classifies = True  # integer class labels, argmax a prediction: the run reports accuracy
