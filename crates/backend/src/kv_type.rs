//! The element types of a K/V cache and how attention reads it: [`CacheType`] (the values of
//! `-ctk` / `-ctv`), [`FlashAttn`] (`-fa`) and their checked combination [`KvType`]. Every
//! device stores its K/V rings in these types (see [`crate::KvLayout`]).

use hmoe_quant::GgmlType;

/// Element type of one half (K or V) of the cache: the values of `-ctk` / `-ctv`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types)]
pub enum CacheType {
    /// 32-bit floats: exact.
    F32,
    /// 16-bit floats (llama.cpp's default).
    F16,
    /// bfloat16.
    BF16,
    /// 8-bit blocks of 32 with an f16 scale (34 bytes per 32 values).
    Q8_0,
    /// 4-bit blocks of 32 with an f16 scale (18 bytes per 32 values).
    Q4_0,
    /// 4-bit blocks of 32 with an f16 scale and minimum (20 bytes per 32 values).
    Q4_1,
    /// 5-bit blocks of 32 with an f16 scale (22 bytes per 32 values).
    Q5_0,
    /// 5-bit blocks of 32 with an f16 scale and minimum (24 bytes per 32 values).
    Q5_1,
}

impl CacheType {
    /// Every cache type, in llama.cpp's `-ctk` order.
    pub const ALL: [CacheType; 8] = [
        CacheType::F32,
        CacheType::F16,
        CacheType::BF16,
        CacheType::Q8_0,
        CacheType::Q4_0,
        CacheType::Q4_1,
        CacheType::Q5_0,
        CacheType::Q5_1,
    ];

    /// Parses a `-ctk` / `-ctv` value (`f32`, `f16`, `bf16`, `q8_0`, `q4_0`, `q4_1`, `q5_0`,
    /// `q5_1`; case-insensitive).
    pub fn parse(s: &str) -> Option<CacheType> {
        Self::ALL
            .into_iter()
            .find(|t| t.name().eq_ignore_ascii_case(s))
    }

    /// The lower-case name llama.cpp uses (`q8_0`).
    pub fn name(self) -> &'static str {
        match self {
            CacheType::F32 => "f32",
            CacheType::F16 => "f16",
            CacheType::BF16 => "bf16",
            CacheType::Q8_0 => "q8_0",
            CacheType::Q4_0 => "q4_0",
            CacheType::Q4_1 => "q4_1",
            CacheType::Q5_0 => "q5_0",
            CacheType::Q5_1 => "q5_1",
        }
    }

    /// The ggml tensor type of the stored rows.
    pub fn ggml_type(self) -> GgmlType {
        match self {
            CacheType::F32 => GgmlType::F32,
            CacheType::F16 => GgmlType::F16,
            CacheType::BF16 => GgmlType::BF16,
            CacheType::Q8_0 => GgmlType::Q8_0,
            CacheType::Q4_0 => GgmlType::Q4_0,
            CacheType::Q4_1 => GgmlType::Q4_1,
            CacheType::Q5_0 => GgmlType::Q5_0,
            CacheType::Q5_1 => GgmlType::Q5_1,
        }
    }

    /// Block-quantized (ggml's `ggml_is_quantized`: not the float types, bf16 included).
    pub fn is_quantized(self) -> bool {
        !matches!(self, CacheType::F32 | CacheType::F16 | CacheType::BF16)
    }

    /// Elements per block: a head must be a multiple of this long.
    pub fn block_elems(self) -> usize {
        self.ggml_type().block_elems()
    }

    /// Bytes of `n` values (`n` a multiple of [`CacheType::block_elems`]; rounded down
    /// otherwise).
    pub fn row_bytes(self, n: usize) -> usize {
        let ty = self.ggml_type();
        n / ty.block_elems() * ty.block_bytes()
    }
}

impl std::fmt::Display for CacheType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// `-fa on|off|auto`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FlashAttn {
    /// Always use flash attention.
    On,
    /// Never (an error with a quantized V cache).
    Off,
    /// On wherever it is supported, as llama.cpp's default: on the CPU, always.
    Auto,
}

impl FlashAttn {
    /// Parses llama.cpp's values: `on`/`enabled`/`true`/`1`, `off`/`disabled`/`false`/`0`,
    /// `auto`/`-1`.
    pub fn parse(s: &str) -> Option<FlashAttn> {
        match s.to_ascii_lowercase().as_str() {
            "on" | "enabled" | "true" | "1" => Some(FlashAttn::On),
            "off" | "disabled" | "false" | "0" => Some(FlashAttn::Off),
            "auto" | "-1" => Some(FlashAttn::Auto),
            _ => None,
        }
    }
}

/// A K/V type combination llama.cpp refuses.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum KvTypeError {
    /// A quantized V cache is only read by flash attention.
    #[error("a quantized V cache ({0}) requires flash attention, which was turned off")]
    QuantizedVNeedsFlash(CacheType),
}

/// What the KV cache stores and how attention reads it: the K and V element types and
/// whether flash attention is on. Flash attention decides which V types are allowed (a
/// quantized V needs it, as in llama.cpp); flash attention (`-fa on` and `-fa auto`, the
/// default, as llama.cpp resolves auto on the CPU) runs the chunked online softmax over values
/// of every type (within the fixture tolerances of the goldens), while `-fa off` keeps the row
/// kernel over f32/f16/bf16 values, which meets the non-flash goldens exactly (see the CPU
/// device's attention).
///
/// [`KvType::F32`] and [`KvType::F16`] are the non-flash caches of earlier versions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct KvType {
    k: CacheType,
    v: CacheType,
    flash_attn: bool,
}

impl KvType {
    /// f32 K and V, non-flash attention: exact.
    pub const F32: KvType = KvType {
        k: CacheType::F32,
        v: CacheType::F32,
        flash_attn: false,
    };
    /// f16 K and V, non-flash attention: queries and probabilities are rounded to f16 before
    /// their dot products, as ggml's CPU backend does.
    pub const F16: KvType = KvType {
        k: CacheType::F16,
        v: CacheType::F16,
        flash_attn: false,
    };

    /// K and V types with flash attention `fa` (auto = on, as llama.cpp resolves it on the
    /// CPU); a quantized V with `fa` off is refused, as llama.cpp refuses it.
    pub fn new(k: CacheType, v: CacheType, fa: FlashAttn) -> Result<KvType, KvTypeError> {
        let flash_attn = match fa {
            FlashAttn::On | FlashAttn::Auto => true,
            FlashAttn::Off if v.is_quantized() => return Err(KvTypeError::QuantizedVNeedsFlash(v)),
            FlashAttn::Off => false,
        };
        Ok(KvType { k, v, flash_attn })
    }

    /// Parses one `-ctk`/`-ctv` value for both K and V; flash attention is off unless the
    /// type is quantized (which needs it).
    pub fn parse(s: &str) -> Option<KvType> {
        let t = CacheType::parse(s)?;
        Some(KvType {
            k: t,
            v: t,
            flash_attn: t.is_quantized(),
        })
    }

    /// The K element type.
    pub fn k(self) -> CacheType {
        self.k
    }

    /// The V element type.
    pub fn v(self) -> CacheType {
        self.v
    }

    /// Whether attention runs as flash attention: the chunked kernel (see [`KvType`]).
    pub fn flash_attn(self) -> bool {
        self.flash_attn
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn types_parse_and_size_like_ggml() {
        for t in CacheType::ALL {
            assert_eq!(CacheType::parse(&t.name().to_uppercase()), Some(t));
        }
        assert_eq!(CacheType::parse("q4_k"), None);
        assert_eq!(CacheType::Q8_0.row_bytes(64), 68);
        assert_eq!(CacheType::Q4_0.row_bytes(64), 36);
        assert_eq!(CacheType::BF16.row_bytes(64), 128);
        assert!(CacheType::Q5_1.is_quantized() && !CacheType::BF16.is_quantized());
        assert_eq!(KvType::parse("f16"), Some(KvType::F16));
        assert!(KvType::parse("q8_0").unwrap().flash_attn());
        assert_eq!(FlashAttn::parse("enabled"), Some(FlashAttn::On));
        assert_eq!(FlashAttn::parse("0"), Some(FlashAttn::Off));
        assert_eq!(FlashAttn::parse("-1"), Some(FlashAttn::Auto));
        assert_eq!(FlashAttn::parse("maybe"), None);
    }

    #[test]
    fn quantized_v_needs_flash_attention() {
        let err = KvType::new(CacheType::F16, CacheType::Q8_0, FlashAttn::Off).unwrap_err();
        assert!(
            err.to_string().contains("requires flash attention"),
            "{err}"
        );
        assert!(KvType::new(CacheType::Q8_0, CacheType::F16, FlashAttn::Off).is_ok());
        assert!(KvType::new(CacheType::BF16, CacheType::BF16, FlashAttn::Off).is_ok());
        let auto = KvType::new(CacheType::Q4_0, CacheType::Q4_0, FlashAttn::Auto).unwrap();
        assert!(auto.flash_attn());
        assert!(KvType::new(CacheType::F32, CacheType::F32, FlashAttn::Auto)
            .unwrap()
            .flash_attn());
        // `auto` is `on` over float values too: the chunked kernel, as llama.cpp's CPU auto.
        let f16 = |fa| KvType::new(CacheType::F16, CacheType::F16, fa).unwrap();
        assert_eq!(f16(FlashAttn::Auto), f16(FlashAttn::On));
        assert!(f16(FlashAttn::On).flash_attn());
        assert!(!f16(FlashAttn::Off).flash_attn());
    }
}
