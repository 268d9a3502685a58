// Shared preamble of every kernel: extensions, the work-group size as specialization
// constant 0, and the step buffer through which per-step values reach recorded graphs.
#extension GL_EXT_shader_16bit_storage : require
#extension GL_EXT_shader_explicit_arithmetic_types_int16 : enable
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_arithmetic : require
#extension GL_EXT_control_flow_attributes : enable

layout(local_size_x_id = 0, local_size_y = 1, local_size_z = 1) in;
layout(constant_id = 0) const uint WG = 64;

// The step buffer: a header (tokens, output rows, the arrays' length `cap`), then four
// arrays of `cap` entries each (token ids, positions, sequence ids, rows whose logits are
// wanted). Written by the host before each submit; every kernel that depends on the
// batch reads it. `cap` is the backend's largest bucket (the physical batch, -ub), read
// from the header so that one SPIR-V serves every batch size.
#define DECLARE_STEP(b) \
    layout(binding = b, std430) readonly buffer StepBuf { \
        uint n_tokens; uint n_out; uint cap; uint pad1; uint sdata[]; \
    } step;
#define STEP_CAP (step.cap)
#define STEP_TOKEN(i) step.sdata[(i)]
#define STEP_POS(i) step.sdata[STEP_CAP + (i)]
#define STEP_SEQ(i) step.sdata[2 * STEP_CAP + (i)]
#define STEP_OUT(i) step.sdata[3 * STEP_CAP + (i)]
// the highest position token i sees: its own (causal), or its entry's last (non-causal
// entries); filled only for the steps whose graph reads it (attn_prefill's NONCAUSAL)
#define STEP_VIS(i) step.sdata[4 * STEP_CAP + (i)]
// count selectors in push constants: 0 = tokens of the step, 1 = output rows
#define STEP_COUNT(sel) ((sel) == 0u ? step.n_tokens : step.n_out)

// a flat work-group index over a 2-D grid (grids wider than 65535 groups)
#define FLAT_GROUP (gl_WorkGroupID.x + gl_WorkGroupID.y * gl_NumWorkGroups.x)
