//! Scalar numerics shared by the CPU engine and the reference device, so that both compute
//! the same bits.

/// e^x as computed by ggml's vectorised exponential (a polynomial after range reduction,
/// ≤ 1.5 ulp from the true value). Softmax in attention uses it, so we do too.
#[inline]
pub fn expf_ggml(x: f32) -> f32 {
    let r = f32::from_bits(0x4b40_0000); // 1.5 · 2^23: rounds to an integer when added
    let z = x.mul_add(f32::from_bits(0x3fb8_aa3b), r); // x · log2(e) + r
    let n = z - r;
    let b = (-n).mul_add(f32::from_bits(0x3f31_7200), x); // x − n·ln2_hi
    let b = (-n).mul_add(f32::from_bits(0x35bf_be8e), b); // … − n·ln2_lo
    if n.abs() > 192.0 {
        return if n <= 0.0 { 0.0 } else { f32::INFINITY };
    }
    let u = b * b;
    let p45 = f32::from_bits(0x3c07_2010).mul_add(b, f32::from_bits(0x3d2b_9f17));
    let p23 = f32::from_bits(0x3e2a_af33).mul_add(b, f32::from_bits(0x3efffedb));
    let p01 = f32::from_bits(0x3f7f_fff6).mul_add(b, 1.0);
    let j = p45.mul_add(u, p23).mul_add(u, p01);
    scale_by_pow2(j, n as i32)
}

/// `x · 2^n` without intermediate overflow (like `vscalefps`).
#[inline]
fn scale_by_pow2(x: f32, n: i32) -> f32 {
    let mut x = x;
    let mut n = n;
    while n > 127 {
        x *= f32::from_bits(0x7f00_0000);
        n -= 127;
    }
    while n < -126 {
        x *= f32::from_bits(0x0080_0000);
        n += 126;
    }
    x * f32::from_bits(((n + 127) as u32) << 23)
}

/// Horizontal sum of 16 lanes in the order of an AVX-512 `reduce_add` (halves, then
/// quarters, then pairs), so that sums match ggml's SIMD code bit for bit.
#[inline]
pub fn reduce16(lanes: &[f32; 16]) -> f32 {
    let mut t8 = [0f32; 8];
    for i in 0..8 {
        t8[i] = lanes[i] + lanes[i + 8];
    }
    let t4 = [t8[0] + t8[4], t8[1] + t8[5], t8[2] + t8[6], t8[3] + t8[7]];
    (t4[0] + t4[2]) + (t4[1] + t4[3])
}

/// SwiGLU of one row in place, `gate[i] = silu(gate[i]) · up[i]`, as ggml's AVX-512
/// `ggml_vec_swiglu_f32`: blocks of 16 use `x / (1 + e^−x)` with the vectorised exponential
/// ([`expf_ggml`]), the remainder of the row libm's `expf`.
pub fn swiglu_row(gate: &mut [f32], up: &[f32]) {
    let blocks = gate.len() / 16 * 16;
    for (gv, &uv) in gate[..blocks].iter_mut().zip(&up[..blocks]) {
        let x = *gv;
        *gv = x / (1.0 + expf_ggml(0.0 - x)) * uv;
    }
    for (gv, &uv) in gate[blocks..].iter_mut().zip(&up[blocks..]) {
        let x = *gv;
        *gv = x / (1.0 + (-x).exp()) * uv;
    }
}
