"""The TPU plan's HBM byte count (``benchmarks.tpu_plan.HbmBytes``) on hand-written optimised HLO, in the forms
XLA:TPU gives a scan over layers (a stacked array ``[L, ...]`` read one layer an iteration, and written one layer an
iteration): each iteration moves one layer, not the stack. Counting the stack each time made a depth-1000 MLP's
step move ~300x its real bytes (quadratic in depth), and the plan's memory-bound times with it. No libtpu needed:
the counter reads the text."""

from __future__ import annotations

from benchmarks.tpu_plan import HbmBytes, OpCount

LAYER = 256 * 128  # one layer's elements; the stack holds 1000 of them
STACK = 1000 * LAYER

# A loop body's fusion reading layer i of two stacked arrays through nested fusions, one of them through an
# in-place relayout (XLA:TPU's copy fusion with output_to_operand_aliasing) of a pred stack; and a fusion writing
# layer i into a stacked pred array through such a relayout (a dynamic-update-slice in place).
HLO = """HloModule scan_body, entry_computation_layout={()->f32[256,128]{1,0}}

%copy_fusion (p: pred[1000,256,128]) -> pred[1000,256,128] {
  %p = pred[1000,256,128]{2,1,0:T(32,128)(4,1)} parameter(0)
  ROOT %copy.1 = pred[1000,256,128]{2,1,0:T(8,128)(4,1)} copy(%p)
}

%read_one_layer (q0: bf16[1000,256,128], q1: s32[]) -> bf16[256,128] {
  %q0 = bf16[1000,256,128]{2,1,0:T(8,128)(2,1)} parameter(0)
  %q1 = s32[]{:T(128)} parameter(1)
  %z = s32[]{:T(128)} constant(0)
  %ds = bf16[1,256,128]{2,1,0:T(8,128)(2,1)} dynamic-slice(%q0, %q1, %z, %z), dynamic_slice_sizes={1,256,128}
  ROOT %b = bf16[256,128]{1,0:T(8,128)(2,1)} bitcast(%ds)
}

%read_one_mask (m0: pred[1000,256,128], m1: s32[]) -> pred[256,128] {
  %m0 = pred[1000,256,128]{2,1,0:T(32,128)(4,1)} parameter(0)
  %relaid = pred[1000,256,128]{2,1,0:T(8,128)(4,1)} fusion(%m0), kind=kLoop, output_to_operand_aliasing={{}: (0, {})}, calls=%copy_fusion
  %m1 = s32[]{:T(128)} parameter(1)
  %z = s32[]{:T(128)} constant(0)
  %ds = pred[1,256,128]{2,1,0:T(8,128)(4,1)} dynamic-slice(%relaid, %m1, %z, %z), dynamic_slice_sizes={1,256,128}
  ROOT %b = pred[256,128]{1,0:T(8,128)(4,1)} bitcast(%ds)
}

%backward_step (a0: bf16[1000,256,128], a1: pred[1000,256,128], a2: s32[]) -> f32[256,128] {
  %a0 = bf16[1000,256,128]{2,1,0:T(8,128)(2,1)} parameter(0)
  %a1 = pred[1000,256,128]{2,1,0:T(32,128)(4,1)} parameter(1)
  %a2 = s32[]{:T(128)} parameter(2)
  %x = bf16[256,128]{1,0:T(8,128)(2,1)} fusion(%a0, %a2), kind=kLoop, calls=%read_one_layer
  %m = pred[256,128]{1,0:T(8,128)(4,1)} fusion(%a1, %a2), kind=kLoop, calls=%read_one_mask
  %xf = f32[256,128]{1,0:T(8,128)} convert(%x)
  %zero = f32[] constant(0)
  %zeros = f32[256,128]{1,0:T(8,128)} broadcast(%zero), dimensions={}
  ROOT %out = f32[256,128]{1,0:T(8,128)} select(%m, %xf, %zeros)
}

%write_one_mask (w0: pred[1000,256,128], w1: s32[], w2: f32[1,256,128]) -> pred[1000,256,128] {
  %w0 = pred[1000,256,128]{2,1,0:T(32,128)(4,1)} parameter(0)
  %relaid = pred[1000,256,128]{2,1,0:T(8,128)(4,1)} fusion(%w0), kind=kLoop, output_to_operand_aliasing={{}: (0, {})}, calls=%copy_fusion
  %w2 = f32[1,256,128]{2,1,0:T(8,128)} parameter(2)
  %zero = f32[] constant(0)
  %zeros = f32[1,256,128]{2,1,0:T(8,128)} broadcast(%zero), dimensions={}
  %gt = pred[1,256,128]{2,1,0:T(8,128)(4,1)} compare(%w2, %zeros), direction=GT
  %w1 = s32[]{:T(128)} parameter(1)
  %z = s32[]{:T(128)} constant(0)
  ROOT %dus = pred[1000,256,128]{2,1,0:T(32,128)(4,1)} dynamic-update-slice(%relaid, %gt, %w1, %z, %z)
}

ENTRY %main (e0: bf16[1000,256,128], e1: pred[1000,256,128], e2: s32[], e3: f32[1,256,128]) -> f32[256,128] {
  %e0 = bf16[1000,256,128]{2,1,0:T(8,128)(2,1)} parameter(0)
  %e1 = pred[1000,256,128]{2,1,0:T(32,128)(4,1)} parameter(1)
  %e2 = s32[]{:T(128)} parameter(2)
  %e3 = f32[1,256,128]{2,1,0:T(8,128)} parameter(3)
  %masks = pred[1000,256,128]{2,1,0:T(32,128)(4,1)} fusion(%e1, %e2, %e3), kind=kLoop, calls=%write_one_mask
  ROOT %grad = f32[256,128]{1,0:T(8,128)} fusion(%e0, %masks, %e2), kind=kOutput, calls=%backward_step
}
"""


def test_a_scan_body_moves_one_layer_of_its_stacked_arrays_not_the_stack():
    per_instr = {}
    counter = HbmBytes(HLO)
    entry = next(c for c in counter.comps.values() if c.entry)
    for ins in entry.instrs.values():
        per_instr[ins.name] = counter.own(entry, ins)
    # writing layer i of the pred stack in place: the update written and read, and the f32 layer it compares
    assert per_instr["masks"] == 2 * LAYER * 1 + LAYER * 4 + 4
    # reading layer i of the bf16 stack and of the pred stack (through the relayout), writing the f32 result
    assert per_instr["grad"] == LAYER * 2 + LAYER * 1 + 4 + LAYER * 4
    assert counter.flops()[0] == sum(per_instr.values()) < STACK  # far below one stack, let alone one per layer


def test_the_ops_a_call_executes_count_each_fusion_once():
    assert OpCount(HLO).flops()[0] == 2  # the two fusions of the entry; parameters and the fused bodies not
