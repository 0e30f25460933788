"""Compile, for an H100/H200 (sm_90), every kernel specialization that the post-training launchers request at
the target vocabulary (128256), without a GPU: the launchers run on CPU tensors with kernel launches replaced
by a compile (tests/sm90.py). Run as a script (TRITON_INTERPRET must be off); prints one line per failure and
a final count, and with ``--resources`` each specialization's registers, stack and shared memory; more than two
register-spill stores fail the run. Used by tests/test_post_training.py.

The row count does not change a specialization (only dtypes, alignment and the plan, which the vocabulary
decides); the plans are told the target's 8192 rows.
"""

import sys

import sm90  # noqa: F401  (first: Triton out of its interpreter)
import torch

from tritongrad import _runtime
from tritongrad.ops.post_training import linear_dpo_loss, linear_grpo_loss, linear_jsd, linear_token_logprobs_op

_ONE_OFF_STORES = 2  # as ce_sm90_compile.py: a one-off save is no spill in a loop


def _check(name, shown, compiled) -> list:
    res, spills = sm90.resources(compiled.asm["cubin"])
    if sm90.SHOW:
        print(name, shown, res)
    return [f"{name} {shown}: {spills} register spill stores ({res})"] if spills > _ONE_OFF_STORES else []


def _calls(dtype, V: int, weight_dtype=None) -> None:
    N, H = 16, 32
    h = torch.randn(N, H).to(dtype).requires_grad_()
    W = (torch.randn(V, H) / 6).to(weight_dtype or dtype).requires_grad_()
    t = torch.randint(0, V, (N,))
    t[3] = -100
    # the log-probabilities alone, with the entropy (its gradient too), with TRL's statistics
    for entropy, stats in ((False, False), (True, False), (True, True)):
        lp, ent, _ = linear_token_logprobs_op(h, W, t, None, -100, 1.25, entropy, stats)
        (lp.sum() + (ent.sum() if entropy else 0)).backward()
    # with a final-logit soft cap (HAS_CAP)
    lp, ent, _ = linear_token_logprobs_op(h, W, t, None, -100, 1.0, True, True, False, 30.0, 1.25)
    (lp.sum() + ent.sum()).backward()
    if weight_dtype is not None:
        return
    # the fused GRPO op (its two kernels, the forward's gradient), distillation in its three modes
    loss, _ = linear_grpo_loss(h.reshape(2, 8, H), W, t.reshape(2, 8).clamp(min=0), torch.randn(2),
                               ref_logprobs=-torch.rand(2, 8), beta=0.04)
    loss.backward()
    if dtype != torch.float16:  # the fused DPO op, with WPO's per-row statistic (HAS_SQ)
        loss, _ = linear_dpo_loss(h.reshape(2, 8, H), W, t.reshape(2, 8).clamp(min=0),
                                  ref_chosen_logps=-torch.rand(1) * 9, ref_rejected_logps=-torch.rand(1) * 9,
                                  use_weighting=True)
        loss.backward()
    ht, Wt = torch.randn(N, 16).to(dtype), torch.randn(V, 16).to(dtype)
    for beta in (0.0, 1.0, 0.5):
        linear_jsd(h, W, ht, Wt, 1.0, beta).backward()
    # with soft caps: GRPO's fused op, and distillation with the student's and the teacher's (HAS_CAP_S, _T)
    loss, _ = linear_grpo_loss(h.reshape(2, 8, H), W, t.reshape(2, 8).clamp(min=0), torch.randn(2),
                               temperature=0.7, logit_softcap=30.0)
    loss.backward()
    linear_jsd(h, W, ht, Wt, 0.7, 0.5, student_logit_softcap=30.0, teacher_logit_softcap=30.0).backward()


def main() -> int:
    compiler = sm90.Compiler(_check)
    compiler.install()
    _runtime.hint = lambda n: 8192
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        _calls(dtype, 128256)
    _calls(torch.bfloat16, 128256, torch.float32)  # a float32 head with bfloat16 hidden states (autocast's case)
    return compiler.report()


if __name__ == "__main__":
    sys.exit(main())
