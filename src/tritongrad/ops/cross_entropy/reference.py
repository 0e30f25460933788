"""The cross-entropy family in plain PyTorch: the float64 references of the tests and the CPU path without
Triton. Imports torch only.

Semantics are ``torch.nn.functional.cross_entropy``'s for class-index targets (kernels.py has the formulas),
plus three extras: ``logit_scale`` (``z = k * input``, before everything else), ``logit_softcap``
(``u = cap * tanh(z / cap)`` before the softmax) and ``z_loss`` (each
non-ignored row's loss gains ``z_loss * lse**2``; the reduction, F's weighted mean included, applies to the
total). Out-of-range targets raise, as PyTorch's CPU loss does.
"""

from __future__ import annotations

import torch

REDUCTIONS = ("none", "mean", "sum")


def acc_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """float32, or float64 when any present tensor is float64."""
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


def check_targets(target: torch.Tensor, C: int, ignore_index: int, op: str = "cross_entropy") -> None:
    """Raise IndexError naming the first class index outside [0, C) that is not ``ignore_index``
    (reads the values: for tensors on the CPU)."""
    bad = (target != ignore_index) & ((target < 0) | (target >= C))
    if bool(bad.any()):
        i = int(bad.flatten().nonzero()[0, 0])
        raise IndexError(
            f"tritongrad.{op}: target holds class index {int(target.flatten()[i])} at position {i}, outside "
            f"[0, {C}) and not ignore_index={ignore_index}"
        )


def _readable(t: torch.Tensor) -> bool:
    """CPU tensors with values (not fake, not traced): their targets are checked on the host."""
    return (t.device.type == "cpu" and not torch.compiler.is_compiling()
            and not isinstance(t, torch._subclasses.fake_tensor.FakeTensor))


def _rows(input: torch.Tensor, target: torch.Tensor, weight, ignore_index: int, reduction: str,
          label_smoothing: float, logit_softcap, z_loss: float, logit_scale: float = 1.0):
    """(per-row loss, lse, denominator of the mean) in the accumulation dtype; input [N, C], target [N]."""
    acc = acc_dtype(input, weight)
    C = input.shape[-1]
    if _readable(target):
        check_targets(target, C, ignore_index)
    z = input.to(acc)
    if logit_scale != 1.0:
        z = z * logit_scale
    u = z if logit_softcap is None else logit_softcap * torch.tanh(z / logit_softcap)
    lse = torch.logsumexp(u, -1)
    logp = torch.log_softmax(u, -1)  # the row's max out first: u - lse would cancel at large common offsets
    valid = target != ignore_index
    safe = torch.where(valid, target, 0).long()
    w = weight.to(acc) if weight is not None else None
    w_t = w[safe] if w is not None else torch.ones_like(lse)
    w_t = torch.where(valid, w_t, 0.0)
    nll = torch.where(valid, -logp.gather(1, safe[:, None])[:, 0] * w_t, 0.0)  # ignored rows: 0, and no gradient
    loss = (1.0 - label_smoothing) * nll if label_smoothing else nll
    if label_smoothing:
        smooth = -(logp * w).sum(-1) if w is not None else -logp.sum(-1)
        loss = loss + torch.where(valid, smooth, 0.0) * (label_smoothing / C)
    if z_loss:
        loss = loss + torch.where(valid, z_loss * lse * lse, 0.0)
    return loss, lse, w_t.sum()


def _reduce(loss: torch.Tensor, denom: torch.Tensor, reduction: str) -> torch.Tensor:
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    # a zero denominator (every row ignored, or every target's class weight 0) gives NaN, as in F, also where
    # smoothing makes the sum nonzero; and NaN gradients for the rows not ignored, as F's
    return loss.sum() / torch.where(denom == 0, float("nan"), denom)


def cross_entropy_reference(
    input: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    logit_softcap: float | None = None,
    z_loss: float = 0.0,
    compute_grad: bool = True,
    return_lse: bool = True,
    logit_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss, lse)`` of logits ``input [N, C]`` and class indices ``target [N]``; the loss in input's dtype
    (``[N]`` for reduction="none", else 0-d), lse in float32 (float64 when input or weight is float64).
    Accumulated in that dtype, rounded once. ``compute_grad`` is the registered op's hint (kernels only);
    without ``return_lse`` the lse of ignored rows is 0 (the kernels do not read those rows)."""
    loss, lse, denom = _rows(input, target, weight, ignore_index, reduction, label_smoothing, logit_softcap, z_loss,
                             logit_scale)
    if not return_lse:
        lse = torch.where(target != ignore_index, lse, 0.0)
    return _reduce(loss, denom, reduction).to(input.dtype), lse


def linear_cross_entropy_reference(
    input: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    logit_softcap: float | None = None,
    z_loss: float = 0.0,
    grads: list[bool] | None = None,
    out_dtype: torch.dtype | None = None,
    logit_scale: float = 1.0,
    grad_weight_f32: bool = False,
) -> torch.Tensor:
    """``cross_entropy(logit_scale * F.linear(input, weight, bias), target, ...)`` for ``input [N, H]``,
    ``weight [V, H]``: the product rounded to input's dtype as F.linear returns it, then scaled, and the loss
    accumulated in float32 (float64 for float64) and returned in ``out_dtype`` (None: input's dtype).
    ``grads`` and ``grad_weight_f32`` are the registered op's hints (kernels only)."""
    logits = torch.nn.functional.linear(input, weight, bias)
    loss, _, denom = _rows(logits, target, None, ignore_index, reduction, label_smoothing, logit_softcap, z_loss,
                           logit_scale)
    return _reduce(loss, denom, reduction).to(input.dtype if out_dtype is None else out_dtype)
