//! The IQ types' dequantisation against the `gguf` Python package (`gguf.quants`, the format's
//! reference in Python): random blocks, including extreme and special f16 scales, must
//! dequantise to the same bits. Needs `$HMOE_PYTHON` (else `python3`) with `gguf` and `numpy`;
//! prints `SKIPPED:` without them.

use hmoe_quant::{dequantize_row, set_iq_block_scale, GgmlType, IQ_TYPES};
use std::process::Command;

/// Dequantises the raw blocks in argv[2] (type name argv[1]) with gguf and writes f32 to argv[3].
const SCRIPT: &str = r#"
import sys, numpy as np
from gguf import GGMLQuantizationType as T, quants
ty = T[sys.argv[1]]
raw = np.fromfile(sys.argv[2], dtype=np.uint8)
quants.dequantize(raw, ty).astype(np.float32).tofile(sys.argv[3])
"#;

mod common;
use common::Rng;

/// f16 scales worth testing: extremes, subnormals, zeros, negatives, and a NaN and infinity.
const SCALES: [u16; 12] = [
    0x3c00, 0x7bff, 0xfbff, 0x0001, 0x8001, 0x03ff, 0x0400, 0x0000, 0x8000, 0x1234, 0x7c00, 0x7e00,
];

/// `blocks` random blocks of `ty`: random codes, every block's scale from [`SCALES`] in turn
/// except every third, which keeps a random (finite) f16.
fn random_blocks(ty: GgmlType, blocks: usize, rng: &mut Rng) -> Vec<u8> {
    let bb = ty.block_bytes();
    let mut raw: Vec<u8> = (0..blocks * bb).map(|_| rng.next() as u8).collect();
    for (i, b) in raw.chunks_exact_mut(bb).enumerate() {
        let d = if i % 3 == 2 {
            (rng.next() as u16) & 0x7bff | (rng.next() as u16 & 0x8000)
        } else {
            SCALES[i % SCALES.len()]
        };
        assert!(set_iq_block_scale(ty, b, d));
    }
    raw
}

fn python() -> Option<String> {
    let py = std::env::var("HMOE_PYTHON").unwrap_or_else(|_| "python3".into());
    let ok = Command::new(&py)
        .args(["-c", "import gguf.quants, numpy"])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    ok.then_some(py)
}

#[test]
fn iq_dequantisation_matches_gguf_python_bit_for_bit() {
    let Some(py) = python() else {
        println!("SKIPPED: no Python with the gguf package (set HMOE_PYTHON)");
        return;
    };
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("hmoe-iq-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    for ty in IQ_TYPES {
        let blocks = 96;
        let raw = random_blocks(ty, blocks, &mut rng);
        let (src, dst) = (dir.join("blocks.bin"), dir.join("values.bin"));
        std::fs::write(&src, &raw).unwrap();
        let out = Command::new(&py)
            .args(["-c", SCRIPT, ty.name()])
            .arg(&src)
            .arg(&dst)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{ty}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let want: Vec<f32> = std::fs::read(&dst)
            .unwrap()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        let mut got = vec![0.0f32; blocks * ty.block_elems()];
        dequantize_row(ty, &raw, &mut got).unwrap();
        assert_eq!(want.len(), got.len(), "{ty}");
        for (i, (w, g)) in want.iter().zip(&got).enumerate() {
            let same = w.to_bits() == g.to_bits() || (w.is_nan() && g.is_nan());
            assert!(
                same,
                "{ty} element {i} (block {}): gguf {w:e}, hmoe {g:e}",
                i / ty.block_elems()
            );
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}
