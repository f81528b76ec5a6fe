"""The live step's operator count at the 11B shape, 64 slots, on the meta device: the CPU proxy for the
GPU's kernel count (benchmarks/step_ops.py states the counting rule)."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.step_ops import _WorkCounter, count_step_ops, main

# The count held: fusing the step's loops and its per-layer chains into Triton kernels, and the projections
# the checkpoint names apart into one matmul each, brought it here (3,581 before the kernels, 2,394 before
# the joins and joint projections); a change that adds operators to the step must lower another count or
# justify raising this one (docs/verification.md, "The GPU check"; docs/engine.md, "Fewer kernels in the
# live step").
MAX_WORK_OPS = 1961


def test_counter_skips_views_and_no_op_casts():
    x = torch.zeros(4, 8, device="meta")
    counter = _WorkCounter()
    with torch.inference_mode(), counter:
        y = x.view(8, 4).transpose(0, 1)[1:]  # views: no work
        x.to(torch.float32)  # the input itself: no work
        z = (y.float() + 1).to(torch.bfloat16)  # an add and a real cast
    assert z.dtype == torch.bfloat16
    assert sum(counter.by_op.values()) == 2 and counter.by_op["aten.add"] == 1


@pytest.fixture(scope="module")
def step_ops():
    return count_step_ops()


def test_live_step_at_64_slots_stays_under_the_held_count(step_ops):
    total = sum(step_ops.values())
    assert total > 1000  # it really ran the 11B step
    assert total <= MAX_WORK_OPS, step_ops.most_common(12)


def test_benchmark_reports_the_count_as_json(capsys):
    assert main(["--preset", "tiny", "--slots", "4"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["bench"] == "step_ops"
    assert out["work_ops"] == sum(count_step_ops("tiny", 4).values()) > 100
