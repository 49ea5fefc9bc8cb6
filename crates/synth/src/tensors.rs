//! Random tensors generated directly in their storage format, and the plan/assembly shared by
//! the Qwen3-MoE and DeepSeek writers.

use half::f16;
use hmoe_gguf::GgufWriter;
use hmoe_quant::GgmlType;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rayon::prelude::*;

/// A tensor to generate: name, type, ggml shape and the distribution of its values.
pub(crate) struct Plan {
    pub name: String,
    pub ty: GgmlType,
    pub dims: Vec<u64>,
    pub std: f32,
    pub mean: f32,
}

impl Plan {
    /// A weight matrix `[n_in, n_out, extra…]` of type `ty`, falling back to F32 when its rows
    /// are not a whole number of `ty` blocks; values of std `gain / √n_in`.
    pub fn matrix(name: String, ty: GgmlType, dims: Vec<u64>, gain: f32) -> Plan {
        let n_in = dims[0];
        let ty = if n_in.is_multiple_of(ty.block_elems() as u64) {
            ty
        } else {
            GgmlType::F32
        };
        Plan {
            name,
            ty,
            dims,
            std: gain / (n_in as f32).sqrt(),
            mean: 0.0,
        }
    }

    /// An F32 vector or matrix of values `mean ± std`.
    pub fn f32(name: String, dims: Vec<u64>, std: f32, mean: f32) -> Plan {
        Plan {
            name,
            ty: GgmlType::F32,
            dims,
            std,
            mean,
        }
    }
}

/// The weight types the synthetic writers can generate for matrices: F32, Q8_0, Q4_0, Q4_K,
/// Q5_K, Q6_K and the IQ types (random codes).
pub fn supported_weight_type(ty: GgmlType) -> bool {
    matches!(
        ty,
        GgmlType::F32
            | GgmlType::Q8_0
            | GgmlType::Q4_0
            | GgmlType::Q4_K
            | GgmlType::Q5_K
            | GgmlType::Q6_K
    ) || hmoe_quant::IQ_TYPES.contains(&ty)
}

/// The standard deviation of IQ type `ty`'s values for random codes and scale 1, measured by
/// dequantising 64 random blocks.
fn iq_unit_std(ty: GgmlType) -> f32 {
    let mut rng = StdRng::seed_from_u64(ty.id() as u64);
    let mut raw = vec![0u8; 64 * ty.block_bytes()];
    rng.fill(&mut raw[..]);
    for block in raw.chunks_exact_mut(ty.block_bytes()) {
        hmoe_quant::set_iq_block_scale(ty, block, f16::ONE.to_bits());
    }
    let mut v = vec![0f32; 64 * ty.block_elems()];
    hmoe_quant::dequantize_row(ty, &raw, &mut v).expect("IQ types dequantise");
    let n = v.len() as f64;
    let mean = v.iter().map(|&x| x as f64).sum::<f64>() / n;
    let var = v.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n;
    var.sqrt() as f32
}

/// Checks that the synthetic writers generate every type of `types` (expert matrices) and that
/// each dimension of `dims` (`n_embd`, `n_ff_exp`) is whole blocks of each.
pub(crate) fn check_expert_types(
    types: &[GgmlType],
    (n_embd, n_ff_exp): (usize, usize),
) -> Result<(), String> {
    for &ty in types {
        if !supported_weight_type(ty) {
            return Err(format!(
                "expert type {ty} is not generated (use q8_0, q4_0, q4_k, q5_k, q6_k, f32 or an iq type)"
            ));
        }
        let block = ty.block_elems();
        if !n_embd.is_multiple_of(block) || !n_ff_exp.is_multiple_of(block) {
            return Err(format!(
                "n_embd and n_ff_exp must be multiples of {block} for {ty} experts"
            ));
        }
    }
    Ok(())
}

/// Generates every planned tensor (in parallel, one seeded stream per tensor) and adds them to
/// `w`; with `sparse`, adds file holes instead of data.
pub(crate) fn add_planned(
    w: &mut GgufWriter,
    plans: Vec<Plan>,
    seed: u64,
    sparse: bool,
) -> Result<(), String> {
    let data: Vec<Option<Vec<u8>>> = plans
        .par_iter()
        .enumerate()
        .map(|(i, p)| {
            let seed = seed.wrapping_mul(1_000_003).wrapping_add(i as u64);
            (!sparse).then(|| random_tensor(p, seed))
        })
        .collect();
    for (p, bytes) in plans.into_iter().zip(data) {
        match bytes {
            Some(bytes) => w.add_tensor(p.name, p.ty, &p.dims, bytes),
            None => w.add_tensor_hole(p.name, p.ty, &p.dims),
        }
        .map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// Random values of roughly standard deviation `std` around `mean` (quantized types: mean 0),
/// written straight into the tensor's blocks.
pub(crate) fn random_tensor(p: &Plan, seed: u64) -> Vec<u8> {
    let mut rng = StdRng::seed_from_u64(seed);
    let n: u64 = p.dims.iter().product();
    let bytes = p.ty.row_bytes(n).expect("dims are whole blocks") as usize;
    let mut out = vec![0u8; bytes];
    let f16_bytes = |x: f32| f16::from_f32(x).to_le_bytes();
    match p.ty {
        GgmlType::F32 => {
            for c in out.chunks_exact_mut(4) {
                // Sum of 4 uniforms: cheap, roughly normal, std 1 after scaling by √3.
                let u: f32 = (0..4).map(|_| rng.random::<f32>() - 0.5).sum::<f32>() * 3f32.sqrt();
                c.copy_from_slice(&(p.mean + p.std * u).to_le_bytes());
            }
        }
        GgmlType::Q8_0 => {
            // int8 uniform in [-127, 127] has std ≈ 73.3.
            let d = f16_bytes(p.std / 73.3);
            for block in out.chunks_exact_mut(34) {
                block[..2].copy_from_slice(&d);
                for q in &mut block[2..] {
                    *q = rng.random_range(-127i8..=127) as u8;
                }
            }
        }
        GgmlType::Q4_0 => {
            // q − 8 with q uniform in 0..16 has std ≈ 4.61.
            let d = f16_bytes(p.std / 4.61);
            for block in out.chunks_exact_mut(18) {
                block[..2].copy_from_slice(&d);
                rng.fill(&mut block[2..]);
            }
        }
        GgmlType::Q4_K => {
            // d·sc·q − dmin·m with uniform 6-bit sc, m and 4-bit q: dmin = 7.5·d centres the
            // values; their std is then ≈ 256·d.
            let d = p.std / 256.0;
            let (dd, dmin) = (f16_bytes(d), f16_bytes(7.5 * d));
            for block in out.chunks_exact_mut(144) {
                block[..2].copy_from_slice(&dd);
                block[2..4].copy_from_slice(&dmin);
                rng.fill(&mut block[4..]);
            }
        }
        GgmlType::Q5_K => {
            // As Q4_K with 5-bit q: dmin = 15.5·d centres the values, whose std is then
            // ≈ 527·d (Var(sc·q) + 15.5²·Var(m) for uniform 6-bit sc, m and 5-bit q).
            let d = p.std / 527.0;
            let (dd, dmin) = (f16_bytes(d), f16_bytes(15.5 * d));
            for block in out.chunks_exact_mut(176) {
                block[..2].copy_from_slice(&dd);
                block[2..4].copy_from_slice(&dmin);
                rng.fill(&mut block[4..]);
            }
        }
        GgmlType::Q6_K => {
            // d·sc·(q − 32) with uniform int8 sc (std ≈ 73.9) and 6-bit q (q − 32: std
            // ≈ 18.5): std ≈ 1365·d. Quants and scales are random bytes, d the last two.
            let d = f16_bytes(p.std / 1365.0);
            for block in out.chunks_exact_mut(210) {
                rng.fill(&mut block[..208]);
                block[208..].copy_from_slice(&d);
            }
        }
        ty if hmoe_quant::IQ_TYPES.contains(&ty) => {
            // Random codes (every bit pattern is a valid IQ block), one scale per block.
            let d = f16::from_f32(p.std / iq_unit_std(ty)).to_bits();
            rng.fill(&mut out[..]);
            for block in out.chunks_exact_mut(ty.block_bytes()) {
                hmoe_quant::set_iq_block_scale(ty, block, d);
            }
        }
        other => unreachable!("the synthetic writers generate no {other} tensors"),
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantized_tensors_have_about_the_requested_spread() {
        for ty in [
            GgmlType::F32,
            GgmlType::Q8_0,
            GgmlType::Q4_0,
            GgmlType::Q4_K,
            GgmlType::Q5_K,
            GgmlType::Q6_K,
        ]
        .into_iter()
        .chain(hmoe_quant::IQ_TYPES)
        {
            let p = Plan::matrix("w".into(), ty, vec![256, 64], 1.0);
            assert_eq!(p.ty, ty);
            let bytes = random_tensor(&p, 7);
            let mut vals = vec![0f32; 256 * 64];
            hmoe_quant::dequantize_row(ty, &bytes, &mut vals).unwrap();
            let n = vals.len() as f32;
            let mean = vals.iter().sum::<f32>() / n;
            let std = (vals.iter().map(|v| (v - mean).powi(2)).sum::<f32>() / n).sqrt();
            assert!(mean.abs() < 0.2 * p.std, "{ty:?}: mean {mean}");
            assert!(
                (std / p.std - 1.0).abs() < 0.25,
                "{ty:?}: std {std} vs {}",
                p.std
            );
        }
    }

    #[test]
    fn rows_that_are_not_whole_blocks_fall_back_to_f32() {
        assert_eq!(
            Plan::matrix("w".into(), GgmlType::Q4_K, vec![64, 8], 1.0).ty,
            GgmlType::F32
        );
        assert_eq!(
            Plan::matrix("w".into(), GgmlType::Q8_0, vec![48, 8], 1.0).ty,
            GgmlType::F32
        );
        assert_eq!(
            Plan::matrix("w".into(), GgmlType::Q8_0, vec![64, 8], 1.0).ty,
            GgmlType::Q8_0
        );
    }
}
