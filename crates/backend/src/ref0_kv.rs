//! The reference device's K/V rings: the store and attention over rings of every K/V type
//! ([`crate::KV_TYPES`]), with the CPU device's numerics (hmoe-cpu's `kv_storage` and
//! `attention` modules) step for step, so that REF0 gives the CPU device's bits:
//!
//! - **Store**: a row is rotated in chunks of the layout's `rot` (the Walsh–Hadamard transform,
//!   [`numerics::fwht`]) and converted: f32 as is, f16 rounded to nearest even, bf16 and the
//!   block types by [`hmoe_quant::quantize_row`].
//! - **Attention** rotates the query like the keys and the output back like the values, then
//!   takes the CPU device's path for the value type:
//!   - f32/f16/bf16 values without [`AttnParams::flash`] (`-fa off`), the row kernel: scores over the visible keys (chunks of 16
//!     positions from the window's start rounded down), a softmax with ggml's `expf` summed per
//!     16-lane chunk in f64 (the sink's `exp` last), one multiply by the f32 inverse, and the
//!     value sum as 16 lanes (lane = position mod 16) with the probability rounded to the value
//!     type (f16, bf16; f32 as is), or, for one query token over f32/f16 values with
//!     [`AttnParams::value_chains`] 4, in `vec_dot`'s four chains of 16 lanes;
//!   - f32/f16/bf16 values with [`AttnParams::flash`], and block-quantized values whatever
//!     it says (llama.cpp reads a quantized V cache only by flash attention), the chunked
//!     flash kernel: the positions in chunks of [`FLASH_CHUNK`] fixed by position, each chunk
//!     a softmax from an empty state in blocks of [`FLASH_BLOCK`] positions
//!     ([`softmax_block`]: one rescale per block, then `acc = v·p + acc` key by key, block
//!     values dequantized to f32 first), the chunks folded in position order by
//!     [`merge_softmax_chunk`], then the sink folded in last and `acc / S`; f32/f16 keys
//!     scored by [`dot_chain`] (one FMA chain), bf16 and block keys by `vec_dot` as below.
//!
//!   K-only (latent) rings take the row kernel whatever their type, the values read from
//!   the keys ([`attention_k_only`]).
//!
//!   Scores: f32 keys in `vec_dot_f32` order ([`numerics::dot_vec`]); f16 keys against the
//!   query rounded to f16, in `vec_dot_f16` order (one query token) or tinyBLAS's 16 lanes (a
//!   batch) in the row kernel; bf16 and block keys by hmoe-quant's
//!   `vec_dot` kernel ([`DotKernel`]) against the query converted to its activation type.

use half::{bf16, f16};
use hmoe_quant::{DotKernel, GgmlType};

use crate::error::ensure;
use crate::numerics::{
    dot_chain, dot_vec, expf_ggml, fwht, hsum16, merge_softmax_chunk, rotate_chunks, softmax_block,
    sum_chains, FLASH_BLOCK, FLASH_CHUNK, VEC_DOT_CHAINS,
};
use crate::{AttnParams, BackendError, KOnlyAttnParams, KvLayout};

/// Lanes of ggml's accumulators.
const LANES: usize = 16;

/// A quantizer error as a shape error of `op`.
fn quant_err(op: &'static str) -> impl Fn(hmoe_quant::QuantError) -> BackendError {
    move |e| BackendError::Shape {
        op,
        what: e.to_string(),
    }
}

/// Bytes of the `n` values from value `at` of rows of `ty`.
fn byte_range(ty: GgmlType, at: usize, n: usize) -> std::ops::Range<usize> {
    let (be, bb) = (ty.block_elems(), ty.block_bytes());
    at / be * bb..(at + n) / be * bb
}

/// Stores `n_tokens` rows of `src` into the ring `data` of `layout` from position `pos0`.
pub(crate) fn store(
    layout: &KvLayout,
    src: &[f32],
    data: &mut [u8],
    n_tokens: usize,
    pos0: usize,
) -> Result<(), BackendError> {
    const OP: &str = "kv_store";
    let (w, rb) = (layout.width, layout.row_bytes());
    ensure(
        layout.cells > 0 && src.len() >= n_tokens * w && data.len() >= layout.bytes(),
        OP,
        || format!("{n_tokens} rows of {w} into {} bytes", data.len()),
    )?;
    for t in 0..n_tokens {
        let cell = (pos0 + t) % layout.cells;
        let row = &src[t * w..(t + 1) * w];
        let rotated;
        let row = if layout.rot > 0 {
            rotated = rotate_chunks(row, layout.rot);
            &rotated[..]
        } else {
            row
        };
        let dst = &mut data[cell * rb..(cell + 1) * rb];
        match layout.ty {
            GgmlType::F32 => {
                for (d, v) in dst.chunks_exact_mut(4).zip(row) {
                    d.copy_from_slice(&v.to_le_bytes());
                }
            }
            GgmlType::F16 => {
                for (d, &v) in dst.chunks_exact_mut(2).zip(row) {
                    d.copy_from_slice(&f16::from_f32(v).to_bits().to_le_bytes());
                }
            }
            ty => hmoe_quant::quantize_row(ty, row, dst).map_err(quant_err(OP))?,
        }
    }
    Ok(())
}

/// A query head converted for keys of one type, as the CPU device converts it.
enum Query {
    /// f32 keys: the head itself; f16 keys: the head rounded to f16.
    Floats(Vec<f32>),
    /// bf16 and block keys: the head in the key kernel's activation type.
    Blocks(Vec<u8>),
}

/// A ring's keys as attention reads them.
struct Keys<'a> {
    ty: GgmlType,
    data: &'a [u8],
    /// The `vec_dot` kernel of bf16 and block keys.
    kernel: Option<DotKernel>,
}

impl<'a> Keys<'a> {
    fn new(ty: GgmlType, data: &'a [u8]) -> Result<Keys<'a>, BackendError> {
        let kernel = match ty {
            GgmlType::F32 | GgmlType::F16 => None,
            _ => Some(DotKernel::best(ty).map_err(quant_err("attention"))?),
        };
        Ok(Keys { ty, data, kernel })
    }

    /// `qh` converted for these keys.
    fn query(&self, qh: &[f32]) -> Result<Query, BackendError> {
        Ok(match (&self.kernel, self.ty) {
            (Some(k), _) => {
                let mut out = vec![0u8; k.act_row_bytes(qh.len())];
                hmoe_quant::quantize_row(k.act_type(), qh, &mut out)
                    .map_err(quant_err("attention"))?;
                Query::Blocks(out)
            }
            (None, GgmlType::F16) => {
                Query::Floats(qh.iter().map(|&v| f16::from_f32(v).to_f32()).collect())
            }
            (None, _) => Query::Floats(qh.to_vec()),
        })
    }

    /// The unscaled score of the chunked flash kernel: [`dot_chain`] for f32/f16 keys, else
    /// as [`Keys::score`] (`vec_dot`).
    fn score_chain(&self, q: &Query, at: usize, n: usize) -> f32 {
        let b = &self.data[byte_range(self.ty, at, n)];
        match (q, self.ty) {
            (Query::Floats(qf), GgmlType::F32) => {
                let k: Vec<f32> = b.chunks_exact(4).map(le_f32).collect();
                dot_chain(qf, &k)
            }
            (Query::Floats(qf), GgmlType::F16) => {
                let k: Vec<f32> = b.chunks_exact(2).map(le_f16).collect();
                dot_chain(qf, &k)
            }
            _ => self.score(q, at, n, false),
        }
    }

    /// The unscaled score of the key head of `n` values from value `at`; `lanes`: f16 keys in
    /// tinyBLAS's 16-lane order (else `vec_dot_f16`'s).
    fn score(&self, q: &Query, at: usize, n: usize, lanes: bool) -> f32 {
        let b = &self.data[byte_range(self.ty, at, n)];
        match (q, &self.kernel) {
            (Query::Blocks(qb), Some(k)) => k.dot(n, b, qb),
            (Query::Floats(qf), _) if self.ty == GgmlType::F32 => {
                let k: Vec<f32> = b.chunks_exact(4).map(le_f32).collect();
                dot_vec(qf, &k, |v| v, false)
            }
            (Query::Floats(qf), _) => {
                let k: Vec<f32> = b.chunks_exact(2).map(le_f16).collect();
                score_f16(qf, &k, lanes)
            }
            // `query` gives blocks exactly when there is a kernel.
            (Query::Blocks(_), None) => f32::NAN,
        }
    }
}

/// The unscaled score of query `q` against an f16 key (as floats): in tinyBLAS's 16-lane
/// order when `lanes` (a batch of queries), else `vec_dot_f16`'s.
pub(crate) fn score_f16(q: &[f32], k: &[f32], lanes: bool) -> f32 {
    if lanes {
        let mut acc = [0f32; LANES];
        for (i, (&a, &kv)) in q.iter().zip(k).enumerate() {
            acc[i % LANES] = a.mul_add(kv, acc[i % LANES]);
        }
        hsum16(&acc)
    } else {
        dot_vec(q, k, |v| v, true)
    }
}

fn le_f32(b: &[u8]) -> f32 {
    f32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

fn le_f16(b: &[u8]) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32()
}

/// The `out.len()` values of a row of `ty` from value `at` of `data`, as f32.
fn values(ty: GgmlType, data: &[u8], at: usize, out: &mut [f32]) -> Result<(), BackendError> {
    let b = &data[byte_range(ty, at, out.len())];
    match ty {
        GgmlType::F32 => out
            .iter_mut()
            .zip(b.chunks_exact(4))
            .for_each(|(o, c)| *o = le_f32(c)),
        GgmlType::F16 => out
            .iter_mut()
            .zip(b.chunks_exact(2))
            .for_each(|(o, c)| *o = le_f16(c)),
        _ => hmoe_quant::dequantize_row(ty, b, out).map_err(quant_err("attention"))?,
    }
    Ok(())
}

/// Whether values of `ty` are read by the chunked flash kernel whatever
/// [`AttnParams::flash`] says (block-quantized, not bf16), as the CPU engine decides.
fn flash(ty: GgmlType) -> bool {
    !matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16)
}

/// A probability as the row kernel's value product sees it: rounded to f16/bf16 values.
fn round_weight(ty: GgmlType, w: f32) -> f32 {
    match ty {
        GgmlType::F16 => f16::from_f32(w).to_f32(),
        GgmlType::BF16 => bf16::from_f32(w).to_f32(),
        _ => w,
    }
}

/// One attention call over rings: K `(layout, bytes)`, V likewise (see the module docs).
#[allow(clippy::too_many_arguments)]
pub(crate) fn attention(
    p: &AttnParams,
    q: &[f32],
    k: (&KvLayout, &[u8]),
    v: (&KvLayout, &[u8]),
    sinks: Option<&[f32]>,
    n_tokens: usize,
    pos0: usize,
    out: &mut [f32],
) -> Result<(), BackendError> {
    const OP: &str = "attention";
    let (hd, nh, nkv) = (p.head_dim, p.n_head, p.n_head_kv);
    let kvw = nkv * hd;
    let ((kl, kd), (vl, vd)) = (k, v);
    let n_q = n_tokens * nh * hd;
    ensure(
        nkv > 0
            && nh.is_multiple_of(nkv)
            && q.len() >= n_q
            && out.len() >= n_q
            && sinks.is_none_or(|s| s.len() >= nh)
            && matches!(p.value_chains, 1 | VEC_DOT_CHAINS)
            && [kl, vl]
                .iter()
                .all(|l| l.width == kvw && l.cells == p.cells)
            && kd.len() >= kl.bytes()
            && vd.len() >= vl.bytes(),
        OP,
        || format!("{p:?} over K {kl:?} / V {vl:?}"),
    )?;
    for (which, l) in [("K", kl), ("V", vl)] {
        ensure(
            hd.is_multiple_of(l.ty.block_elems()) && (l.rot == 0 || hd.is_multiple_of(l.rot)),
            OP,
            || {
                format!(
                    "{which} heads of {hd} are not whole {} blocks / rotation chunks of {}",
                    l.ty, l.rot
                )
            },
        )?;
    }
    let span = p.keys_seen(n_tokens, pos0);
    ensure(span <= p.cells || n_tokens == 0, OP, || {
        format!("{} cells for {span} keys", p.cells)
    })?;
    let q = &q[..n_q];
    let rotated;
    let q = if kl.rot > 0 {
        rotated = rotate_chunks(q, kl.rot);
        &rotated[..]
    } else {
        q
    };
    let keys = Keys::new(kl.ty, kd)?;
    let single = n_tokens == 1;
    // One token's f32/f16 values in the chains the call asks for; everything else in one.
    let chains = match vl.ty {
        GgmlType::F32 | GgmlType::F16 if single => p.value_chains,
        _ => 1,
    };
    let mut v_row = vec![0f32; hd];
    for t in 0..n_tokens {
        let pos = pos0 + t;
        let first = p.window.map_or(0, |w| (pos + 1).saturating_sub(w));
        for h in 0..nh {
            let kvh = h / (nh / nkv);
            let at = |pp: usize| (pp % p.cells) * kvw + kvh * hd;
            let row = RingRow {
                keys: &keys,
                q: keys.query(&q[(t * nh + h) * hd..][..hd])?,
                at: &at,
                v: (vl.ty, vd),
                hd,
                scale: p.scale,
                first,
                pos,
            };
            let sink = sinks.map(|s| s[h]);
            let o = &mut out[(t * nh + h) * hd..][..hd];
            if p.flash || flash(vl.ty) {
                row.chunked_flash(&mut v_row)?.finish(sink, o);
            } else {
                let chains = (chains, !single);
                row.row_kernel(sink, chains, &mut v_row, o)?;
            }
        }
    }
    if vl.rot > 0 {
        out[..n_q].chunks_exact_mut(vl.rot).for_each(fwht);
    }
    Ok(())
}

/// One (query, head) row of [`attention`] over rings: the converted query, where its KV
/// head's keys and values lie, and the positions `first..=pos` it sees.
struct RingRow<'a> {
    keys: &'a Keys<'a>,
    q: Query,
    /// Element offset of the KV head at a position.
    at: &'a dyn Fn(usize) -> usize,
    /// The value ring's type and bytes.
    v: (GgmlType, &'a [u8]),
    hd: usize,
    scale: f32,
    first: usize,
    pos: usize,
}

impl RingRow<'_> {
    /// The chunked kernel (values of every type, block values dequantized): chunks of
    /// `FLASH_CHUNK` positions fixed by position, each its own softmax in blocks of
    /// `FLASH_BLOCK` positions, folded in position order.
    fn chunked_flash(&self, v_row: &mut [f32]) -> Result<FlashRow, BackendError> {
        let (first, pos) = (self.first, self.pos);
        let mut total = FlashRow::new(self.hd);
        for c in first / FLASH_CHUNK..=pos / FLASH_CHUNK {
            let mut row = FlashRow::new(self.hd);
            let (lo, hi) = (
                (c * FLASH_CHUNK).max(first),
                ((c + 1) * FLASH_CHUNK).min(pos + 1),
            );
            for b in lo / FLASH_BLOCK..hi.div_ceil(FLASH_BLOCK) {
                let keys_of = (b * FLASH_BLOCK).max(lo)..((b + 1) * FLASH_BLOCK).min(hi);
                let scores: Vec<f32> = keys_of
                    .clone()
                    .map(|pp| self.keys.score_chain(&self.q, (self.at)(pp), self.hd) * self.scale)
                    .collect();
                let value = |i: usize, v: &mut [f32]| {
                    values(self.v.0, self.v.1, (self.at)(keys_of.start + i), v)
                };
                row.add_block(&scores, value, v_row)?;
            }
            merge_softmax_chunk(
                &mut total.m,
                &mut total.s,
                &mut total.acc,
                (row.m, row.s, &row.acc),
            );
        }
        Ok(total)
    }

    /// The row kernel: scores in chunks of 16 positions from `first` rounded down to a
    /// multiple of 16 (those before `first` weigh 0), ggml's `expf`, the sum by halving per
    /// chunk, then the values in 16 lanes over positions (`chains` of them, and 16-lane
    /// scores of f16 keys when `lanes`), into `o`.
    fn row_kernel(
        &self,
        sink: Option<f32>,
        (chains, lanes): (usize, bool),
        v_row: &mut [f32],
        o: &mut [f32],
    ) -> Result<(), BackendError> {
        let (first, pos, hd, vt) = (self.first, self.pos, self.hd, self.v.0);
        let chunk_start = first / LANES * LANES;
        let scores: Vec<f32> = (chunk_start..=pos)
            .map(|pp| match pp < first {
                true => 0.0,
                false => self.keys.score(&self.q, (self.at)(pp), hd, lanes) * self.scale,
            })
            .collect();
        let m = scores[first - chunk_start..]
            .iter()
            .copied()
            .chain(sink)
            .fold(f32::NEG_INFINITY, f32::max);
        let e: Vec<f32> = scores
            .iter()
            .enumerate()
            .map(|(i, &s)| match chunk_start + i < first {
                true => 0.0,
                false => expf_ggml(s - m),
            })
            .collect();
        let mut sum = 0f64;
        for chunk in e.chunks(LANES) {
            let mut lanes = [0f32; LANES];
            lanes[..chunk.len()].copy_from_slice(chunk);
            sum += hsum16(&lanes) as f64;
        }
        if let Some(s) = sink {
            sum += (s - m).exp() as f64;
        }
        let inv = (1.0 / sum) as f32;
        // Lane `i` of a value dimension takes position `i` of every chunk (of the chunk's
        // chain, for one token's float values in `vec_dot`'s chains).
        let mut acc = vec![[[0f32; LANES]; VEC_DOT_CHAINS]; hd];
        for (i, &ev) in e.iter().enumerate() {
            let pp = chunk_start + i;
            if pp < first {
                continue;
            }
            let w = round_weight(vt, ev * inv);
            values(vt, self.v.1, (self.at)(pp), v_row)?;
            let (chain, lane) = ((pp / LANES) % chains, i % LANES);
            for (a, &x) in acc.iter_mut().zip(&*v_row) {
                a[chain][lane] = x.mul_add(w, a[chain][lane]);
            }
        }
        for (ov, a) in o.iter_mut().zip(&acc) {
            *ov = sum_chains(a, chains);
        }
        Ok(())
    }
}

/// Attention over a K-only ring (`layout`, bytes), the values the first `p.v_dim` of each key,
/// as the CPU device's latent attention (its row kernel with the values in the keys): the
/// query rotated like the keys; scores as [`Keys::score`] (f16 keys of a batch in 16 lanes
/// when a key is whole 16-lane steps long); the softmax of [`attention`]'s row kernel; the
/// values summed in 16 lanes with the probability rounded to the ring's type, one query
/// token's f32/f16 values in `vec_dot`'s four chains; the output rotated back like the keys.
/// Shapes are checked by the caller ([`crate::shapes::attention_k_only`]).
pub(crate) fn attention_k_only(
    p: &KOnlyAttnParams,
    q: &[f32],
    (layout, data): (&KvLayout, &[u8]),
    n_tokens: usize,
    pos0: usize,
    out: &mut [f32],
) -> Result<(), BackendError> {
    let (nh, kd, vd) = (p.n_head, p.k_dim, p.v_dim);
    let q = &q[..n_tokens * nh * kd];
    let rotated;
    let q = if layout.rot > 0 {
        rotated = rotate_chunks(q, layout.rot);
        &rotated[..]
    } else {
        q
    };
    let keys = Keys::new(layout.ty, data)?;
    let single = n_tokens == 1;
    let lanes = !single && kd.is_multiple_of(LANES);
    let chains = match layout.ty {
        GgmlType::F32 | GgmlType::F16 if single => VEC_DOT_CHAINS,
        _ => 1,
    };
    let at = |pp: usize| (pp % p.cells) * kd;
    let mut v_row = vec![0f32; vd];
    for t in 0..n_tokens {
        let pos = pos0 + t;
        for h in 0..nh {
            let qh = keys.query(&q[(t * nh + h) * kd..][..kd])?;
            let scores: Vec<f32> = (0..=pos)
                .map(|pp| keys.score(&qh, at(pp), kd, lanes) * p.scale)
                .collect();
            let m = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let e: Vec<f32> = scores.iter().map(|&s| expf_ggml(s - m)).collect();
            let mut sum = 0f64;
            for chunk in e.chunks(LANES) {
                let mut l = [0f32; LANES];
                l[..chunk.len()].copy_from_slice(chunk);
                sum += hsum16(&l) as f64;
            }
            let inv = (1.0 / sum) as f32;
            let mut acc = vec![[[0f32; LANES]; VEC_DOT_CHAINS]; vd];
            for (pp, &ev) in e.iter().enumerate() {
                let w = round_weight(layout.ty, ev * inv);
                values(layout.ty, data, at(pp), &mut v_row)?;
                let (chain, lane) = ((pp / LANES) % chains, pp % LANES);
                for (a, &x) in acc.iter_mut().zip(&v_row) {
                    a[chain][lane] = x.mul_add(w, a[chain][lane]);
                }
            }
            let o = &mut out[(t * nh + h) * vd..][..vd];
            for (ov, a) in o.iter_mut().zip(&acc) {
                *ov = sum_chains(a, chains);
            }
        }
    }
    if layout.rot > 0 {
        out[..n_tokens * nh * vd]
            .chunks_exact_mut(layout.rot)
            .for_each(fwht);
    }
    Ok(())
}

/// One (query, head) row of flash attention: the running maximum, the running sum of
/// `e^(score − m)` and the value accumulator.
struct FlashRow {
    m: f32,
    s: f32,
    acc: Vec<f32>,
}

impl FlashRow {
    fn new(n: usize) -> FlashRow {
        FlashRow {
            m: f32::NEG_INFINITY,
            s: 0.0,
            acc: vec![0.0; n],
        }
    }

    /// `acc *= f` (skipped for 1, which changes nothing).
    fn scale(&mut self, f: f32) {
        if f != 1.0 {
            self.acc.iter_mut().for_each(|a| *a *= f);
        }
    }

    /// One block of keys of the chunked kernel ([`softmax_block`]): `value(i, v)` writes key
    /// `i`'s value head into `v`.
    fn add_block(
        &mut self,
        scores: &[f32],
        mut value: impl FnMut(usize, &mut [f32]) -> Result<(), BackendError>,
        v: &mut [f32],
    ) -> Result<(), BackendError> {
        let mut probs = vec![0f32; scores.len()];
        let ms = softmax_block(&mut self.m, &mut self.s, scores, &mut probs);
        self.acc.iter_mut().for_each(|a| *a *= ms);
        for (i, &p) in probs.iter().enumerate() {
            value(i, v)?;
            for (a, &x) in self.acc.iter_mut().zip(v.iter()) {
                *a = x.mul_add(p, *a);
            }
        }
        Ok(())
    }

    /// The sink folded in, then `acc / S` into `out`.
    fn finish(mut self, sink: Option<f32>, out: &mut [f32]) {
        if let Some(sink) = sink {
            if sink > self.m {
                let ms = (self.m - sink).exp();
                self.scale(ms);
                self.s = self.s.mul_add(ms, 1.0);
            } else {
                self.s += (sink - self.m).exp();
            }
        }
        let inv = if self.s == 0.0 { 0.0 } else { 1.0 / self.s };
        self.scale(inv);
        out.copy_from_slice(&self.acc);
    }
}
