//! Per-row and element-wise ops: embedding rows (`get_rows_*`), RMSNorm, the residual and
//! bias adds, RoPE (NeoX and normal style), SwiGLU and strided row copies.

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use hmoe_backend::{RopeParams, RowCopy};
use hmoe_quant::GgmlType;

use super::lowbit::get_rows_kernel;
use super::{grid_1d, i32_of, u32_of, CudaDevice, DeviceMatrix, MAX_GRID_Y};
use crate::error::{ensure, CudaError};

impl CudaDevice {
    /// Embedding lookup: `out[t] = table[ids[t]]` dequantised to f32 (`out`: `ids.len() ×
    /// cols`). Ids outside the table give zero rows.
    pub fn get_rows(
        &self,
        table: &DeviceMatrix,
        ids: &CudaSlice<i32>,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        const OP: &str = "get_rows";
        let n = ids.len();
        ensure(out.len() >= n * table.cols, OP, || {
            format!("out holds {} values, need {n}×{}", out.len(), table.cols)
        })?;
        if n == 0 {
            return Ok(());
        }
        let name = match table.ty {
            GgmlType::F32 => "get_rows_f32",
            GgmlType::F16 => "get_rows_f16",
            GgmlType::BF16 => "get_rows_bf16",
            GgmlType::Q8_0 => "get_rows_q8_0",
            GgmlType::MXFP4 => "get_rows_mxfp4",
            ty => get_rows_kernel(ty).ok_or(CudaError::UnsupportedType { ty, op: OP })?,
        };
        let row_bytes = table.row_bytes as u64;
        let n_rows = i32_of(OP, "rows", table.rows)?;
        let n_tokens = i32_of(OP, "tokens", n)?;
        let cols = i32_of(OP, "cols", table.cols)?;
        let cfg = LaunchConfig {
            grid_dim: (u32_of(OP, "tokens", n)?, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.builder(name);
        b.arg(&table.data)
            .arg(&row_bytes)
            .arg(&n_rows)
            .arg(ids)
            .arg(out)
            .arg(&n_tokens)
            .arg(&cols);
        // SAFETY: argument types match `get_rows_*` in kernels/rows.cu; `out` holds n × cols
        // values (checked), `table.data` rows × row_bytes bytes, ids are bounds-checked in
        // the kernel.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// RMSNorm of every row of `x` (rows of `weight.len()`): `out = x / sqrt(mean(x²) + eps) ·
    /// weight`. Squares in f32, summed in f64 as the CPU device does.
    pub fn rms_norm(
        &self,
        x: &CudaSlice<f32>,
        weight: &CudaSlice<f32>,
        eps: f32,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        let Some((cfg, n_rows, n)) =
            norm_launch("rms_norm", (x.len(), None), weight.len(), out.len())?
        else {
            return Ok(());
        };
        let mut b = self.builder("rms_norm_f32");
        b.arg(x).arg(weight).arg(out).arg(&n_rows).arg(&n).arg(&eps);
        // SAFETY: argument types match `rms_norm_f32`; x and out hold rows × n values, weight n
        // (`norm_launch`).
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// The residual add and the next block's norm in one launch: `x += y` ([`Self::add_assign`]'s
    /// bits), then [`Self::rms_norm`] of the new `x` into `out`.
    pub fn add_rms_norm(
        &self,
        x: &mut CudaSlice<f32>,
        y: &CudaSlice<f32>,
        weight: &CudaSlice<f32>,
        eps: f32,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        const OP: &str = "add_rms_norm";
        let lens = (x.len(), Some(y.len()));
        let Some((cfg, n_rows, n)) = norm_launch(OP, lens, weight.len(), out.len())? else {
            return Ok(());
        };
        let mut b = self.builder("add_rms_norm_f32");
        b.arg(x)
            .arg(y)
            .arg(weight)
            .arg(out)
            .arg(&n_rows)
            .arg(&n)
            .arg(&eps);
        // SAFETY: argument types match `add_rms_norm_f32`; x, y and out hold rows × n values,
        // weight n (`norm_launch`).
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// [`Self::rms_norm`] of `x` into `out`, after `x += y` where `y` is given
    /// ([`Self::add_rms_norm`]), each row of `out` also written to `q` as Q8_0 blocks, the
    /// bytes [`Self::quantize_q8_0`] gives for `out` (`rms_norm_q8_0_f32`,
    /// `add_rms_norm_q8_0_f32`): the activations of Q8_0/MXFP4 products of the normed rows
    /// in the norm's launch. Rows of whole blocks (`weight.len()` a multiple of 32); `q`
    /// holds 34 bytes per block of `x`.
    pub(crate) fn rms_norm_q8_0(
        &self,
        x: &mut CudaSlice<f32>,
        y: Option<&CudaSlice<f32>>,
        (weight, eps): (&CudaSlice<f32>, f32),
        out: &mut CudaSlice<f32>,
        q: &mut CudaSlice<u8>,
    ) -> Result<(), CudaError> {
        const OP: &str = "rms_norm_q8_0";
        let blocks = x.len() / 32;
        ensure(
            weight.len().is_multiple_of(32) && q.len() >= blocks * 34,
            OP,
            || format!("weight {} / q {} for x {}", weight.len(), q.len(), x.len()),
        )?;
        let lens = (x.len(), y.map(|y| y.len()));
        let Some((cfg, n_rows, n)) = norm_launch(OP, lens, weight.len(), out.len())? else {
            return Ok(());
        };
        let mut b = match y {
            Some(y) => {
                let mut b = self.builder("add_rms_norm_q8_0_f32");
                b.arg(x).arg(y);
                b
            }
            None => {
                let mut b = self.builder("rms_norm_q8_0_f32");
                b.arg(x);
                b
            }
        };
        b.arg(weight).arg(out).arg(q).arg(&n_rows).arg(&n).arg(&eps);
        // SAFETY: argument types match `rms_norm_q8_0_f32` (x, w, out, q, …) and
        // `add_rms_norm_q8_0_f32` (x, y, w, out, q, …); x, y and out hold rows × n values,
        // weight n, a multiple of 32, and q 34 bytes per 32 values of x (`norm_launch` and the
        // checks above); the kernel's block of 256 threads is whole warps.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// `x += y` element-wise (the residual add).
    pub fn add_assign(&self, x: &mut CudaSlice<f32>, y: &CudaSlice<f32>) -> Result<(), CudaError> {
        const OP: &str = "add_assign";
        ensure(y.len() >= x.len(), OP, || {
            format!("x {} / y {}", x.len(), y.len())
        })?;
        let n = x.len();
        if n == 0 {
            return Ok(());
        }
        let n64 = n as u64;
        let mut b = self.builder("add_inplace_f32");
        b.arg(&mut *x).arg(y).arg(&n64);
        // SAFETY: argument types match `add_inplace_f32`; both hold at least n values.
        unsafe { b.launch(grid_1d(n, OP)?) }?;
        Ok(())
    }

    /// Adds `bias` to every row of `x` (rows of `bias.len()`).
    pub fn add_bias(&self, x: &mut CudaSlice<f32>, bias: &CudaSlice<f32>) -> Result<(), CudaError> {
        const OP: &str = "add_bias";
        let cols = bias.len();
        ensure(cols > 0 && x.len().is_multiple_of(cols), OP, || {
            format!("x {} is not rows of bias {cols}", x.len())
        })?;
        let n = x.len();
        if n == 0 {
            return Ok(());
        }
        let (n64, cols_i) = (n as u64, i32_of(OP, "cols", cols)?);
        let mut b = self.builder("add_bias_f32");
        b.arg(&mut *x).arg(bias).arg(&n64).arg(&cols_i);
        // SAFETY: argument types match `add_bias_f32`; x holds n values, bias cols.
        unsafe { b.launch(grid_1d(n, OP)?) }?;
        Ok(())
    }

    /// NeoX RoPE (with YaRN per `p`) in place on `x`: `positions.len()` tokens of `n_heads`
    /// heads of `head_dim` values; token t is at `positions[t]`.
    pub fn rope_neox(
        &self,
        x: &mut CudaSlice<f32>,
        positions: &CudaSlice<i32>,
        n_heads: usize,
        head_dim: usize,
        p: &RopeParams,
    ) -> Result<(), CudaError> {
        self.rope_neox_pair((x, n_heads), None, positions, head_dim, p)
    }

    /// [`Self::rope_neox`] of `x` and of `x2` (another tensor of heads of `head_dim` at the same
    /// positions, such as the keys beside the queries) in one launch.
    pub fn rope_neox_pair(
        &self,
        x: (&mut CudaSlice<f32>, usize),
        x2: Option<(&mut CudaSlice<f32>, usize)>,
        positions: &CudaSlice<i32>,
        head_dim: usize,
        p: &RopeParams,
    ) -> Result<(), CudaError> {
        const OP: &str = "rope_neox";
        let n = positions.len();
        for (len, n_heads) in [
            Some((x.0.len(), x.1)),
            x2.as_ref().map(|(b, h)| (b.len(), *h)),
        ]
        .into_iter()
        .flatten()
        {
            ensure(len >= n * n_heads * head_dim, OP, || {
                format!("x {len} for {n} tokens × {n_heads} heads × {head_dim}")
            })?;
        }
        ensure(
            p.n_dims <= head_dim && p.n_dims.is_multiple_of(2) && p.n_dims > 0,
            OP,
            || format!("n_dims {} with head_dim {head_dim}", p.n_dims),
        )?;
        self.rope(("rope_neox_f32", OP), x, x2, (positions, head_dim), None, p)
    }

    /// Normal-style RoPE over dims `first .. first + p.n_dims` of every head, in place.
    pub fn rope_norm(
        &self,
        x: &mut CudaSlice<f32>,
        positions: &CudaSlice<i32>,
        n_heads: usize,
        head_dim: usize,
        first: usize,
        p: &RopeParams,
    ) -> Result<(), CudaError> {
        const OP: &str = "rope_norm";
        let heads = (x, n_heads);
        self.rope(
            ("rope_norm_f32", OP),
            heads,
            None,
            (positions, head_dim),
            Some(first),
            p,
        )
    }

    /// Launches the RoPE kernel `kernel` (of op `op`) in place on the `x.1` heads of `x.0`
    /// and those of `x2` when given (none else): `positions.len()` tokens of heads of
    /// `head_dim` values, a block per head and token; `first`, the first rotated dim, for the
    /// kernels that take one (`rope_norm_f32`). Shapes checked by the callers.
    fn rope(
        &self,
        (kernel, op): (&'static str, &'static str),
        (x, n_heads): (&mut CudaSlice<f32>, usize),
        x2: Option<(&mut CudaSlice<f32>, usize)>,
        (positions, head_dim): (&CudaSlice<i32>, usize),
        first: Option<usize>,
        p: &RopeParams,
    ) -> Result<(), CudaError> {
        let n = positions.len();
        let n_heads2 = x2.as_ref().map_or(0, |(_, h)| *h);
        if n == 0 || n_heads + n_heads2 == 0 {
            return Ok(());
        }
        ensure(n <= MAX_GRID_Y, op, || format!("{n} tokens in one call"))?;
        let first = first.map(|f| ("first", f));
        let ints = [("tokens", n), ("head_dim", head_dim)]
            .into_iter()
            .chain(first)
            .chain([("n_dims", p.n_dims)])
            .map(|(what, v)| i32_of(op, what, v))
            .collect::<Result<Vec<_>, _>>()?;
        let (h1, h2) = (
            i32_of(op, "heads", n_heads)?,
            i32_of(op, "heads", n_heads2)?,
        );
        let cfg = LaunchConfig {
            grid_dim: (u32_of(op, "heads", n_heads + n_heads2)?, n as u32, 1),
            block_dim: (((p.n_dims / 2).clamp(32, 256)) as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.builder(kernel);
        b.arg(&mut *x).arg(&h1);
        match x2 {
            Some((x2, _)) => b.arg(x2),
            None => b.arg(&self.dummy),
        };
        b.arg(&h2).arg(positions);
        for v in &ints {
            b.arg(v);
        }
        b.arg(&p.theta_scale)
            .arg(&p.freq_scale)
            .arg(&p.ext_factor)
            .arg(&p.attn_factor)
            .arg(&p.corr_dims[0])
            .arg(&p.corr_dims[1]);
        // SAFETY: argument types match `rope_neox_f32` / `rope_norm_f32`; the callers checked
        // that x (and x2) hold n × heads × head_dim values and the rotated dims lie inside each
        // head; with no x2 the kernel reads none of the dummy (0 heads).
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// `gate = silu(gate) · up` in place, rows of `n`.
    pub fn swiglu(
        &self,
        gate: &mut CudaSlice<f32>,
        up: &CudaSlice<f32>,
        n: usize,
    ) -> Result<(), CudaError> {
        const OP: &str = "swiglu";
        let total = gate.len();
        if total == 0 {
            return Ok(());
        }
        let (total64, n_i) = (total as u64, i32_of(OP, "row", n)?);
        let mut b = self.builder("swiglu_f32");
        b.arg(&mut *gate).arg(up).arg(&total64).arg(&n_i);
        // SAFETY: argument types match `swiglu_f32`; up holds at least total values.
        unsafe { b.launch(grid_1d(total, OP)?) }?;
        Ok(())
    }

    /// Strided row copy on the device (see [`RowCopy`]).
    pub fn copy_rows(
        &self,
        src: &CudaSlice<f32>,
        dst: &mut CudaSlice<f32>,
        c: &RowCopy,
    ) -> Result<(), CudaError> {
        const OP: &str = "copy_rows";
        let total = c.n_rows * c.width;
        if total == 0 {
            return Ok(());
        }
        let (n_rows, width) = (i32_of(OP, "rows", c.n_rows)?, i32_of(OP, "width", c.width)?);
        let s = [c.src_stride, c.src_offset, c.dst_stride, c.dst_offset].map(|v| v as u64);
        let mut b = self.builder("copy_rows_f32");
        b.arg(src)
            .arg(dst)
            .arg(&n_rows)
            .arg(&width)
            .arg(&s[0])
            .arg(&s[1])
            .arg(&s[2])
            .arg(&s[3]);
        // SAFETY: argument types match `copy_rows_f32`; the caller checked that every row
        // lies inside both buffers.
        unsafe { b.launch(grid_1d(total, OP)?) }?;
        Ok(())
    }
}

/// The launch of the RMSNorm kernels over `x_len` floats of rows of `n` (the weight's length)
/// into `out_len`, with a residual of `y_len` floats where there is one: a block of 256
/// threads per row, with the rows and `n` as the kernels take them; `None` for no rows.
fn norm_launch(
    op: &'static str,
    (x_len, y_len): (usize, Option<usize>),
    n: usize,
    out_len: usize,
) -> Result<Option<(LaunchConfig, i32, i32)>, CudaError> {
    ensure(
        n > 0 && x_len.is_multiple_of(n) && out_len >= x_len,
        op,
        || format!("x {x_len} / weight {n} / out {out_len}"),
    )?;
    if let Some(y_len) = y_len {
        ensure(y_len >= x_len, op, || format!("x {x_len} / y {y_len}"))?;
    }
    let rows = x_len / n;
    if rows == 0 {
        return Ok(None);
    }
    let cfg = LaunchConfig {
        grid_dim: (u32_of(op, "rows", rows)?, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    Ok(Some((cfg, i32_of(op, "rows", rows)?, i32_of(op, "n", n)?)))
}
