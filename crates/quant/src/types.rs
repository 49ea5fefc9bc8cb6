//! The ggml tensor type table: ids as stored in GGUF files and the block layout of each type.

/// A ggml tensor element type, with the numeric id GGUF files store.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types)]
pub enum GgmlType {
    /// 32-bit IEEE float.
    F32,
    /// 16-bit IEEE half float.
    F16,
    /// Blocks of 32 4-bit values with one f16 scale.
    Q4_0,
    /// Blocks of 32 4-bit values with an f16 scale and minimum.
    Q4_1,
    /// Blocks of 32 5-bit values with one f16 scale.
    Q5_0,
    /// Blocks of 32 5-bit values with an f16 scale and minimum.
    Q5_1,
    /// Blocks of 32 8-bit values with one f16 scale.
    Q8_0,
    /// Blocks of 32 8-bit values with an f16 scale and the scaled sum (activations of 4/5-bit dots).
    Q8_1,
    /// Super-blocks of 256 2-bit values, 4-bit sub-block scales and minimums.
    Q2_K,
    /// Super-blocks of 256 3-bit values, 6-bit sub-block scales.
    Q3_K,
    /// Super-blocks of 256 4-bit values, 6-bit sub-block scales and minimums.
    Q4_K,
    /// Super-blocks of 256 5-bit values, 6-bit sub-block scales and minimums.
    Q5_K,
    /// Super-blocks of 256 6-bit values, 8-bit sub-block scales.
    Q6_K,
    /// Super-blocks of 256 8-bit values with an f32 scale and sub-block sums (activations of K-quant dots).
    Q8_K,
    /// 16-bit brain float (the top half of an f32).
    BF16,
    /// Blocks of 32 4-bit E2M1 values with one E8M0 (power of two) scale.
    MXFP4,
}

/// The low-bit weight types of GGUF files that the kernels multiply (against Q8_0, Q8_1 or Q8_K
/// activations): the legacy Q4_0, Q4_1, Q5_0, Q5_1 and the K-quants Q2_K to Q6_K.
pub const LOWBIT_TYPES: [GgmlType; 9] = [
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
];

/// Every weight type the dot-product kernels multiply: F32, F16, BF16, Q8_0, MXFP4 and the
/// [`LOWBIT_TYPES`]. A device that multiplies all of them lists this.
pub const WEIGHT_TYPES: [GgmlType; 14] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q8_0,
    GgmlType::MXFP4,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
];

impl GgmlType {
    /// Every type this crate knows, for iteration in tests and tables.
    pub const ALL: [GgmlType; 16] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::Q8_1,
        GgmlType::Q2_K,
        GgmlType::Q3_K,
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
        GgmlType::Q8_K,
        GgmlType::BF16,
        GgmlType::MXFP4,
    ];

    /// The type with GGUF id `id`, or `None` for an id we do not support.
    pub fn from_id(id: u32) -> Option<GgmlType> {
        Self::ALL.into_iter().find(|t| t.id() == id)
    }

    /// The numeric id stored in GGUF tensor tables.
    pub fn id(self) -> u32 {
        match self {
            GgmlType::F32 => 0,
            GgmlType::F16 => 1,
            GgmlType::Q4_0 => 2,
            GgmlType::Q4_1 => 3,
            GgmlType::Q5_0 => 6,
            GgmlType::Q5_1 => 7,
            GgmlType::Q8_0 => 8,
            GgmlType::Q8_1 => 9,
            GgmlType::Q2_K => 10,
            GgmlType::Q3_K => 11,
            GgmlType::Q4_K => 12,
            GgmlType::Q5_K => 13,
            GgmlType::Q6_K => 14,
            GgmlType::Q8_K => 15,
            GgmlType::BF16 => 30,
            GgmlType::MXFP4 => 39,
        }
    }

    /// The name llama.cpp prints for this type (`q8_0`, `mxfp4`, ...), upper-cased as in gguf-py.
    pub fn name(self) -> &'static str {
        match self {
            GgmlType::F32 => "F32",
            GgmlType::F16 => "F16",
            GgmlType::Q4_0 => "Q4_0",
            GgmlType::Q4_1 => "Q4_1",
            GgmlType::Q5_0 => "Q5_0",
            GgmlType::Q5_1 => "Q5_1",
            GgmlType::Q8_0 => "Q8_0",
            GgmlType::Q8_1 => "Q8_1",
            GgmlType::Q2_K => "Q2_K",
            GgmlType::Q3_K => "Q3_K",
            GgmlType::Q4_K => "Q4_K",
            GgmlType::Q5_K => "Q5_K",
            GgmlType::Q6_K => "Q6_K",
            GgmlType::Q8_K => "Q8_K",
            GgmlType::BF16 => "BF16",
            GgmlType::MXFP4 => "MXFP4",
        }
    }

    /// Parses a type name case-insensitively (`f16`, `Q8_0`, `mxfp4`).
    pub fn from_name(name: &str) -> Option<GgmlType> {
        Self::ALL
            .into_iter()
            .find(|t| t.name().eq_ignore_ascii_case(name))
    }

    /// Elements per block (1 for plain float types).
    pub fn block_elems(self) -> usize {
        match self {
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => 1,
            GgmlType::Q4_0
            | GgmlType::Q4_1
            | GgmlType::Q5_0
            | GgmlType::Q5_1
            | GgmlType::Q8_0
            | GgmlType::Q8_1
            | GgmlType::MXFP4 => 32,
            GgmlType::Q2_K
            | GgmlType::Q3_K
            | GgmlType::Q4_K
            | GgmlType::Q5_K
            | GgmlType::Q6_K
            | GgmlType::Q8_K => 256,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            GgmlType::F32 => 4,
            GgmlType::F16 | GgmlType::BF16 => 2,
            GgmlType::Q4_0 => 18,
            GgmlType::Q4_1 => 20,
            GgmlType::Q5_0 => 22,
            GgmlType::Q5_1 => 24,
            GgmlType::Q8_0 => 34,
            GgmlType::Q8_1 => 36,
            GgmlType::Q2_K => 84,
            GgmlType::Q3_K => 110,
            GgmlType::Q4_K => 144,
            GgmlType::Q5_K => 176,
            GgmlType::Q6_K => 210,
            GgmlType::Q8_K => 292,
            GgmlType::MXFP4 => 17,
        }
    }

    /// Bytes of a row of `n` elements, or `None` when `n` is not a whole number of blocks
    /// or the size overflows.
    pub fn row_bytes(self, n: u64) -> Option<u64> {
        let be = self.block_elems() as u64;
        if !n.is_multiple_of(be) {
            return None;
        }
        (n / be).checked_mul(self.block_bytes() as u64)
    }
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// ggml's `vec_dot_type`: the format activations must be in to be dotted with weights of type
/// `w` (F32→F32, F16→F16, BF16→BF16, Q8_0/MXFP4/Q4_0/Q5_0→Q8_0, Q4_1/Q5_1/Q8_1→Q8_1,
/// K-quants→Q8_K). Q8_K is not a weight type; ggml's table leaves it at F32.
pub fn vec_dot_type(w: GgmlType) -> GgmlType {
    use GgmlType::*;
    match w {
        F32 | Q8_K => F32,
        F16 => F16,
        BF16 => BF16,
        Q4_0 | Q5_0 | Q8_0 | MXFP4 => Q8_0,
        Q4_1 | Q5_1 | Q8_1 => Q8_1,
        Q2_K | Q3_K | Q4_K | Q5_K | Q6_K => Q8_K,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_and_sizes_match_ggml() {
        for t in GgmlType::ALL {
            assert_eq!(GgmlType::from_id(t.id()), Some(t));
            assert_eq!(GgmlType::from_name(&t.name().to_lowercase()), Some(t));
        }
        assert_eq!(GgmlType::from_id(4), None);
        assert_eq!(GgmlType::MXFP4.row_bytes(2880), Some(90 * 17));
        assert_eq!(GgmlType::Q8_0.row_bytes(33), None);
        assert_eq!(GgmlType::Q6_K.row_bytes(256), Some(210));
    }
}
