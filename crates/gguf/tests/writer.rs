//! Writer round trips: every metadata type, several tensor types, split output, and rewriting
//! the fixtures byte for byte.

mod common;

use common::{assert_same_tensors, fixture, scratch};
use hmoe_gguf::{GgmlType, GgufModel, GgufWriter, LoadOptions, MetaType, MetaValue, Metadata};

fn every_meta_value() -> Vec<(&'static str, MetaValue)> {
    use MetaValue as V;
    vec![
        ("t.u8", V::U8(250)),
        ("t.i8", V::I8(-100)),
        ("t.u16", V::U16(65000)),
        ("t.i16", V::I16(-32000)),
        ("t.u32", V::U32(4_000_000_000)),
        ("t.i32", V::I32(-2_000_000_000)),
        ("t.u64", V::U64(u64::MAX - 1)),
        ("t.i64", V::I64(i64::MIN + 1)),
        ("t.f32", V::F32(-1.5e-7)),
        ("t.f64", V::F64(std::f64::consts::PI)),
        ("t.bool.t", V::Bool(true)),
        ("t.bool.f", V::Bool(false)),
        ("t.str", V::String("héllo ✓ \u{0}".into())),
        ("t.str.empty", V::String(String::new())),
        ("t.arr.u8", V::Array(MetaType::U8, vec![V::U8(1), V::U8(2)])),
        ("t.arr.i8", V::Array(MetaType::I8, vec![V::I8(-1)])),
        (
            "t.arr.u16",
            V::Array(MetaType::U16, vec![V::U16(7), V::U16(8)]),
        ),
        ("t.arr.i16", V::Array(MetaType::I16, vec![V::I16(-7)])),
        ("t.arr.u32", V::Array(MetaType::U32, vec![V::U32(1 << 31)])),
        (
            "t.arr.i32",
            V::Array(MetaType::I32, vec![V::I32(-1), V::I32(5)]),
        ),
        ("t.arr.u64", V::Array(MetaType::U64, vec![V::U64(1 << 63)])),
        (
            "t.arr.i64",
            V::Array(MetaType::I64, vec![V::I64(-(1 << 62))]),
        ),
        (
            "t.arr.f32",
            V::Array(MetaType::F32, vec![V::F32(0.5), V::F32(f32::INFINITY)]),
        ),
        (
            "t.arr.f64",
            V::Array(MetaType::F64, vec![V::F64(-0.0), V::F64(1e300)]),
        ),
        (
            "t.arr.bool",
            V::Array(MetaType::Bool, vec![V::Bool(true), V::Bool(false)]),
        ),
        (
            "t.arr.str",
            V::Array(
                MetaType::String,
                vec![V::String("a".into()), V::String(String::new())],
            ),
        ),
        ("t.arr.empty", V::Array(MetaType::U32, vec![])),
        ("t.arr.empty.str", V::Array(MetaType::String, vec![])),
        (
            "t.arr.nested",
            V::Array(
                MetaType::Array,
                vec![
                    V::Array(MetaType::I32, vec![V::I32(1), V::I32(2)]),
                    V::Array(MetaType::I32, vec![]),
                    V::Array(MetaType::String, vec![V::String("x".into())]),
                ],
            ),
        ),
        (
            "t.arr.nested3",
            V::Array(
                MetaType::Array,
                vec![V::Array(
                    MetaType::Array,
                    vec![V::Array(MetaType::Bool, vec![V::Bool(true)])],
                )],
            ),
        ),
        ("t.arr.empty.nested", V::Array(MetaType::Array, vec![])),
    ]
}

/// Deterministic filler bytes.
fn bytes(n: usize, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

fn sample_writer(alignment: u64) -> GgufWriter {
    let mut w = GgufWriter::new();
    w.add_meta("general.architecture", MetaValue::String("test".into()));
    for (k, v) in every_meta_value() {
        w.add_meta(k, v);
    }
    if alignment != 32 {
        w.set_alignment(alignment);
    }
    let tensors: [(&str, GgmlType, &[u64]); 9] = [
        ("f32.1d", GgmlType::F32, &[5]),
        ("f16.2d", GgmlType::F16, &[3, 7]),
        ("bf16.3d", GgmlType::BF16, &[2, 2, 2]),
        ("q8_0", GgmlType::Q8_0, &[64, 3]),
        ("q4_0.4d", GgmlType::Q4_0, &[32, 1, 2, 3]),
        ("q4_k", GgmlType::Q4_K, &[256, 2]),
        ("q6_k", GgmlType::Q6_K, &[512]),
        ("mxfp4", GgmlType::MXFP4, &[64, 4, 3]),
        ("q5_1", GgmlType::Q5_1, &[32]),
    ];
    for (i, (name, ty, dims)) in tensors.into_iter().enumerate() {
        let n = dims.iter().product::<u64>();
        let size = ty.row_bytes(dims[0]).unwrap() * (n / dims[0]);
        w.add_tensor(name, ty, dims, bytes(size as usize, i as u8))
            .unwrap();
    }
    w
}

fn assert_metadata_eq(a: &Metadata, b: &Metadata) {
    let ka: Vec<_> = a.iter().collect();
    let kb: Vec<_> = b.iter().collect();
    assert_eq!(ka, kb);
}

#[test]
fn every_meta_type_and_tensor_type_round_trips() {
    for alignment in [32, 64, 1, 4096] {
        let w = sample_writer(alignment);
        let bytes = w.to_bytes().unwrap();
        let m = GgufModel::from_bytes(bytes.clone()).unwrap();
        assert_eq!(m.version(), 3);
        assert_eq!(m.alignment(), alignment);
        assert_metadata_eq(m.metadata(), w.metadata());
        assert_eq!(
            m.metadata().get_u64("general.alignment"),
            (alignment != 32).then_some(alignment)
        );
        assert_eq!(m.tensors().len(), 9);
        for (i, t) in m.tensors().iter().enumerate() {
            assert_eq!(t.offset % alignment, 0);
            assert_eq!(m.data_of(t), &self::bytes(t.n_bytes as usize, i as u8)[..]);
        }
        assert_eq!(m.tensor_info("mxfp4").unwrap().n_bytes, 2 * 17 * 12);
        // Writing again what was read gives the same bytes.
        assert_eq!(
            GgufWriter::from_model(&m).unwrap().to_bytes().unwrap(),
            bytes
        );
        // And through a file.
        let dir = scratch(&format!("roundtrip-{alignment}"));
        let path = dir.join("m.gguf");
        w.write(&path).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), bytes);
        let from_file = GgufModel::open(&path, LoadOptions::default()).unwrap();
        assert_same_tensors(&from_file, &m);
        assert_eq!(from_file.shard_paths(), [path]);
    }
}

#[test]
fn add_meta_replaces_in_place() {
    let mut w = GgufWriter::new();
    w.add_meta("a", MetaValue::U8(1));
    w.add_meta("b", MetaValue::U8(2));
    w.add_meta("a", MetaValue::String("x".into()));
    let m = GgufModel::from_bytes(w.to_bytes().unwrap()).unwrap();
    let entries: Vec<_> = m.metadata().iter().collect();
    assert_eq!(
        entries,
        [
            ("a", &MetaValue::String("x".into())),
            ("b", &MetaValue::U8(2))
        ]
    );
}

#[test]
fn empty_file_round_trips() {
    let w = GgufWriter::new();
    let bytes = w.to_bytes().unwrap();
    assert_eq!(bytes.len(), 32, "24-byte header padded to the alignment");
    let m = GgufModel::from_bytes(bytes).unwrap();
    assert!(m.metadata().is_empty() && m.tensors().is_empty());
}

#[test]
fn write_split_reads_back_equal_to_unsplit() {
    let w = sample_writer(32);
    let whole = GgufModel::from_bytes(w.to_bytes().unwrap()).unwrap();
    for (max, shards) in [(1, 9), (2, 5), (4, 3), (9, 1), (100, 1)] {
        let dir = scratch(&format!("split-{max}"));
        let paths = w.write_split(dir.join("model"), max).unwrap();
        assert_eq!(paths.len(), shards);
        for (i, p) in paths.iter().enumerate() {
            let expected = format!("model-{:05}-of-{shards:05}.gguf", i + 1);
            assert!(p.ends_with(&expected), "{}", p.display());
        }
        for p in [&paths[0], &paths[shards - 1]] {
            let split = GgufModel::open(p, LoadOptions::default()).unwrap();
            assert_same_tensors(&split, &whole);
            assert_eq!(split.shard_paths(), &paths[..]);
            let md = split.metadata();
            for (k, v) in whole.metadata().iter() {
                assert_eq!(md.get(k), Some(v), "{k}");
            }
            assert_eq!(md.get("split.count"), Some(&MetaValue::U16(shards as u16)));
            assert_eq!(md.get("split.tensors.count"), Some(&MetaValue::I32(9)));
        }
    }
    // Non-default alignment is carried by every shard.
    let w = sample_writer(128);
    let dir = scratch("split-aligned");
    let paths = w.write_split(dir.join("m"), 4).unwrap();
    let split = GgufModel::open(&paths[1], LoadOptions::default()).unwrap();
    assert!(split.tensors().iter().all(|t| t.offset % 128 == 0));
    let whole = GgufModel::from_bytes(w.to_bytes().unwrap()).unwrap();
    assert_same_tensors(&split, &whole);
}

#[test]
fn rewriting_gptoss_tiny_is_byte_identical() {
    let path = fixture("gpt-oss/gptoss-tiny.gguf");
    let original = std::fs::read(&path).unwrap();
    let m = GgufModel::open(&path, LoadOptions::default()).unwrap();
    let w = GgufWriter::from_model(&m).unwrap();
    let rewritten = w.to_bytes().unwrap();
    let again = GgufModel::from_bytes(rewritten.clone()).unwrap();
    assert_metadata_eq(again.metadata(), m.metadata());
    assert_same_tensors(&again, &m);
    assert!(
        rewritten == original,
        "rewritten file differs from the original"
    );

    // Splitting it like `llama-gguf-split --split-max-tensors 27` gives the fixture's shards.
    let dir = scratch("resplit-tiny");
    let paths = w.write_split(dir.join("gptoss-tiny-split"), 27).unwrap();
    assert_eq!(paths.len(), 3);
    for (k, p) in paths.iter().enumerate() {
        let ours = std::fs::read(p).unwrap();
        let theirs = std::fs::read(fixture(&format!(
            "gpt-oss/gptoss-tiny-split-0000{}-of-00003.gguf",
            k + 1
        )))
        .unwrap();
        assert!(
            ours == theirs,
            "shard {} differs from llama-gguf-split's",
            k + 1
        );
    }
    // And the split fixture, rewritten as one file, is the unsplit file again.
    let split = GgufModel::open(
        fixture("gpt-oss/gptoss-tiny-split-00002-of-00003.gguf"),
        LoadOptions::default(),
    )
    .unwrap();
    let joined = GgufWriter::from_model(&split).unwrap().to_bytes().unwrap();
    assert!(
        joined == original,
        "merged split differs from the unsplit file"
    );
}

#[test]
fn rewriting_other_fixtures_preserves_their_parse() {
    for rel in [
        "gpt-oss/gptoss-openai.gguf",
        "qwen3moe/qwen3moe-tiny.gguf",
        "deepseek2/deepseek2-tiny.gguf",
        "tokenizer/vocab-1k.gguf",
    ] {
        let path = fixture(rel);
        let m = GgufModel::open(&path, LoadOptions::default()).unwrap();
        let rewritten = GgufWriter::from_model(&m).unwrap().to_bytes().unwrap();
        let again = GgufModel::from_bytes(rewritten.clone()).unwrap();
        assert_metadata_eq(again.metadata(), m.metadata());
        assert_same_tensors(&again, &m);
        let original = std::fs::read(&path).unwrap();
        assert!(
            rewritten == original,
            "{rel}: rewrite is not byte-identical"
        );
    }
}

/// One hand-made shard: its F32 [1] tensors (name, value), split.no, split.tensors.count,
/// split.count.
type HandShard<'a> = (&'a [(&'a str, f32)], u16, i32, u16);

/// Writes a 2-shard model by hand: shard i gets `tensors[i]` (name, value) F32 [1] tensors and
/// the split keys given.
fn hand_split(dir: &std::path::Path, shards: [HandShard; 2]) -> Vec<std::path::PathBuf> {
    let mut paths = Vec::new();
    for (i, (tensors, no, total, count)) in shards.into_iter().enumerate() {
        let mut w = GgufWriter::new();
        if i == 0 {
            w.add_meta("general.architecture", MetaValue::String("test".into()));
        }
        w.add_meta("split.no", MetaValue::U16(no));
        w.add_meta("split.tensors.count", MetaValue::I32(total));
        w.add_meta("split.count", MetaValue::U16(count));
        for (name, v) in tensors {
            w.add_tensor(*name, GgmlType::F32, &[1], v.to_le_bytes().to_vec())
                .unwrap();
        }
        let path = dir.join(format!("m-{:05}-of-00002.gguf", i + 1));
        w.write(&path).unwrap();
        paths.push(path);
    }
    paths
}

#[test]
fn inconsistent_split_metadata_is_rejected() {
    let a: &[(&str, f32)] = &[("a", 1.0), ("b", 2.0)];
    let c: &[(&str, f32)] = &[("c", 3.0)];
    let dir = scratch("hand-split");
    let open = |p: &std::path::Path| GgufModel::open(p, LoadOptions::default());

    let paths = hand_split(&dir, [(a, 0, 3, 2), (c, 1, 3, 2)]);
    for p in &paths {
        let m = open(p).unwrap();
        assert_eq!(m.tensors().len(), 3);
        assert_eq!(m.tensor_data("c"), Some(&3.0f32.to_le_bytes()[..]));
        assert_eq!(m.tensor_info("c").unwrap().shard, 1);
    }

    let cases: [([HandShard; 2], &str); 5] = [
        (
            [(a, 0, 3, 2), (c, 1, 4, 2)],
            "split.tensors.count is 4 but shard 1 says 3",
        ),
        (
            [(a, 0, 5, 2), (c, 1, 5, 2)],
            "split.tensors.count = 5 but the 2 shards hold 3 tensors",
        ),
        (
            [(a, 0, 3, 2), (c, 0, 3, 2)],
            "split.no is 0 but this is shard 2",
        ),
        ([(a, 0, 3, 2), (c, 1, 3, 3)], "split.count is 3 but "),
        (
            [(a, 0, 3, 2), (&[("a", 9.0)], 1, 3, 2)],
            "tensor 'a' also appears in an earlier shard",
        ),
    ];
    for (shards, expected) in cases {
        let paths = hand_split(&dir, shards);
        let err = open(&paths[0]).unwrap_err().to_string();
        assert!(err.contains(expected), "{err:?} lacks {expected:?}");
        assert!(err.contains("m-0000"), "{err}");
    }
}

/// A tensor added as a hole keeps its place in the table, reads back as zeros and takes no
/// disk space (a 1 GiB layout written in a few milliseconds).
#[test]
fn hole_tensors_make_a_sparse_file() {
    use std::os::unix::fs::MetadataExt;
    let mut w = GgufWriter::new();
    w.add_meta("general.architecture", MetaValue::String("test".into()));
    w.add_tensor("small", GgmlType::F32, &[8], bytes(32, 3))
        .unwrap();
    w.add_tensor_hole("big", GgmlType::MXFP4, &[4096, 4096, 32])
        .unwrap();
    w.add_tensor_hole("tail", GgmlType::Q8_0, &[64, 3]).unwrap();
    let path = scratch("sparse").join("sparse.gguf");
    w.write(&path).unwrap();
    let m = GgufModel::open(&path, LoadOptions::default()).unwrap();
    let big = m.tensor_info("big").unwrap();
    assert_eq!(big.n_bytes, 4096 * 4096 * 32 / 32 * 17);
    let tail = m.tensor_info("tail").unwrap().clone();
    let file = std::fs::metadata(&path).unwrap();
    assert_eq!(file.len(), (tail.offset + tail.n_bytes).div_ceil(32) * 32);
    assert!(
        file.blocks() * 512 < 1 << 20,
        "{} bytes on disk",
        file.blocks() * 512
    );
    assert!(m.data_of(&tail).iter().all(|&b| b == 0));
    assert_eq!(m.tensor_data("small").unwrap(), &bytes(32, 3)[..]);
    let in_memory = w.to_bytes().unwrap();
    assert_eq!(in_memory.len() as u64, file.len());
}
