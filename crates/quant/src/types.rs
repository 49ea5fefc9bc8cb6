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
    /// Super-blocks of 256: 8-value rows of a 256-entry lattice grid with sign codes (2.06 bpw).
    IQ2_XXS,
    /// Super-blocks of 256: a 512-entry grid, sign codes, 4-bit scales per 16 (2.31 bpw).
    IQ2_XS,
    /// Super-blocks of 256: 4-value rows of a 256-entry grid with sign codes (3.06 bpw).
    IQ3_XXS,
    /// Super-blocks of 256: a 2048-entry ternary grid plus a ±1/8 shift (1.56 bpw).
    IQ1_S,
    /// Blocks of 32 4-bit indices into 16 non-linear values with one f16 scale.
    IQ4_NL,
    /// Super-blocks of 256: a 512-entry 4-value grid, sign bits, 4-bit scales (3.44 bpw).
    IQ3_S,
    /// Super-blocks of 256: a 1024-entry grid, sign bits, 4-bit scales per 16 (2.56 bpw).
    IQ2_S,
    /// Super-blocks of 256 IQ4_NL values with 6-bit scales per 32 (4.25 bpw).
    IQ4_XS,
    /// Super-blocks of 256: the IQ1_S grid with 3-bit scales per 16 (1.75 bpw).
    IQ1_M,
}

/// The IQ ("importance matrix") types: lattice-grid and non-linear formats the kernels multiply
/// against Q8_K activations (IQ4_NL against Q8_0).
pub const IQ_TYPES: [GgmlType; 9] = [
    GgmlType::IQ1_S,
    GgmlType::IQ1_M,
    GgmlType::IQ2_XXS,
    GgmlType::IQ2_XS,
    GgmlType::IQ2_S,
    GgmlType::IQ3_XXS,
    GgmlType::IQ3_S,
    GgmlType::IQ4_NL,
    GgmlType::IQ4_XS,
];

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
    pub const ALL: [GgmlType; 25] = [
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
        GgmlType::IQ2_XXS,
        GgmlType::IQ2_XS,
        GgmlType::IQ3_XXS,
        GgmlType::IQ1_S,
        GgmlType::IQ4_NL,
        GgmlType::IQ3_S,
        GgmlType::IQ2_S,
        GgmlType::IQ4_XS,
        GgmlType::IQ1_M,
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
            GgmlType::IQ2_XXS => 16,
            GgmlType::IQ2_XS => 17,
            GgmlType::IQ3_XXS => 18,
            GgmlType::IQ1_S => 19,
            GgmlType::IQ4_NL => 20,
            GgmlType::IQ3_S => 21,
            GgmlType::IQ2_S => 22,
            GgmlType::IQ4_XS => 23,
            GgmlType::IQ1_M => 29,
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
            GgmlType::IQ2_XXS => "IQ2_XXS",
            GgmlType::IQ2_XS => "IQ2_XS",
            GgmlType::IQ3_XXS => "IQ3_XXS",
            GgmlType::IQ1_S => "IQ1_S",
            GgmlType::IQ4_NL => "IQ4_NL",
            GgmlType::IQ3_S => "IQ3_S",
            GgmlType::IQ2_S => "IQ2_S",
            GgmlType::IQ4_XS => "IQ4_XS",
            GgmlType::IQ1_M => "IQ1_M",
        }
    }

    /// Parses a type name case-insensitively (`f16`, `Q8_0`, `mxfp4`).
    pub fn from_name(name: &str) -> Option<GgmlType> {
        Self::ALL
            .into_iter()
            .find(|t| t.name().eq_ignore_ascii_case(name))
    }

    /// Whether this is one of ggml's K-quants (Q2_K … Q6_K: 256-element super-blocks of
    /// sub-blocks with their own scales, multiplied with Q8_K activations).
    pub fn is_k_quant(self) -> bool {
        matches!(
            self,
            GgmlType::Q2_K | GgmlType::Q3_K | GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K
        )
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
            | GgmlType::MXFP4
            | GgmlType::IQ4_NL => 32,
            GgmlType::Q2_K
            | GgmlType::Q3_K
            | GgmlType::Q4_K
            | GgmlType::Q5_K
            | GgmlType::Q6_K
            | GgmlType::Q8_K
            | GgmlType::IQ2_XXS
            | GgmlType::IQ2_XS
            | GgmlType::IQ3_XXS
            | GgmlType::IQ1_S
            | GgmlType::IQ3_S
            | GgmlType::IQ2_S
            | GgmlType::IQ4_XS
            | GgmlType::IQ1_M => 256,
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
            GgmlType::IQ2_XXS => 66,
            GgmlType::IQ2_XS => 74,
            GgmlType::IQ3_XXS => 98,
            GgmlType::IQ1_S => 50,
            GgmlType::IQ4_NL => 18,
            GgmlType::IQ3_S => 110,
            GgmlType::IQ2_S => 82,
            GgmlType::IQ4_XS => 136,
            GgmlType::IQ1_M => 56,
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
/// K-quants and IQ types→Q8_K, IQ4_NL→Q8_0). Q8_K is not a weight type; ggml's table leaves it at F32.
pub fn vec_dot_type(w: GgmlType) -> GgmlType {
    use GgmlType::*;
    match w {
        F32 | Q8_K => F32,
        F16 => F16,
        BF16 => BF16,
        Q4_0 | Q5_0 | Q8_0 | MXFP4 | IQ4_NL => Q8_0,
        Q4_1 | Q5_1 | Q8_1 => Q8_1,
        Q2_K | Q3_K | Q4_K | Q5_K | Q6_K => Q8_K,
        IQ2_XXS | IQ2_XS | IQ3_XXS | IQ1_S | IQ3_S | IQ2_S | IQ4_XS | IQ1_M => Q8_K,
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
        // ggml's type_traits: (id, block elements, block bytes).
        for (ty, id, be, bb) in [
            (GgmlType::IQ2_XXS, 16, 256, 66),
            (GgmlType::IQ2_XS, 17, 256, 74),
            (GgmlType::IQ3_XXS, 18, 256, 98),
            (GgmlType::IQ1_S, 19, 256, 50),
            (GgmlType::IQ4_NL, 20, 32, 18),
            (GgmlType::IQ3_S, 21, 256, 110),
            (GgmlType::IQ2_S, 22, 256, 82),
            (GgmlType::IQ4_XS, 23, 256, 136),
            (GgmlType::IQ1_M, 29, 256, 56),
        ] {
            assert_eq!((ty.id(), ty.block_elems(), ty.block_bytes()), (id, be, bb));
        }
    }
}
