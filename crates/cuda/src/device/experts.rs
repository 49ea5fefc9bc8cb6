//! The MoE expert block: one layer's experts for a batch (`moe`): gate and up products, the
//! gated activation, down products, the biases and the weighted sum of each token's slots.
//! Small batches of Q8_0/MXFP4 experts (decode) run two kernels (`moe_dp4a_gate_up_*`: x
//! quantized in the kernel, gate/up products, the gated activation, h as Q8_0;
//! `moe_dp4a_down_*`: down products and the weighted sum of each token's slots); large batches
//! of them group the slots by expert (`moe_group`) for the tiled products (`moe_mm_*`, on int8
//! tensor cores from sm_80: `moe_mm_mma_*` over a list of tiles of each expert's slots,
//! `moe_tiles`); F32/F16/BF16 experts run a warp per slot and row (`moe_gate_up_*`,
//! `moe_down_*`); sets with low-bit experts take `lowbit`'s products.

use cudarc::driver::{CudaSlice, DeviceRepr, LaunchConfig, PushKernelArg};
use hmoe_quant::GgmlType;

use super::capabilities::{has_int8_mma, is_lowbit, tiled_kernel};
use super::{
    grid_1d, i32_of, rows_by_tokens, u32_of, CudaDevice, DeviceExperts, ExpertAct, MoeWeights,
    MAX_GRID_Y,
};
use crate::error::{ensure, CudaError};
use crate::kernels::{
    DP4A_MXFP4_ROWS, DP4A_Q8_0_ROWS, MOE_H_ROWS, MOE_MAX_EXPERTS, ROW_WARPS, TILE_SLOTS,
};

/// Expert slots (tokens × experts per token) from which Q8_0/MXFP4 experts use the tiled
/// kernels (a weight row read once per tile of an expert's slots) instead of the two dp4a
/// kernels (a weight row read once per slot).
const MOE_TILED_MIN_SLOTS: usize = 64;

/// The slots grouped by expert: `moe_group`'s offsets (`n_expert + 1`) and slot order.
pub(super) type ExpertGroups = (CudaSlice<i32>, CudaSlice<i32>);

impl CudaDevice {
    /// gpt-oss MoE for one layer: for each token t (rows of `x`, `n × d`) and slot j < k with
    /// expert `e = selected[t·k + j]` and weight `w = weights[t·k + j]`,
    /// `out[t] = Σ_j w · (down_e · swiglu_oai(gate_e·x + bg_e, up_e·x + bu_e) + bd_e)` with
    /// swiglu_oai(g, u) = min(g,7)·σ(1.702·min(g,7))·(clamp(u,−7,7)+1). Slots add in order.
    /// Expert ids out of range contribute nothing. Below [`MOE_TILED_MIN_SLOTS`] slots (and
    /// for F32/F16/BF16 experts) each slot reads its expert's rows once (tokens are not grouped
    /// by expert: right for decode, wasteful for large batches).
    /// Numerics as [`CudaDevice::matmul`]'s GEMV: activations (`x`, and each slot's SwiGLU
    /// output) converted as ggml converts them, Q8_0/MXFP4/F32 products in the CPU device's
    /// order (F32: `vec_dot` order for an expert only one slot routes to, else 16 lanes).
    /// Gate, up and down are of one type, or (sets with low-bit experts, as in Q4_K_M files)
    /// each of [`LOWBIT_TYPES`](super::LOWBIT_TYPES) or Q8_0: then every product is in the
    /// order of the CPU device's expert matmul for as many slots as route to the expert
    /// (`lowbit.rs`).
    #[allow(clippy::too_many_arguments)]
    pub fn moe(
        &self,
        w: &MoeWeights,
        act: ExpertAct,
        x: &CudaSlice<f32>,
        selected: &CudaSlice<i32>,
        weights: &CudaSlice<f32>,
        k: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        const OP: &str = "moe";
        // Experts uploaded on the copy stream: their copies before these kernels.
        for m in [&w.gate, &w.up, &w.down] {
            m.wait_uploaded()?;
        }
        let (d, ff, ne) = (w.gate.cols, w.gate.rows, w.gate.n_expert);
        ensure(
            w.up.cols == d
                && w.up.rows == ff
                && w.down.cols == ff
                && w.down.rows == d
                && w.up.n_expert == ne
                && w.down.n_expert == ne,
            OP,
            || "gate/up must be [E, ff, d] and down [E, d, ff]".into(),
        )?;
        let lowbit = [&w.gate, &w.up, &w.down].iter().any(|m| is_lowbit(m.ty));
        if let Some(m) = [&w.up, &w.down].iter().find(|m| m.ty != w.gate.ty) {
            if !lowbit {
                return Err(CudaError::UnsupportedType { ty: m.ty, op: OP });
            }
        }
        // The row-per-warp kernels of one float type's experts (the low-bit ones and Q8_0/MXFP4
        // have their own).
        let unsupported = CudaError::UnsupportedType {
            ty: w.gate.ty,
            op: OP,
        };
        let quantized = matches!(w.gate.ty, GgmlType::MXFP4 | GgmlType::Q8_0);
        let kernels = match w.gate.ty {
            GgmlType::F16 => Some(("moe_gate_up_f16", "moe_down_f16")),
            GgmlType::BF16 => Some(("moe_gate_up_bf16", "moe_down_bf16")),
            GgmlType::F32 => Some(("moe_gate_up_f32", "moe_down_f32")),
            _ => None,
        };
        if kernels.is_none() && !lowbit && !quantized {
            return Err(unsupported);
        }
        ensure(
            w.gate_bias.is_some() == w.up_bias.is_some()
                && w.gate_bias.as_ref().is_none_or(|b| b.len() >= ne * ff)
                && w.up_bias.as_ref().is_none_or(|b| b.len() >= ne * ff)
                && w.down_bias.as_ref().is_none_or(|b| b.len() >= ne * d),
            OP,
            || "biases: gate and up together, [E, ff] and [E, d]".into(),
        )?;
        ensure(k > 0 && x.len().is_multiple_of(d), OP, || {
            format!("x {} is not rows of {d}", x.len())
        })?;
        let n = x.len() / d;
        let slots = n * k;
        ensure(
            selected.len() >= slots && weights.len() >= slots && out.len() >= n * d,
            OP,
            || {
                format!(
                    "selected {} / weights {} / out {} for {n}×{k}",
                    selected.len(),
                    weights.len(),
                    out.len()
                )
            },
        )?;
        if n == 0 {
            return Ok(());
        }
        ensure(slots <= MAX_GRID_Y, OP, || {
            format!("{slots} expert slots in one call")
        })?;
        let (k_i, d_i) = (i32_of(OP, "k", k)?, i32_of(OP, "d", d)?);
        let tiled = slots >= MOE_TILED_MIN_SLOTS && ne <= MOE_MAX_EXPERTS;
        let y = if lowbit {
            self.moe_products_lowbit(w, act, x, selected, k)?
        } else if quantized && tiled {
            self.moe_products_tiled(w, act, x, selected, k)?
        } else if quantized {
            return self.moe_dp4a(w, act, x, (selected, weights), k, out);
        } else {
            let kernels = kernels.ok_or(unsupported)?;
            self.moe_products_rows(w, act, x, selected, k, kernels)?
        };
        let n_i = i32_of(OP, "tokens", n)?;
        let mut b = self.builder("moe_combine");
        b.arg(&y)
            .arg(weights)
            .arg(out)
            .arg(&n_i)
            .arg(&k_i)
            .arg(&d_i);
        // SAFETY: argument types match `moe_combine`; out holds n × d values.
        unsafe { b.launch(grid_1d(n * d, OP)?) }?;
        Ok(())
    }

    /// [`CudaDevice::moe`] of Q8_0 or MXFP4 experts below the tiled kernels' batches (shapes
    /// checked there) in two launches (kernels/moe_dp4a.cu): `moe_dp4a_gate_up_*` (a block per
    /// 32 rows of ff and slot: the token's x quantized to Q8_0 in shared memory, gate and up
    /// products on the dp4a chains, biases, the gated activation, h as Q8_0 blocks), then
    /// `moe_dp4a_down_*` (a block per warp's rows of d and token: the down products of the
    /// token's slots, their biases, and the weighted sum in slot order into `out`).
    fn moe_dp4a(
        &self,
        w: &MoeWeights,
        act: ExpertAct,
        x: &CudaSlice<f32>,
        (selected, weights): (&CudaSlice<i32>, &CudaSlice<f32>),
        k: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        const OP: &str = "moe";
        let (d, ff, ne) = (w.gate.cols, w.gate.rows, w.gate.n_expert);
        // Rows of whole Q8_0/MXFP4 blocks; h is whole Q8_0 blocks of each block's 32 rows.
        ensure(d % 32 == 0 && ff % 32 == 0, OP, || {
            format!("d {d} and ff {ff} must be multiples of 32")
        })?;
        let n = x.len() / d;
        let slots = n * k;
        let (gate_up, down, lanes, rows_per_block) = match w.gate.ty {
            GgmlType::MXFP4 => (
                "moe_dp4a_gate_up_mxfp4",
                "moe_dp4a_down_mxfp4",
                4,
                DP4A_MXFP4_ROWS,
            ),
            _ => (
                "moe_dp4a_gate_up_q8_0",
                "moe_dp4a_down_q8_0",
                8,
                DP4A_Q8_0_ROWS,
            ),
        };
        let (n_i, k_i) = (i32_of(OP, "tokens", n)?, i32_of(OP, "k", k)?);
        let (ne_i, d_i, ff_i) = (
            i32_of(OP, "experts", ne)?,
            i32_of(OP, "d", d)?,
            i32_of(OP, "ff", ff)?,
        );
        let has_d_bias = i32::from(w.down_bias.is_some());
        let bd = w.down_bias.as_ref().unwrap_or(&self.dummy);
        let rb_ff = w.down.row_bytes as u64;
        // Scratch: the gate/up kernel writes the Q8_0 blocks of every slot with a valid
        // expert, the only ones the down kernel reads.
        let mut hq = self.alloc_scratch::<u8>(slots * (ff / 32) * 34)?;
        // Whole blocks of MOE_H_ROWS rows of ff (ff % 32 == 0, checked above), MOE_H_ROWS
        // rows × the type's lanes per row of threads.
        let cfg = rows_by_tokens(OP, (ff, MOE_H_ROWS), (slots, 1), MOE_H_ROWS * lanes)?;
        self.moe_gate_up((gate_up, cfg), w, act, (x, selected), k, &mut hq)?;

        let cfg = rows_by_tokens(OP, (d, rows_per_block), (n, 1), ROW_WARPS * 32)?;
        let mut b = self.builder(down);
        b.arg(&w.down.data)
            .arg(bd)
            .arg(&has_d_bias)
            .arg(&hq)
            .arg(selected)
            .arg(weights)
            .arg(out)
            .arg(&n_i)
            .arg(&k_i)
            .arg(&ne_i)
            .arg(&d_i)
            .arg(&ff_i)
            .arg(&rb_ff);
        // SAFETY: argument types match `moe_dp4a_down_*`; selected and weights hold n × k
        // values, out n × d, the bias ne × d when present (checked by the caller); hq as
        // written above.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// The expert products of [`CudaDevice::moe`] for F32, F16 and BF16 experts, a warp per
    /// slot and row (shapes checked there): `gate_up` (`moe_gate_up_*`: gate and up products,
    /// biases and the gated activation) then `down` (`moe_down_*`: down products and biases).
    /// Returns y, `[slots][d]`.
    fn moe_products_rows(
        &self,
        w: &MoeWeights,
        act: ExpertAct,
        x: &CudaSlice<f32>,
        selected: &CudaSlice<i32>,
        k: usize,
        (gate_up, down): (&'static str, &'static str),
    ) -> Result<CudaSlice<f32>, CudaError> {
        const OP: &str = "moe";
        let (d, ff, ne) = (w.gate.cols, w.gate.rows, w.gate.n_expert);
        let n = x.len() / d;
        let slots = n * k;
        // Scratch: every element of both buffers is written by the kernels below
        // before it is read.
        let mut h = self.alloc_scratch::<f32>(slots * ff)?;
        // As above.
        let mut y = self.alloc_scratch::<f32>(slots * d)?;
        let cfg = rows_by_tokens(OP, (ff, ROW_WARPS), (slots, 1), ROW_WARPS * 32)?;
        self.moe_gate_up((gate_up, cfg), w, act, (x, selected), k, &mut h)?;

        let (slots_i, ne_i) = (i32_of(OP, "slots", slots)?, i32_of(OP, "experts", ne)?);
        let (d_i, ff_i, act_i) = (i32_of(OP, "d", d)?, i32_of(OP, "ff", ff)?, act as i32);
        let has_d_bias = i32::from(w.down_bias.is_some());
        let bd = w.down_bias.as_ref().unwrap_or(&self.dummy);
        let rb_ff = w.down.row_bytes as u64;
        let cfg = rows_by_tokens(OP, (d, ROW_WARPS), (slots, 1), ROW_WARPS * 32)?;
        let mut b = self.builder(down);
        b.arg(&w.down.data)
            .arg(bd)
            .arg(&has_d_bias)
            .arg(&h)
            .arg(selected)
            .arg(&mut y)
            .arg(&slots_i)
            .arg(&ne_i)
            .arg(&d_i)
            .arg(&ff_i)
            .arg(&rb_ff)
            .arg(&act_i);
        // SAFETY: argument types match `moe_down_*`; y holds slots × d values.
        unsafe { b.launch(cfg) }?;

        Ok(y)
    }

    /// Launches `kernel` with `cfg`, one of the MoE block's gate/up kernels (`moe_gate_up_*`,
    /// `moe_dp4a_gate_up_*`: the same parameters, h as f32 values or as Q8_0 blocks) for the
    /// `x.len() / d × k` slots of `selected`. Shapes checked by [`CudaDevice::moe`]; the caller
    /// sizes `h` and `cfg` for the kernel.
    fn moe_gate_up<T: DeviceRepr>(
        &self,
        (kernel, cfg): (&'static str, LaunchConfig),
        w: &MoeWeights,
        act: ExpertAct,
        (x, selected): (&CudaSlice<f32>, &CudaSlice<i32>),
        k: usize,
        h: &mut CudaSlice<T>,
    ) -> Result<(), CudaError> {
        const OP: &str = "moe";
        let (d, ff, ne) = (w.gate.cols, w.gate.rows, w.gate.n_expert);
        let slots = x.len() / d * k;
        let (slots_i, k_i, ne_i) = (
            i32_of(OP, "slots", slots)?,
            i32_of(OP, "k", k)?,
            i32_of(OP, "experts", ne)?,
        );
        let (d_i, ff_i, act_i) = (i32_of(OP, "d", d)?, i32_of(OP, "ff", ff)?, act as i32);
        let has_bias = i32::from(w.gate_bias.is_some());
        let rb_d = w.gate.row_bytes as u64;
        let mut b = self.builder(kernel);
        b.arg(&w.gate.data)
            .arg(&w.up.data)
            .arg(w.gate_bias.as_ref().unwrap_or(&self.dummy))
            .arg(w.up_bias.as_ref().unwrap_or(&self.dummy))
            .arg(&has_bias)
            .arg(x)
            .arg(selected)
            .arg(h)
            .arg(&slots_i)
            .arg(&k_i)
            .arg(&ne_i)
            .arg(&d_i)
            .arg(&ff_i)
            .arg(&rb_d)
            .arg(&act_i);
        // SAFETY: argument types match `moe_gate_up_*` and `moe_dp4a_gate_up_*` (h: f32 for
        // the first, Q8_0 bytes for the second); expert ids are range-checked in the kernels;
        // x holds n × d values and selected n × k, the biases ne × ff when present (checked by
        // CudaDevice::moe); h and cfg are the kernel's (the callers: slots × ff values, or
        // slots × ff / 32 Q8_0 blocks over whole blocks of MOE_H_ROWS rows).
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// The expert products of [`CudaDevice::moe`] for a large batch of Q8_0 or MXFP4 experts
    /// (shapes checked there): the slots grouped by expert (`moe_group`), tiled products
    /// (`moe_mm_*`) for gate, up and down, the SwiGLU and the down biases. Returns y,
    /// `[slots][d]`, with the bits of the row-per-warp kernels.
    fn moe_products_tiled(
        &self,
        w: &MoeWeights,
        act: ExpertAct,
        x: &CudaSlice<f32>,
        selected: &CudaSlice<i32>,
        k: usize,
    ) -> Result<CudaSlice<f32>, CudaError> {
        let (d, ff, ne) = (w.gate.cols, w.gate.rows, w.gate.n_expert);
        let n = x.len() / d;
        let slots = n * k;
        let (offsets, order) = self.moe_group(selected, slots, ne)?;

        let xq = self.quantize_q8_0(x, n * d)?;
        // Scratch: moe_mm writes the rows of every slot with a valid expert, the only ones
        // moe_swiglu reads.
        let mut g = self.alloc_scratch::<f32>(slots * ff)?;
        // As above.
        let mut u = self.alloc_scratch::<f32>(slots * ff)?;
        self.moe_mm(&w.gate, &xq, k, (&offsets, &order), 1, &mut g)?;
        self.moe_mm(&w.up, &xq, k, (&offsets, &order), 1, &mut u)?;
        let h = self.moe_gated(w, act, (&g, &u), selected, slots)?;

        let hq = self.quantize_q8_0(&h, slots * ff)?;
        // Scratch: moe_mm writes the slots with a valid expert and moe_down_bias zeroes the
        // others.
        let mut y = self.alloc_scratch::<f32>(slots * d)?;
        self.moe_mm(&w.down, &hq, 1, (&offsets, &order), 1, &mut y)?;
        self.moe_add_down_bias(w, &mut y, selected, slots)?;
        Ok(y)
    }

    /// The slots of `selected` (`slots` expert ids) grouped by expert (`moe_group`):
    /// `(offsets, order)`, where `order[offsets[e]..offsets[e + 1]]` are the slots of expert
    /// `e < ne` in slot order (slots with an expert id out of range are in no group).
    pub(super) fn moe_group(
        &self,
        selected: &CudaSlice<i32>,
        slots: usize,
        ne: usize,
    ) -> Result<ExpertGroups, CudaError> {
        const OP: &str = "moe";
        ensure(ne <= MOE_MAX_EXPERTS, OP, || {
            format!("{ne} experts (at most {MOE_MAX_EXPERTS})")
        })?;
        let (slots_i, ne_i) = (i32_of(OP, "slots", slots)?, i32_of(OP, "experts", ne)?);
        // Scratch: moe_group writes all ne + 1 offsets and an order entry for every slot with a
        // valid expert, the only entries the grouped products read.
        let mut offsets = self.alloc_scratch::<i32>(ne + 1)?;
        // As above.
        let mut order = self.alloc_scratch::<i32>(slots)?;
        let mut b = self.builder("moe_group");
        b.arg(selected)
            .arg(&slots_i)
            .arg(&ne_i)
            .arg(&mut offsets)
            .arg(&mut order);
        let one_block = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: argument types match `moe_group`; ne <= MOE_MAX_EXPERTS (checked above), the
        // size of its shared counts.
        unsafe { b.launch(one_block) }?;
        Ok((offsets, order))
    }

    /// `h[s] = act(g[s] + bg[e], u[s] + bu[e])` for every slot s of expert `e = selected[s]`
    /// (0 for an expert id out of range), `[slots][ff]` (`moe_swiglu`; shapes checked by
    /// [`CudaDevice::moe`]).
    pub(super) fn moe_gated(
        &self,
        w: &MoeWeights,
        act: ExpertAct,
        (g, u): (&CudaSlice<f32>, &CudaSlice<f32>),
        selected: &CudaSlice<i32>,
        slots: usize,
    ) -> Result<CudaSlice<f32>, CudaError> {
        const OP: &str = "moe";
        let (ff, ne) = (w.gate.rows, w.gate.n_expert);
        let (slots_i, ne_i, ff_i) = (
            i32_of(OP, "slots", slots)?,
            i32_of(OP, "experts", ne)?,
            i32_of(OP, "ff", ff)?,
        );
        // Scratch: moe_swiglu writes every element.
        let mut h = self.alloc_scratch::<f32>(slots * ff)?;
        let has_gu_bias = i32::from(w.gate_bias.is_some());
        let act_i = act as i32;
        let mut b = self.builder("moe_swiglu");
        b.arg(g)
            .arg(u)
            .arg(w.gate_bias.as_ref().unwrap_or(&self.dummy))
            .arg(w.up_bias.as_ref().unwrap_or(&self.dummy))
            .arg(&has_gu_bias)
            .arg(selected)
            .arg(&mut h)
            .arg(&slots_i)
            .arg(&ne_i)
            .arg(&ff_i)
            .arg(&act_i);
        // SAFETY: argument types match `moe_swiglu`; g and u hold slots × ff values, the
        // biases ne × ff when present (checked by the caller).
        unsafe { b.launch(grid_1d(slots * ff, OP)?) }?;
        Ok(h)
    }

    /// Adds the down biases to `y` (`[slots][d]`) and zeroes the slots whose expert id is out
    /// of range (`moe_down_bias`; shapes checked by [`CudaDevice::moe`]).
    pub(super) fn moe_add_down_bias(
        &self,
        w: &MoeWeights,
        y: &mut CudaSlice<f32>,
        selected: &CudaSlice<i32>,
        slots: usize,
    ) -> Result<(), CudaError> {
        const OP: &str = "moe";
        let (d, ne) = (w.down.rows, w.down.n_expert);
        let (slots_i, ne_i, d_i) = (
            i32_of(OP, "slots", slots)?,
            i32_of(OP, "experts", ne)?,
            i32_of(OP, "d", d)?,
        );
        let has_d_bias = i32::from(w.down_bias.is_some());
        let mut b = self.builder("moe_down_bias");
        b.arg(y)
            .arg(w.down_bias.as_ref().unwrap_or(&self.dummy))
            .arg(&has_d_bias)
            .arg(selected)
            .arg(&slots_i)
            .arg(&ne_i)
            .arg(&d_i);
        // SAFETY: argument types match `moe_down_bias`; y holds slots × d values, the bias
        // ne × d when present (checked by the caller).
        unsafe { b.launch(grid_1d(slots * d, OP)?) }?;
        Ok(())
    }

    /// The tiles of the tensor-core expert products (`moe_tiles`): the slots of every expert
    /// with at least `min_count` (≥ 1) of them, grouped by `moe_group` (`offsets`), split into
    /// tiles of near-equal width of at most `TILE_SLOTS`. Returns the list (its count first,
    /// then `(expert, begin, end)` per tile) and the most tiles it can hold for `slots` slots
    /// of `ne` experts: the grid's second dimension (blocks past the count return at once).
    pub(super) fn moe_tiles(
        &self,
        offsets: &CudaSlice<i32>,
        slots: usize,
        ne: usize,
        min_count: usize,
    ) -> Result<(CudaSlice<i32>, u32), CudaError> {
        const OP: &str = "moe_tiles";
        let max = slots.div_ceil(TILE_SLOTS as usize) + ne.min(slots);
        ensure(max > 0 && max <= MAX_GRID_Y, OP, || {
            format!("{max} tiles of {slots} slots")
        })?;
        // Scratch: moe_tiles writes the count and every entry below it, the only ones read.
        let mut tiles = self.alloc_scratch::<i32>(1 + 3 * max)?;
        let (ne_i, min_i) = (
            i32_of(OP, "experts", ne)?,
            i32_of(OP, "minimum", min_count)?,
        );
        let mut b = self.builder("moe_tiles");
        b.arg(offsets).arg(&ne_i).arg(&min_i).arg(&mut tiles);
        let one_block = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: argument types match `moe_tiles`; offsets holds ne + 1 values (moe_group),
        // tiles room for the most tiles there can be (1 + 3 × max).
        unsafe { b.launch(one_block) }?;
        Ok((tiles, u32_of(OP, "tiles", max)?))
    }

    /// `out[slot] = experts[e] · act[slot / act_div]` for every slot grouped under expert `e`
    /// by `moe_group` (`groups` = its offsets and order); act: Q8_0 rows of `experts.cols`.
    /// From sm_80 only the experts with at least `min_count` (≥ 1) slots (the tile list's);
    /// before, every expert.
    pub(super) fn moe_mm(
        &self,
        experts: &DeviceExperts,
        act: &CudaSlice<u8>,
        act_div: usize,
        (offsets, order): (&CudaSlice<i32>, &CudaSlice<i32>),
        min_count: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        const OP: &str = "moe_mm";
        if !matches!(experts.ty, GgmlType::MXFP4 | GgmlType::Q8_0) {
            let ty = experts.ty;
            return Err(CudaError::UnsupportedType { ty, op: OP });
        }
        let cc = self.info.compute_capability;
        let kernel = tiled_kernel(experts.ty, true, cc);
        let rows_i = i32_of(OP, "rows", experts.rows)?;
        let nb_i = i32_of(OP, "blocks per row", experts.cols / 32)?;
        let act_div_i = i32_of(OP, "act_div", act_div)?;
        let row_bytes = experts.row_bytes as u64;
        let row_tiles = experts.rows.div_ceil(kernel.rows_per_block as usize);
        // sm_80+: a block per tile of the list; before: a block per expert.
        let tiles = match has_int8_mma(cc) {
            true => Some(self.moe_tiles(offsets, order.len(), experts.n_expert, min_count)?),
            false => None,
        };
        let grid_y = match &tiles {
            Some((_, max)) => *max,
            None => u32_of(OP, "experts", experts.n_expert)?,
        };
        let cfg = LaunchConfig {
            grid_dim: (u32_of(OP, "row tiles", row_tiles)?, grid_y, 1),
            block_dim: (kernel.threads, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.builder(kernel.name);
        b.arg(&experts.data)
            .arg(&row_bytes)
            .arg(&rows_i)
            .arg(&nb_i)
            .arg(act)
            .arg(&act_div_i);
        match &tiles {
            Some((list, _)) => b.arg(list),
            None => b.arg(offsets),
        };
        b.arg(order).arg(out);
        // SAFETY: argument types match `moe_mm_*` (offsets) and `moe_mm_mma_*` (the tile
        // list, grid.y its capacity); experts holds n_expert × rows rows of row_bytes, act
        // the Q8_0 rows its slots name and out a row of `rows` per slot (sizes from
        // CudaDevice::moe's checks).
        unsafe { b.launch(cfg) }?;
        Ok(())
    }
}
