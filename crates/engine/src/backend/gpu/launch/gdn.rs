//! Launches of the Gated DeltaNet kernels of hybrid models: the causal convolution, the q/k
//! normalization, the gates, the recurrence (token by token or chunked) and the gated norm.

use super::*;

/// Where a Gated DeltaNet kernel keeps the state after each of the last `count` tokens of a run (as the CPU's
/// `gdn::Steps`): step `j` of this part of the state goes to `buf + 4 · (j · stride + offset)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DevSteps {
    /// The steps of the whole recurrent state.
    pub buf: DevPtr,
    /// Floats per step.
    pub stride: usize,
    /// Where this part (a layer's matrices or window) sits in a step, floats.
    pub offset: usize,
    /// Steps kept.
    pub count: usize,
}

fn steps_args(steps: Option<DevSteps>, n: usize) -> Result<[Arg; 4], DeviceError> {
    let s = steps.unwrap_or(DevSteps {
        buf: DevPtr(0),
        stride: 0,
        offset: 0,
        count: 0,
    });
    if s.count > n {
        return Err(unsupported(format!("{} steps of a run of {n}", s.count)));
    }
    Ok([
        Arg::Ptr(s.buf),
        Arg::I32(int(s.stride, "a step stride")?),
        Arg::I32(int(s.offset, "a step offset")?),
        Arg::I32(int(s.count, "steps")?),
    ])
}

/// Gated DeltaNet's causal convolution of `n` tokens' `[q | k | v]` at `x` with `taps` (`conv_dim ×
/// kernel`), continuing from `window` (updated in place), into `y`.
#[expect(
    clippy::too_many_arguments,
    reason = "the convolution's state and its outputs"
)]
pub fn gdn_conv(
    l: &dyn Launcher,
    shape: &crate::backend::gdn::Shape,
    taps: DevPtr,
    window: DevPtr,
    x: DevPtr,
    n: usize,
    y: DevPtr,
    steps: Option<DevSteps>,
) -> Result<(), DeviceError> {
    if shape.kernel < 2 || shape.kernel > crate::backend::gdn::MAX_KERNEL {
        return Err(unsupported(format!(
            "a convolution of {} taps",
            shape.kernel
        )));
    }
    let cd = shape.conv_dim();
    let [sb, ss, so, sc] = steps_args(steps, n)?;
    let args = [
        Arg::Ptr(taps),
        Arg::Ptr(window),
        Arg::Ptr(x),
        Arg::Ptr(y),
        Arg::I32(int(n, "tokens")?),
        Arg::I32(int(cd, "channels")?),
        Arg::I32(shape.kernel as i32),
        sb,
        ss,
        so,
        sc,
    ];
    l.launch(&thorn_kernels::GDN, "gdn_conv", elementwise(cd), &args)
}

/// L2-normalises the q and k heads of `n` tokens of convolution output `y` (q also scaled by `1/sqrt(dk)`).
pub fn gdn_normalize_qk(
    l: &dyn Launcher,
    shape: &crate::backend::gdn::Shape,
    y: DevPtr,
    n: usize,
) -> Result<(), DeviceError> {
    if n == 0 {
        return Ok(());
    }
    let shape_ = Shape {
        grid: [
            int(n, "tokens")? as u32,
            int(2 * shape.kh, "heads")? as u32,
            1,
        ],
        block: [32, 1, 1],
        shared: 0,
    };
    let args = [
        Arg::Ptr(y),
        Arg::I32(int(shape.conv_dim(), "channels")?),
        Arg::I32(int(shape.kh, "heads")?),
        Arg::I32(int(shape.dk, "a head width")?),
    ];
    l.launch(&thorn_kernels::GDN, "gdn_normalize_qk", shape_, &args)
}

/// The decay and write-strength gates of `n` tokens × `vh` heads, in place (`alpha` becomes the log decay,
/// `b` becomes beta).
pub fn gdn_gates(
    l: &dyn Launcher,
    a: DevPtr,
    dt_bias: DevPtr,
    alpha: DevPtr,
    b: DevPtr,
    n: usize,
    vh: usize,
) -> Result<(), DeviceError> {
    let args = [
        Arg::Ptr(a),
        Arg::Ptr(dt_bias),
        Arg::Ptr(alpha),
        Arg::Ptr(b),
        Arg::I32(int(n, "tokens")?),
        Arg::I32(int(vh, "heads")?),
    ];
    l.launch(&thorn_kernels::GDN, "gdn_gates", elementwise(n * vh), &args)
}

/// The delta-rule recurrence of every value head over `n` tokens: `y` the normalised convolution output,
/// `g` and `beta` the gates (`n × vh`), `state` the heads' `[dk][dv]` matrices (updated), `o` the outputs
/// (`n × vh × dv`).
#[expect(
    clippy::too_many_arguments,
    reason = "the recurrence's inputs, state and outputs"
)]
pub fn gdn_recurrence(
    l: &dyn Launcher,
    shape: &crate::backend::gdn::Shape,
    y: DevPtr,
    g: DevPtr,
    beta: DevPtr,
    state: DevPtr,
    o: DevPtr,
    n: usize,
    steps: Option<DevSteps>,
) -> Result<(), DeviceError> {
    if shape.dk > 512 || shape.dv > crate::backend::gdn::MAX_HEAD || shape.kh == 0 {
        return Err(unsupported(format!(
            "DeltaNet heads of {} x {}",
            shape.dk, shape.dv
        )));
    }
    let [sb, ss, so, sc] = steps_args(steps, n)?;
    let launch = Shape {
        grid: [
            int(shape.vh, "heads")? as u32,
            shape.dv.div_ceil(128) as u32,
            1,
        ],
        block: [128, 1, 1],
        shared: 0,
    };
    let args = [
        Arg::Ptr(y),
        Arg::Ptr(g),
        Arg::Ptr(beta),
        Arg::Ptr(state),
        Arg::Ptr(o),
        Arg::I32(int(n, "tokens")?),
        Arg::I32(int(shape.kh, "heads")?),
        Arg::I32(int(shape.vh, "heads")?),
        Arg::I32(int(shape.dk, "a head width")?),
        Arg::I32(int(shape.dv, "a head width")?),
        sb,
        ss,
        so,
        sc,
    ];
    l.launch(&thorn_kernels::GDN, "gdn_recurrence", launch, &args)
}

/// Floats of scratch [`gdn_chunk`] needs: a chunk's `U` (then `v_new`) and `W` per value head.
pub fn gdn_chunk_work(shape: &crate::backend::gdn::Shape) -> usize {
    shape.vh * crate::backend::gdn::CHUNK * (shape.dk + shape.dv)
}

/// The same recurrence as [`gdn_recurrence`] in chunked (WY) form, chunks of [`crate::backend::gdn::CHUNK`] tokens
/// (the CPU's `gdn::chunked`); `work` holds [`gdn_chunk_work`] floats.
#[expect(
    clippy::too_many_arguments,
    reason = "the recurrence's inputs, state, outputs and scratch"
)]
pub fn gdn_chunk(
    l: &dyn Launcher,
    shape: &crate::backend::gdn::Shape,
    y: DevPtr,
    g: DevPtr,
    beta: DevPtr,
    state: DevPtr,
    o: DevPtr,
    work: DevPtr,
    n: usize,
) -> Result<(), DeviceError> {
    if shape.kh == 0 || shape.dk == 0 || shape.dv == 0 {
        return Err(unsupported(format!(
            "DeltaNet heads of {} x {}",
            shape.dk, shape.dv
        )));
    }
    if n == 0 {
        return Ok(());
    }
    let launch = Shape {
        grid: [int(shape.vh, "heads")? as u32, 1, 1],
        block: [256, 1, 1],
        shared: 0,
    };
    let args = [
        Arg::Ptr(y),
        Arg::Ptr(g),
        Arg::Ptr(beta),
        Arg::Ptr(state),
        Arg::Ptr(o),
        Arg::Ptr(work),
        Arg::I32(int(n, "tokens")?),
        Arg::I32(int(shape.kh, "heads")?),
        Arg::I32(int(shape.vh, "heads")?),
        Arg::I32(int(shape.dk, "a head width")?),
        Arg::I32(int(shape.dv, "a head width")?),
    ];
    l.launch(&thorn_kernels::GDN, "gdn_chunk", launch, &args)
}

/// The gated RMSNorm of `rows` value-head outputs of `dv` at `o`, in place, with gate `z` and weight `w`.
pub fn gdn_gated_norm(
    l: &dyn Launcher,
    o: DevPtr,
    z: DevPtr,
    w: DevPtr,
    rows: usize,
    dv: usize,
    eps: f32,
) -> Result<(), DeviceError> {
    if rows == 0 {
        return Ok(());
    }
    let shape = Shape::line(rows, 32)?;
    let args = [
        Arg::Ptr(o),
        Arg::Ptr(z),
        Arg::Ptr(w),
        Arg::I32(int(dv, "a head width")?),
        Arg::F32(eps),
    ];
    l.launch(&thorn_kernels::GDN, "gdn_gated_norm", shape, &args)
}

/// `x[i] *= sigmoid(gate[i])` for `n` floats.
pub fn sigmoid_gate(
    l: &dyn Launcher,
    x: DevPtr,
    gate: DevPtr,
    n: usize,
) -> Result<(), DeviceError> {
    let args = [Arg::Ptr(x), Arg::Ptr(gate), Arg::I32(int(n, "a length")?)];
    l.launch(&thorn_kernels::GDN, "sigmoid_gate", elementwise(n), &args)
}
