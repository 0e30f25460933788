"""Launch plans are pure functions of (shape, dtypes, device properties, tuning table): every decision the norm
and weighted_sum launchers make, and the other families' plans, over a grid of shapes, dtypes and three devices
(tests/plan_grid.py), hashed. A plan that changes changes this digest: update it on purpose, with the device
time that justifies the change (BENCHMARKS.md). ``python tests/plan_grid.py`` prints the cases."""

import dataclasses

import plan_grid

from tritongrad.ops.cross_entropy import plans as ce_plans
from tritongrad.ops.norm import plans as norm_plans
from tritongrad.ops.rope import plans as rope_plans
from tritongrad.ops.swiglu import plans as swiglu_plans
from tritongrad.ops.weighted_sum import plans as ws_plans

DIGEST = "1312ede668f8e2302d17990fd8081a552e31588b54f13629c8032f005b28f129"


def test_every_plan_is_unchanged():
    assert plan_grid.digest() == DIGEST


def test_a_table_passed_in_plans_without_touching_the_module():
    # Another table changes the plans inside the block only; the tuned table and its plans are untouched.
    before = plan_grid.digest()
    with ws_plans.using(dataclasses.replace(ws_plans.TABLE, SPLIT_BWD_BYTES=0, SPLIT_BWD_ROWS=0)), \
            norm_plans.using(dataclasses.replace(norm_plans.TABLE, BWD_MAX_BLOCK_D=16, LONG_BWD_CHUNK=8)):
        assert plan_grid.digest() != before
    assert plan_grid.digest() == before == DIGEST


def test_every_family_plans_from_the_table_in_use():
    # cross_entropy, rope and swiglu too: each family's table, passed in, changes the digest inside the block.
    before = plan_grid.digest()
    for plans, knobs in ((ce_plans, dict(WARPS_PER_SM=8)), (rope_plans, dict(MAX_BLOCK_H=4)),
                         (swiglu_plans, dict(NUM_WARPS=4))):
        with plans.using(dataclasses.replace(plans.TABLE, **knobs)):
            assert plan_grid.digest() != before, plans.__name__
    assert plan_grid.digest() == before
