//! Opening the real fixture files: every GGUF under the fixtures folder, the gpt-oss files
//! against their generation parameters, and the 3-shard split against the unsplit file.

mod common;

use std::path::{Path, PathBuf};
use std::time::Instant;

use common::{assert_same_tensors, fixture, fixtures, scratch};
use hmoe_gguf::{GgmlType, GgufError, GgufModel, LoadOptions, MetaValue};

fn open(path: &Path) -> GgufModel {
    GgufModel::open(path, LoadOptions::default())
        .unwrap_or_else(|e| panic!("open {}: {e}", path.display()))
}

fn gguf_files(sub: &str) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = std::fs::read_dir(fixtures().join(sub))
        .unwrap_or_else(|e| panic!("fixtures/{sub}: {e}"))
        .map(|e| e.expect("dir entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "gguf"))
        .collect();
    out.sort();
    out
}

#[test]
fn every_fixture_opens_and_is_plausible() {
    let mut n_files = 0;
    for sub in ["gpt-oss", "qwen3moe", "deepseek2", "tokenizer"] {
        for path in gguf_files(sub) {
            n_files += 1;
            let m = open(&path);
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            assert!(matches!(m.version(), 2 | 3), "{name}");
            assert_eq!(m.alignment(), 32, "{name}");
            let arch = m.metadata().architecture().map(str::to_owned);
            assert!(
                m.metadata().get_str("tokenizer.ggml.model").is_some(),
                "{name}"
            );
            let tokens = m
                .metadata()
                .get_str_array("tokenizer.ggml.tokens")
                .expect("tokens");
            assert!(tokens.len() >= 1000, "{name}: {} tokens", tokens.len());
            if sub == "tokenizer" {
                assert!(m.tensors().is_empty(), "{name} is vocab-only");
                continue;
            }
            let expected_arch = match sub {
                "gpt-oss" => "gpt-oss",
                "qwen3moe" => "qwen3moe",
                _ => "deepseek2",
            };
            assert_eq!(arch.as_deref(), Some(expected_arch), "{name}");
            let block_count = m
                .metadata()
                .get_u64(&format!("{expected_arch}.block_count"))
                .expect("block_count");
            assert!(!m.tensors().is_empty());
            for t in m.tensors() {
                assert!((1..=4).contains(&t.dims.len()), "{}", t.name);
                assert_eq!(t.n_elements, t.dims.iter().product::<u64>(), "{}", t.name);
                assert_eq!(t.n_bytes, t.row_bytes() * t.n_rows(), "{}", t.name);
                assert_eq!(m.data_of(t).len() as u64, t.n_bytes, "{}", t.name);
                assert_eq!(t.offset % 32, 0, "{}", t.name);
                assert!(t.shard < m.shard_paths().len());
                if let Some(rest) = t.name.strip_prefix("blk.") {
                    let layer: u64 = rest.split('.').next().unwrap().parse().unwrap();
                    assert!(layer < block_count, "{}", t.name);
                }
            }
            let embd = m.tensor_info("token_embd.weight").expect("token_embd");
            assert_eq!(embd.dims.len(), 2);
            assert_eq!(embd.dims[1] as usize, tokens.len(), "{name}: vocab rows");
            let n_embd = m
                .metadata()
                .get_u64(&format!("{expected_arch}.embedding_length"))
                .unwrap();
            assert_eq!(embd.dims[0], n_embd, "{name}");
            if sub != "gpt-oss" {
                // Converted with --outtype f32.
                assert!(m.tensors().iter().all(|t| t.ty == GgmlType::F32), "{name}");
            }
        }
    }
    assert!(n_files >= 16, "found only {n_files} GGUF files");
}

#[test]
fn fixture_tensor_counts_and_types() {
    // (file, tensors, F32, Q8_0, MXFP4), as listed by an independent reader.
    let expected = [
        ("gpt-oss/gptoss-tiny.gguf", 79, 49, 18, 12),
        ("gpt-oss/gptoss-small.gguf", 79, 49, 18, 12),
        ("gpt-oss/gptoss-openai.gguf", 79, 67, 0, 12),
        ("gpt-oss/gptoss-openai-f32experts.gguf", 79, 79, 0, 0),
        ("qwen3moe/qwen3moe-tiny.gguf", 27, 27, 0, 0),
        ("deepseek2/deepseek2-tiny.gguf", 52, 52, 0, 0),
    ];
    for (rel, n, f32, q8, mxfp4) in expected {
        let m = open(&fixture(rel));
        let count = |ty| m.tensors().iter().filter(|t| t.ty == ty).count();
        assert_eq!(m.tensors().len(), n, "{rel}");
        assert_eq!(count(GgmlType::F32), f32, "{rel}");
        assert_eq!(count(GgmlType::Q8_0), q8, "{rel}");
        assert_eq!(count(GgmlType::MXFP4), mxfp4, "{rel}");
        // Data is laid out back to back (each padded to 32) after the header.
        let mut tensors: Vec<_> = m.tensors().iter().collect();
        tensors.sort_by_key(|t| t.offset);
        for w in tensors.windows(2) {
            assert_eq!(
                w[1].offset,
                (w[0].offset + w[0].n_bytes).next_multiple_of(32),
                "{rel}"
            );
        }
    }
    // DeepSeek's MLA k_b/v_b are 3-D: [kv_lora, head_dim, n_head].
    let ds = open(&fixture("deepseek2/deepseek2-tiny.gguf"));
    let kb = ds.tensor_info("blk.0.attn_k_b.weight").unwrap();
    assert_eq!(kb.dims, [16, 16, 4]);
    assert_eq!(kb.n_rows(), 64);
    assert_eq!(ds.metadata().get_u32("deepseek2.block_count"), Some(3));
    let qw = open(&fixture("qwen3moe/qwen3moe-tiny.gguf"));
    assert_eq!(qw.metadata().get_u32("qwen3moe.expert_count"), Some(8));
}

fn check_against_params(gguf: &str, params: &str) {
    let m = open(&fixture(gguf));
    let text = std::fs::read_to_string(fixture(params)).unwrap();
    let p: serde_json::Value = serde_json::from_str(&text).unwrap();
    let expected = p["tensors"].as_array().unwrap();
    assert_eq!(m.tensors().len(), expected.len());
    for (t, e) in m.tensors().iter().zip(expected) {
        assert_eq!(t.name, e["name"].as_str().unwrap());
        assert_eq!(t.ty.name(), e["type"].as_str().unwrap(), "{}", t.name);
        let shape: Vec<u64> = e["ggml_shape"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_u64().unwrap())
            .collect();
        assert_eq!(t.dims, shape, "{}", t.name);
        assert_eq!(t.n_bytes, e["nbytes"].as_u64().unwrap(), "{}", t.name);
        assert_eq!(m.tensor_data(&t.name).unwrap().len() as u64, t.n_bytes);
    }
    assert_eq!(m.total_tensor_bytes(), p["tensor_bytes"].as_u64().unwrap());
    let file_len = std::fs::metadata(fixture(gguf)).unwrap().len();
    assert_eq!(file_len, p["file_bytes"].as_u64().unwrap());
    let md = m.metadata();
    assert_eq!(md.get_u64("gpt-oss.embedding_length"), p["n_embd"].as_u64());
    assert_eq!(md.get_u64("gpt-oss.block_count"), p["n_layer"].as_u64());
    assert_eq!(md.get_u64("gpt-oss.expert_count"), p["n_expert"].as_u64());
    assert_eq!(md.get_u32("tokenizer.ggml.bos_token_id"), Some(1016));
    assert_eq!(md.get_f32("gpt-oss.rope.freq_base"), Some(150000.0));
    assert_eq!(
        md.get_f32("gpt-oss.attention.layer_norm_rms_epsilon"),
        Some(1e-5)
    );
    assert_eq!(md.get_str("gpt-oss.rope.scaling.type"), Some("yarn"));
    assert_eq!(md.get_str("tokenizer.ggml.pre"), Some("gpt-4o"));
    assert_eq!(
        md.get_str_array("tokenizer.ggml.tokens").unwrap()[1020],
        "<|start|>"
    );
    let types = md.get_array("tokenizer.ggml.token_type").unwrap();
    assert_eq!(types.len(), 1024);
    assert!(matches!(types[0], MetaValue::I32(1)));
}

#[test]
fn gptoss_small_matches_params() {
    check_against_params(
        "gpt-oss/gptoss-small.gguf",
        "gpt-oss/gptoss-small.params.json",
    );
}

#[test]
fn gptoss_tiny_matches_params() {
    check_against_params(
        "gpt-oss/gptoss-tiny.gguf",
        "gpt-oss/gptoss-tiny.params.json",
    );
}

#[test]
fn gptoss_type_mix_is_like_the_published_files() {
    let m = open(&fixture("gpt-oss/gptoss-small.gguf"));
    for t in m.tensors() {
        let expected = if t.name.contains("_exps.weight") {
            GgmlType::MXFP4
        } else if t.name.ends_with(".weight") && t.dims.len() == 2 && !t.name.contains("gate_inp") {
            GgmlType::Q8_0
        } else {
            GgmlType::F32
        };
        assert_eq!(t.ty, expected, "{}", t.name);
    }
    let exps = m.tensor_info("blk.0.ffn_gate_exps.weight").unwrap();
    assert_eq!(exps.dims, [256, 256, 16]);
    assert_eq!(exps.n_rows(), 256 * 16);
    assert_eq!(exps.row_bytes(), 8 * 17);
}

#[test]
fn split_model_equals_unsplit_via_any_shard() {
    let whole = open(&fixture("gpt-oss/gptoss-tiny.gguf"));
    for k in 1..=3 {
        let path = fixture(&format!("gpt-oss/gptoss-tiny-split-0000{k}-of-00003.gguf"));
        let split = open(&path);
        assert_eq!(split.shard_paths().len(), 3);
        for (i, p) in split.shard_paths().iter().enumerate() {
            assert!(p.ends_with(format!("gptoss-tiny-split-0000{}-of-00003.gguf", i + 1)));
        }
        assert_same_tensors(&split, &whole);
        let shards: Vec<usize> = split.tensors().iter().map(|t| t.shard).collect();
        assert_eq!(shards.iter().filter(|&&s| s == 0).count(), 27);
        assert_eq!(shards.iter().filter(|&&s| s == 1).count(), 27);
        assert_eq!(shards.iter().filter(|&&s| s == 2).count(), 25);
        // The first shard's metadata is the whole file's plus the three split keys.
        let md = split.metadata();
        assert_eq!(md.len(), whole.metadata().len() + 3);
        for (k, v) in whole.metadata().iter() {
            assert_eq!(md.get(k), Some(v), "{k}");
        }
        assert_eq!(md.get("split.no"), Some(&MetaValue::U16(0)));
        assert_eq!(md.get("split.count"), Some(&MetaValue::U16(3)));
        assert_eq!(md.get("split.tensors.count"), Some(&MetaValue::I32(79)));
    }
}

#[test]
fn load_options_give_the_same_data() {
    let path = fixture("gpt-oss/gptoss-tiny-split-00001-of-00003.gguf");
    let mapped = open(&path);
    let read = GgufModel::open(
        &path,
        LoadOptions {
            use_mmap: false,
            ..LoadOptions::default()
        },
    )
    .unwrap();
    assert_same_tensors(&mapped, &read);
    let populated = GgufModel::open(
        &path,
        LoadOptions {
            populate: true,
            ..LoadOptions::default()
        },
    )
    .unwrap();
    assert_same_tensors(&mapped, &populated);
    for use_mmap in [true, false] {
        // mlock may be refused by RLIMIT_MEMLOCK; then the error must say so clearly.
        match GgufModel::open(
            &path,
            LoadOptions {
                use_mmap,
                mlock: true,
                populate: false,
            },
        ) {
            Ok(locked) => assert_same_tensors(&mapped, &locked),
            Err(e @ GgufError::Mlock { .. }) => {
                let msg = e.to_string();
                assert!(
                    msg.contains("mlock") && msg.contains("gptoss-tiny-split"),
                    "{msg}"
                );
            }
            Err(e) => panic!("unexpected error: {e}"),
        }
    }
}

#[test]
fn missing_shard_is_named() {
    let dir = scratch("missing-shard");
    for k in [1, 3] {
        let name = format!("gptoss-tiny-split-0000{k}-of-00003.gguf");
        std::fs::copy(fixture(&format!("gpt-oss/{name}")), dir.join(&name)).unwrap();
    }
    for k in [1, 3] {
        let path = dir.join(format!("gptoss-tiny-split-0000{k}-of-00003.gguf"));
        let err = GgufModel::open(&path, LoadOptions::default()).unwrap_err();
        let msg = err.to_string();
        assert!(
            matches!(
                err,
                GgufError::SplitShardMissing {
                    shard: 2,
                    count: 3,
                    ..
                }
            ),
            "{msg}"
        );
        assert!(
            msg.contains("gptoss-tiny-split-00002-of-00003.gguf"),
            "{msg}"
        );
        assert!(msg.contains("shard 2 of 3"), "{msg}");
    }
}

#[test]
fn misnamed_shards_are_rejected() {
    let dir = scratch("misnamed-shard");
    // Shard 2's file put where shard 3 should be: its split.no disagrees with its position.
    for (from, to) in [(1, 1), (2, 2), (2, 3)] {
        std::fs::copy(
            fixture(&format!(
                "gpt-oss/gptoss-tiny-split-0000{from}-of-00003.gguf"
            )),
            dir.join(format!("m-0000{to}-of-00003.gguf")),
        )
        .unwrap();
    }
    let err = GgufModel::open(dir.join("m-00001-of-00003.gguf"), LoadOptions::default())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("m-00003-of-00003.gguf") && err.contains("split.no"),
        "{err}"
    );
    let err = GgufModel::open(dir.join("m-00003-of-00003.gguf"), LoadOptions::default())
        .unwrap_err()
        .to_string();
    assert!(err.contains("split.no = 1"), "{err}");
    // A shard renamed so that it no longer has the split form cannot find its siblings.
    std::fs::copy(
        fixture("gpt-oss/gptoss-tiny-split-00001-of-00003.gguf"),
        dir.join("renamed.gguf"),
    )
    .unwrap();
    let err = GgufModel::open(dir.join("renamed.gguf"), LoadOptions::default())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("split.count = 3") && err.contains("file name"),
        "{err}"
    );
}

#[test]
fn io_errors_name_the_file() {
    let err = GgufModel::open("/nonexistent/dir/x.gguf", LoadOptions::default())
        .unwrap_err()
        .to_string();
    assert!(err.contains("/nonexistent/dir/x.gguf"), "{err}");
    let dir = scratch("io-errors");
    let small = dir.join("small.gguf");
    std::fs::write(&small, b"GGUF\x03\0\0\0").unwrap();
    let err = GgufModel::open(&small, LoadOptions::default())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("small.gguf") && err.contains("header"),
        "{err}"
    );
    let bad = dir.join("bad.gguf");
    let mut bytes = std::fs::read(fixture("gpt-oss/gptoss-tiny.gguf")).unwrap();
    bytes.truncate(bytes.len() - 1);
    std::fs::write(&bad, &bytes).unwrap();
    let err = GgufModel::open(&bad, LoadOptions::default())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("bad.gguf") && err.contains("blk.3.ffn_down_exps.bias"),
        "{err}"
    );
}

#[test]
fn o200k_vocab_opens_fast() {
    let path = fixture("tokenizer/ggml-vocab-o200k-harmony.gguf");
    let bytes = std::fs::read(&path).unwrap();
    let t0 = Instant::now();
    let m = open(&path);
    let elapsed = t0.elapsed();
    let md = m.metadata();
    assert_eq!(
        md.get_str_array("tokenizer.ggml.tokens").unwrap().len(),
        201088
    );
    assert_eq!(md.get_array("tokenizer.ggml.merges").unwrap().len(), 446189);
    assert_eq!(md.get_u32("tokenizer.ggml.bos_token_id"), Some(199998));
    assert_eq!(md.get_str("tokenizer.ggml.pre"), Some("gpt-4o"));
    assert_eq!(
        md.get_str_array("tokenizer.ggml.tokens").unwrap()[200006],
        "<|start|>"
    );
    eprintln!("o200k vocab ({} bytes) opened in {elapsed:?}", bytes.len());
    // Well under a second when optimised; generous bound for a loaded 2-core CI machine.
    assert!(elapsed.as_secs_f64() < 3.0, "took {elapsed:?}");
}

/// Resident bytes of this process's mappings of `path` (`/proc/self/smaps`).
fn mapped_rss(path: &Path) -> u64 {
    let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
    let name = path.to_str().unwrap();
    let mut ours = false;
    let mut kib = 0;
    for line in smaps.lines() {
        if let Some(rest) = line.strip_prefix("Rss:") {
            if ours {
                kib += rest
                    .trim()
                    .trim_end_matches("kB")
                    .trim()
                    .parse::<u64>()
                    .unwrap();
            }
        } else if line.split_whitespace().next().is_some_and(|range| {
            range.contains('-') && range.chars().all(|c| c == '-' || c.is_ascii_hexdigit())
        }) {
            // A mapping's header: its address range, …, its file.
            ours = line.ends_with(name);
        }
    }
    kib * 1024
}

/// A device that copied a tensor gives its pages back: the mapping's resident size drops by
/// the tensor's whole pages and its bytes read the same afterwards. Nothing to give back
/// from a file read into memory or locked.
#[test]
fn page_releaser_gives_back_a_mapped_tensors_pages() {
    if !Path::new("/proc/self/smaps").exists() {
        println!("SKIPPED: no /proc/self/smaps");
        return;
    }
    let path = scratch("release").join("model.gguf");
    std::fs::copy(fixture("gpt-oss/gptoss-tiny.gguf"), &path).unwrap();
    let opts = LoadOptions {
        populate: true,
        ..LoadOptions::default()
    };
    let m = GgufModel::open(&path, opts).unwrap();
    let info = m
        .tensors()
        .iter()
        .max_by_key(|t| t.n_bytes)
        .unwrap()
        .clone();
    let before_bytes = m.data_of(&info).to_vec();
    assert!(before_bytes.len() >= 3 * 4096, "{}", before_bytes.len());
    let before = mapped_rss(&path);
    let release = m.page_releaser(&info).expect("a mapped file");
    release(m.data_of(&info));
    let after = mapped_rss(&path);
    assert!(before >= after + 8192, "resident {before} -> {after}");
    assert_eq!(m.data_of(&info), &before_bytes[..]);
    // Outside the mapping: left alone.
    release(&before_bytes);
    assert_eq!(m.data_of(&info), &before_bytes[..]);
    for opts in [
        LoadOptions {
            use_mmap: false,
            ..LoadOptions::default()
        },
        LoadOptions {
            mlock: true,
            ..LoadOptions::default()
        },
    ] {
        if let Ok(m) = GgufModel::open(&path, opts) {
            assert!(m.page_releaser(&info).is_none(), "{opts:?}");
        }
    }
}
