//! [`RefBackend`]: the ops of [`Backend`] in plain Rust on the host, with the semantics of the
//! CUDA kernels (f32 activations, dequantized weights, f16 K/V rings, sinks, sliding window,
//! top-k then softmax, the clamped SwiGLU experts). It lets the executor ([`crate::GpuGptOss`])
//! run and be compared with the CPU engine on a machine without a GPU; it is a test stand-in,
//! not a fast path.

use std::ops::Range;
use std::sync::Mutex;

use half::f16;
use hmoe_model::hybrid::ExpertTensors;
use hmoe_quant::GgmlType;

use crate::backend::{Backend, Elem, StagedIo};
use crate::device::{AttnParams, RopeParams, SUPPORTED_TYPES};
use crate::error::{ensure, CudaError};

/// A weight matrix, dequantized.
pub struct RefMatrix {
    rows: usize,
    cols: usize,
    bytes: usize,
    w: Vec<f32>,
}

/// One layer's experts, dequantized: gate and up `[E][ff][d]`, down `[E][d][ff]`.
pub struct RefMoe {
    n_expert: usize,
    d: usize,
    ff: usize,
    bytes: usize,
    gate: Vec<f32>,
    up: Vec<f32>,
    down: Vec<f32>,
    gate_bias: Vec<f32>,
    up_bias: Vec<f32>,
    down_bias: Vec<f32>,
}

/// Host buffers of the round trip.
pub struct RefStaging {
    h: Vec<f32>,
    sel: Vec<i32>,
    w: Vec<f32>,
    out: Vec<f32>,
}

/// The reference backend; counts the round trips it stages.
#[derive(Default)]
pub struct RefBackend {
    staged: Mutex<u64>,
}

impl RefBackend {
    /// A new reference backend.
    pub fn new() -> RefBackend {
        RefBackend::default()
    }

    /// Round trips staged so far (calls of `stage_down`).
    pub fn round_trips(&self) -> u64 {
        *self
            .staged
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

fn dequantize(ty: GgmlType, rows: usize, cols: usize, data: &[u8]) -> Result<Vec<f32>, CudaError> {
    const OP: &str = "reference upload";
    ensure(SUPPORTED_TYPES.contains(&ty), OP, || format!("type {ty}"))?;
    let rb = ty.row_bytes(cols as u64).unwrap_or(0) as usize;
    ensure(rb > 0 && data.len() == rows * rb, OP, || {
        format!("{} bytes for {rows} rows of {cols} {ty}", data.len())
    })?;
    let mut w = vec![0f32; rows * cols];
    for (r, row) in w.chunks_exact_mut(cols).enumerate() {
        hmoe_quant::dequantize_row(ty, &data[r * rb..(r + 1) * rb], row).map_err(|e| {
            CudaError::Shape {
                op: OP,
                what: e.to_string(),
            }
        })?;
    }
    Ok(w)
}

/// `Σ a·b` accumulated in f64.
fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(&x, &y)| x as f64 * y as f64)
        .sum::<f64>() as f32
}

fn swiglu_oai(g: f32, u: f32) -> f32 {
    let x = g.min(7.0);
    let y = u.clamp(-7.0, 7.0);
    x / (1.0 + (-1.702 * x).exp()) * (y + 1.0)
}

fn shape(op: &'static str, ok: bool, what: impl FnOnce() -> String) -> Result<(), CudaError> {
    ensure(ok, op, what)
}

impl Backend for RefBackend {
    type Buf<T: Elem> = Vec<T>;
    type Matrix = RefMatrix;
    type Moe = RefMoe;
    type Staging = RefStaging;

    fn name(&self) -> String {
        "reference".into()
    }
    fn upload<T: Elem>(&self, src: &[T]) -> Result<Vec<T>, CudaError> {
        Ok(src.to_vec())
    }
    fn alloc<T: Elem>(&self, len: usize) -> Result<Vec<T>, CudaError> {
        Ok(vec![T::default(); len])
    }
    fn download<T: Elem>(&self, src: &Vec<T>) -> Result<Vec<T>, CudaError> {
        Ok(src.clone())
    }
    fn buf_len<T: Elem>(b: &Vec<T>) -> usize {
        b.len()
    }
    fn copy_range(&self, src: &Vec<f32>, range: Range<usize>) -> Result<Vec<f32>, CudaError> {
        src.get(range.clone())
            .map(<[f32]>::to_vec)
            .ok_or_else(|| CudaError::Shape {
                op: "copy_range",
                what: format!("{range:?} of {}", src.len()),
            })
    }
    fn synchronize(&self) -> Result<(), CudaError> {
        Ok(())
    }
    fn upload_matrix(
        &self,
        ty: GgmlType,
        rows: usize,
        cols: usize,
        data: &[u8],
    ) -> Result<RefMatrix, CudaError> {
        Ok(RefMatrix {
            rows,
            cols,
            bytes: data.len(),
            w: dequantize(ty, rows, cols, data)?,
        })
    }
    fn matrix_bytes(m: &RefMatrix) -> usize {
        m.bytes
    }
    fn upload_moe(
        &self,
        t: &ExpertTensors<'_>,
        ids: Option<&[usize]>,
    ) -> Result<RefMoe, CudaError> {
        let (d, ff) = (t.gate.n_in, t.gate.n_out);
        let all: Vec<usize> = (0..t.n_expert).collect();
        let ids = ids.unwrap_or(&all);
        let missing = || CudaError::Shape {
            op: "upload_moe",
            what: "expert missing from the tensors".into(),
        };
        let mut m = RefMoe {
            n_expert: ids.len(),
            d,
            ff,
            bytes: 0,
            gate: Vec::new(),
            up: Vec::new(),
            down: Vec::new(),
            gate_bias: Vec::new(),
            up_bias: Vec::new(),
            down_bias: Vec::new(),
        };
        for &e in ids {
            for (dst, src, rows, cols) in [
                (&mut m.gate, &t.gate, ff, d),
                (&mut m.up, &t.up, ff, d),
                (&mut m.down, &t.down, d, ff),
            ] {
                let data = src.expert(e).ok_or_else(missing)?;
                m.bytes += data.len();
                dst.extend(dequantize(src.ty, rows, cols, data)?);
            }
            for (dst, src, w) in [
                (&mut m.gate_bias, t.gate_bias, ff),
                (&mut m.up_bias, t.up_bias, ff),
                (&mut m.down_bias, t.down_bias, d),
            ] {
                dst.extend_from_slice(src.get(e * w..(e + 1) * w).ok_or_else(missing)?);
                m.bytes += 4 * w;
            }
        }
        Ok(m)
    }
    fn moe_bytes(m: &RefMoe) -> usize {
        m.bytes
    }
    fn get_rows(&self, t: &RefMatrix, ids: &Vec<i32>, out: &mut Vec<f32>) -> Result<(), CudaError> {
        shape("get_rows", out.len() >= ids.len() * t.cols, || {
            format!("out {}", out.len())
        })?;
        for (i, &id) in ids.iter().enumerate() {
            let dst = &mut out[i * t.cols..(i + 1) * t.cols];
            match usize::try_from(id).ok().filter(|&r| r < t.rows) {
                Some(r) => dst.copy_from_slice(&t.w[r * t.cols..(r + 1) * t.cols]),
                None => dst.fill(0.0),
            }
        }
        Ok(())
    }
    fn rms_norm(
        &self,
        x: &Vec<f32>,
        weight: &Vec<f32>,
        eps: f32,
        out: &mut Vec<f32>,
    ) -> Result<(), CudaError> {
        let n = weight.len();
        shape(
            "rms_norm",
            n > 0 && x.len().is_multiple_of(n) && out.len() >= x.len(),
            || format!("x {} / weight {n}", x.len()),
        )?;
        for (row, o) in x.chunks_exact(n).zip(out.chunks_exact_mut(n)) {
            let ss: f64 = row.iter().map(|&v| (v * v) as f64).sum();
            let scale = 1.0 / ((ss / n as f64) as f32 + eps).sqrt();
            for ((o, &v), &w) in o.iter_mut().zip(row).zip(weight) {
                *o = v * scale * w;
            }
        }
        Ok(())
    }
    fn matmul(
        &self,
        w: &RefMatrix,
        x: &Vec<f32>,
        n: usize,
        y: &mut Vec<f32>,
    ) -> Result<(), CudaError> {
        shape(
            "matmul",
            x.len() >= n * w.cols && y.len() >= n * w.rows,
            || format!("x {} / y {} for {n} tokens", x.len(), y.len()),
        )?;
        for t in 0..n {
            let xt = &x[t * w.cols..(t + 1) * w.cols];
            for r in 0..w.rows {
                y[t * w.rows + r] = dot(&w.w[r * w.cols..(r + 1) * w.cols], xt);
            }
        }
        Ok(())
    }
    fn add_assign(&self, x: &mut Vec<f32>, y: &Vec<f32>) -> Result<(), CudaError> {
        shape("add_assign", y.len() >= x.len(), || "lengths".into())?;
        x.iter_mut().zip(y).for_each(|(a, &b)| *a += b);
        Ok(())
    }
    fn add_bias(&self, x: &mut Vec<f32>, bias: &Vec<f32>) -> Result<(), CudaError> {
        let c = bias.len();
        shape("add_bias", c > 0 && x.len().is_multiple_of(c), || {
            "lengths".into()
        })?;
        for row in x.chunks_exact_mut(c) {
            row.iter_mut().zip(bias).for_each(|(a, &b)| *a += b);
        }
        Ok(())
    }
    fn rope_neox(
        &self,
        x: &mut Vec<f32>,
        positions: &Vec<i32>,
        n_heads: usize,
        head_dim: usize,
        p: &RopeParams,
    ) -> Result<(), CudaError> {
        shape(
            "rope_neox",
            x.len() >= positions.len() * n_heads * head_dim && p.n_dims <= head_dim,
            || "lengths".into(),
        )?;
        let half = p.n_dims / 2;
        for (t, &pos) in positions.iter().enumerate() {
            for h in 0..n_heads {
                let head = &mut x[(t * n_heads + h) * head_dim..][..head_dim];
                for i in 0..half {
                    let (c, s) = p.cos_sin(pos, i);
                    let (x0, x1) = (head[i], head[i + half]);
                    head[i] = x0.mul_add(c, -(x1 * s));
                    head[i + half] = x0.mul_add(s, x1 * c);
                }
            }
        }
        Ok(())
    }
    fn kv_store_f16(
        &self,
        src: &Vec<f32>,
        cache: &mut Vec<u16>,
        n_tokens: usize,
        width: usize,
        cells: usize,
        pos0: usize,
    ) -> Result<(), CudaError> {
        shape(
            "kv_store_f16",
            cells > 0 && src.len() >= n_tokens * width && cache.len() >= cells * width,
            || "lengths".into(),
        )?;
        for t in 0..n_tokens {
            let cell = (pos0 + t) % cells;
            for c in 0..width {
                cache[cell * width + c] = f16::from_f32(src[t * width + c]).to_bits();
            }
        }
        Ok(())
    }
    fn attention(
        &self,
        p: &AttnParams,
        q: &Vec<f32>,
        k_cache: &Vec<u16>,
        v_cache: &Vec<u16>,
        sinks: Option<&Vec<f32>>,
        n_tokens: usize,
        pos0: usize,
        out: &mut Vec<f32>,
    ) -> Result<(), CudaError> {
        let (hd, nh, nkv) = (p.head_dim, p.n_head, p.n_head_kv);
        let kvw = nkv * hd;
        shape(
            "attention",
            nkv > 0
                && nh.is_multiple_of(nkv)
                && q.len() >= n_tokens * nh * hd
                && out.len() >= n_tokens * nh * hd
                && k_cache.len() >= p.cells * kvw
                && v_cache.len() >= p.cells * kvw,
            || format!("{p:?}"),
        )?;
        let span = p
            .window
            .map_or(usize::MAX, |w| w + n_tokens.saturating_sub(1))
            .min(pos0 + n_tokens);
        shape("attention", span <= p.cells || n_tokens == 0, || {
            format!("{} cells for {span} keys", p.cells)
        })?;
        let h16 = |b: u16| f16::from_bits(b).to_f32();
        for t in 0..n_tokens {
            let pos = pos0 + t;
            let first = p.window.map_or(0, |w| (pos + 1).saturating_sub(w));
            for h in 0..nh {
                let kvh = h / (nh / nkv);
                let qh = &q[(t * nh + h) * hd..][..hd];
                let base = |pp: usize| (pp % p.cells) * kvw + kvh * hd;
                let scores: Vec<f32> = (first..=pos)
                    .map(|pp| {
                        let k: Vec<f32> =
                            k_cache[base(pp)..][..hd].iter().map(|&b| h16(b)).collect();
                        dot(qh, &k) * p.scale
                    })
                    .collect();
                let sink = sinks.map(|s| s[h]);
                let m = scores
                    .iter()
                    .copied()
                    .chain(sink)
                    .fold(f32::NEG_INFINITY, f32::max);
                let e: Vec<f64> = scores.iter().map(|&s| ((s - m) as f64).exp()).collect();
                let denom = e.iter().sum::<f64>() + sink.map_or(0.0, |s| ((s - m) as f64).exp());
                let o = &mut out[(t * nh + h) * hd..][..hd];
                for (dd, ov) in o.iter_mut().enumerate() {
                    let acc: f64 = (first..=pos)
                        .zip(&e)
                        .map(|(pp, &w)| w * h16(v_cache[base(pp) + dd]) as f64)
                        .sum();
                    *ov = if denom > 0.0 {
                        (acc / denom) as f32
                    } else {
                        0.0
                    };
                }
            }
        }
        Ok(())
    }
    fn router_top_k(
        &self,
        logits: &Vec<f32>,
        n_expert: usize,
        k: usize,
        selected: &mut Vec<i32>,
        weights: &mut Vec<f32>,
    ) -> Result<(), CudaError> {
        shape(
            "router_top_k",
            n_expert > 0 && k > 0 && k <= n_expert && logits.len().is_multiple_of(n_expert),
            || "shape".into(),
        )?;
        let n = logits.len() / n_expert;
        shape(
            "router_top_k",
            selected.len() >= n * k && weights.len() >= n * k,
            || "lengths".into(),
        )?;
        for t in 0..n {
            let row = &logits[t * n_expert..(t + 1) * n_expert];
            let mut idx: Vec<usize> = (0..n_expert).collect();
            idx.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
            let mx = row[idx[0]];
            let e: Vec<f32> = idx[..k].iter().map(|&i| (row[i] - mx).exp()).collect();
            let sum: f32 = e.iter().sum();
            for j in 0..k {
                selected[t * k + j] = idx[j] as i32;
                weights[t * k + j] = e[j] * (1.0 / sum);
            }
        }
        Ok(())
    }
    fn moe(
        &self,
        w: &RefMoe,
        x: &Vec<f32>,
        selected: &Vec<i32>,
        weights: &Vec<f32>,
        k: usize,
        out: &mut Vec<f32>,
    ) -> Result<(), CudaError> {
        let (d, ff) = (w.d, w.ff);
        shape("moe", k > 0 && x.len().is_multiple_of(d), || "x".into())?;
        let n = x.len() / d;
        shape(
            "moe",
            selected.len() >= n * k && weights.len() >= n * k && out.len() >= n * d,
            || "lengths".into(),
        )?;
        let mut h = vec![0f32; ff];
        for t in 0..n {
            let xt = &x[t * d..(t + 1) * d];
            let o = &mut out[t * d..(t + 1) * d];
            o.fill(0.0);
            for j in 0..k {
                let Some(e) = usize::try_from(selected[t * k + j])
                    .ok()
                    .filter(|&e| e < w.n_expert)
                else {
                    continue;
                };
                for (r, hv) in h.iter_mut().enumerate() {
                    let row = (e * ff + r) * d;
                    let g = dot(&w.gate[row..row + d], xt) + w.gate_bias[e * ff + r];
                    let u = dot(&w.up[row..row + d], xt) + w.up_bias[e * ff + r];
                    *hv = swiglu_oai(g, u);
                }
                let wt = weights[t * k + j];
                for (r, ov) in o.iter_mut().enumerate() {
                    let row = (e * d + r) * ff;
                    let y = dot(&w.down[row..row + ff], &h) + w.down_bias[e * d + r];
                    *ov += y * wt;
                }
            }
        }
        Ok(())
    }
    fn staging(&self, n_d: usize, n_k: usize) -> Result<RefStaging, CudaError> {
        Ok(RefStaging {
            h: vec![0.0; n_d],
            sel: vec![0; n_k],
            w: vec![0.0; n_k],
            out: vec![0.0; n_d],
        })
    }
    fn stage_down(
        &self,
        st: &mut RefStaging,
        h: &Vec<f32>,
        sel: &Vec<i32>,
        w: &Vec<f32>,
    ) -> Result<(), CudaError> {
        shape(
            "stage_down",
            st.h.len() == h.len() && st.sel.len() == sel.len() && st.w.len() == w.len(),
            || "lengths".into(),
        )?;
        st.h.copy_from_slice(h);
        st.sel.copy_from_slice(sel);
        st.w.copy_from_slice(w);
        *self
            .staged
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) += 1;
        Ok(())
    }
    fn staged<'s>(&self, st: &'s mut RefStaging) -> Result<StagedIo<'s>, CudaError> {
        Ok(StagedIo {
            h: &st.h,
            sel: &st.sel,
            w: &st.w,
            out: &mut st.out,
        })
    }
    fn stage_up(&self, st: &RefStaging, out: &mut Vec<f32>) -> Result<(), CudaError> {
        shape("stage_up", out.len() >= st.out.len(), || "lengths".into())?;
        out[..st.out.len()].copy_from_slice(&st.out);
        Ok(())
    }
}
