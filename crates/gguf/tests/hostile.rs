//! Hostile input: truncations, crafted corrupt fields and random mutations must give errors
//! (with messages that name the problem), never a panic, a huge allocation or a hang.

mod common;

use std::collections::HashMap;
use std::time::Instant;

use common::fixture;
use hmoe_gguf::{GgufError, GgufHeader, GgufModel};

/// Runs `f` over `0..n` split across the available cores.
fn par_for(n: usize, f: impl Fn(usize) + Sync) {
    let threads = std::thread::available_parallelism()
        .map_or(1, |t| t.get())
        .min(8);
    std::thread::scope(|s| {
        for t in 0..threads {
            let f = &f;
            s.spawn(move || (t..n).step_by(threads).for_each(f));
        }
    });
}

/// End of the tensor table of a parsed file.
fn table_end(bytes: &[u8]) -> usize {
    GgufHeader::parse(bytes).unwrap().table_end as usize
}

/// Every prefix that ends inside the header (magic to padded end of the tensor table), plus
/// every 97th prefix after it and the prefixes on both sides of each tensor's data end.
/// Once the whole header is present the parser reads nothing more: a longer prefix differs
/// only in the final "does each tensor's data fit" comparison, so testing all ~440k of those
/// would take ~30 s on 2 cores and test nothing new; the boundary prefixes cover that check.
#[test]
fn every_header_prefix_of_gptoss_tiny_is_an_error() {
    let bytes = std::fs::read(fixture("gpt-oss/gptoss-tiny.gguf")).unwrap();
    let h = GgufHeader::parse(&bytes).unwrap();
    let mut lens: Vec<usize> = (0..=h.data_offset as usize).collect();
    lens.extend((h.data_offset as usize..bytes.len()).step_by(97));
    for t in &h.tensors {
        let end = (t.offset + t.n_bytes) as usize;
        lens.extend([t.offset as usize, end - 1]);
        if end < bytes.len() {
            lens.push(end);
        }
    }
    let t0 = Instant::now();
    par_for(lens.len(), |i| {
        let n = lens[i];
        if let Ok(h) = GgufHeader::parse(&bytes[..n]) {
            panic!("prefix of {n} bytes parsed: {} tensors", h.tensors.len());
        }
    });
    eprintln!("{} prefixes in {:?}", lens.len(), t0.elapsed());
}

#[test]
fn every_prefix_of_the_vocab_file_is_an_error() {
    // A vocab-only file: no tensors, so prefixes end inside metadata strings and arrays.
    let bytes = std::fs::read(fixture("tokenizer/vocab-1k.gguf")).unwrap();
    let end = table_end(&bytes);
    par_for(bytes.len(), |n| {
        let r = GgufHeader::parse(&bytes[..n]);
        // Without tensors, only the zero padding after the table may be cut off.
        assert_eq!(r.is_ok(), n >= end, "prefix {n}: {:?}", r.err());
    });
}

#[test]
fn truncation_errors_say_where() {
    let bytes = std::fs::read(fixture("gpt-oss/gptoss-tiny.gguf")).unwrap();
    let msg = |n: usize| GgufHeader::parse(&bytes[..n]).unwrap_err().to_string();
    assert!(msg(0).contains("magic"), "{}", msg(0));
    assert!(msg(6).contains("version at offset 4"), "{}", msg(6));
    assert!(
        msg(20).contains("metadata entry count at offset 16"),
        "{}",
        msg(20)
    );
    assert!(msg(1000).contains("metadata"), "{}", msg(1000));
    let m = msg(bytes.len() - 10);
    assert!(
        m.contains("blk.3.ffn_down_exps.bias") && m.contains("past the end"),
        "{m}"
    );
}

// ---------------------------------------------------------------------------------------------
// Crafted files

/// Writes GGUF bytes by hand and remembers where each labelled field starts.
#[derive(Default)]
struct Raw {
    b: Vec<u8>,
    at: HashMap<String, usize>,
}

impl Raw {
    fn mark(&mut self, label: &str) -> &mut Self {
        self.at.insert(label.to_string(), self.b.len());
        self
    }
    fn u32(&mut self, v: u32) -> &mut Self {
        self.b.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn u64(&mut self, v: u64) -> &mut Self {
        self.b.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn str(&mut self, s: &str) -> &mut Self {
        self.u64(s.len() as u64);
        self.b.extend_from_slice(s.as_bytes());
        self
    }
    fn key(&mut self, label: &str, key: &str, ty: u32) -> &mut Self {
        self.mark(&format!("{label}.keylen")).str(key);
        self.mark(&format!("{label}.type")).u32(ty)
    }
    fn tensor(&mut self, label: &str, name: &str, dims: &[u64], ty: u32, off: u64) -> &mut Self {
        self.mark(label).str(name);
        self.mark(&format!("{label}.ndims")).u32(dims.len() as u32);
        for (i, d) in dims.iter().enumerate() {
            self.mark(&format!("{label}.dim{i}")).u64(*d);
        }
        self.mark(&format!("{label}.type")).u32(ty);
        self.mark(&format!("{label}.offset")).u64(off)
    }
    fn pad(&mut self, alignment: usize) -> &mut Self {
        while !self.b.len().is_multiple_of(alignment) {
            self.b.push(0);
        }
        self
    }
    fn pos(&self, label: &str) -> usize {
        self.at[label]
    }
}

/// A small valid file with one value of each kind that has a length or count, and 2 tensors.
fn base() -> Raw {
    let mut r = Raw::default();
    r.b.extend_from_slice(b"GGUF");
    r.mark("version").u32(3);
    r.mark("n_tensors").u64(2);
    r.mark("n_kv").u64(7);
    r.key("arch", "general.architecture", 8);
    r.mark("arch.len").str("gpt-oss");
    r.key("align", "general.alignment", 4);
    r.mark("align.value").u32(32);
    r.key("ints", "t.ints", 9).mark("ints.elemtype").u32(4);
    r.mark("ints.count").u64(3).u32(1).u32(2).u32(3);
    r.key("strs", "t.strs", 9).u32(8);
    r.mark("strs.count").u64(2).str("a");
    r.mark("strs.1.len").str("bc");
    r.key("nested", "t.nested", 9).u32(9).u64(2);
    r.u32(0).mark("nested.0.count").u64(1).b.push(7);
    r.u32(8).u64(1).str("x");
    r.key("flag", "t.flag", 7).mark("flag.value").b.push(1);
    r.key("f", "t.f", 6).u32(1.5f32.to_bits());
    // Tensor 0: f32 [4, 2] at 0 (32 bytes); tensor 1: q8_0 [32] at 32 (34 bytes).
    r.tensor("t0", "w0", &[4, 2], 0, 0);
    r.tensor("t1", "w1", &[32], 8, 32);
    r.pad(32);
    r.mark("data");
    r.b.extend((0..66u8).map(|i| i.wrapping_mul(7)));
    r.pad(32);
    r
}

fn expect_err(bytes: &[u8], fragments: &[&str]) -> GgufError {
    let err = match GgufHeader::parse(bytes) {
        Ok(_) => panic!("expected an error mentioning {fragments:?}"),
        Err(e) => e,
    };
    let msg = err.to_string();
    for f in fragments {
        assert!(msg.contains(f), "error {msg:?} does not mention {f:?}");
    }
    // The same bytes through the model API give the same error.
    let model_err = GgufModel::from_bytes(bytes.to_vec())
        .unwrap_err()
        .to_string();
    assert_eq!(model_err, msg);
    err
}

fn patched(label: &str, value: &[u8]) -> Vec<u8> {
    let r = base();
    let mut b = r.b.clone();
    let p = r.pos(label);
    b[p..p + value.len()].copy_from_slice(value);
    b
}

fn p64(label: &str, v: u64) -> Vec<u8> {
    patched(label, &v.to_le_bytes())
}

fn p32(label: &str, v: u32) -> Vec<u8> {
    patched(label, &v.to_le_bytes())
}

#[test]
fn crafted_base_file_is_valid() {
    let r = base();
    let h = GgufHeader::parse(&r.b).unwrap();
    assert_eq!(h.tensors.len(), 2);
    assert_eq!(h.metadata.len(), 7);
    assert_eq!(h.data_offset as usize, r.pos("data"));
    assert_eq!(h.metadata.get_str_array("t.strs"), Some(vec!["a", "bc"]));
    assert_eq!(h.tensors[1].offset as usize, r.pos("data") + 32);
    assert_eq!(h.tensors[1].n_bytes, 34);
}

#[test]
fn corrupt_counts_and_lengths_are_rejected_before_allocating() {
    expect_err(
        &p64("n_kv", 1 << 62),
        &["metadata entry count = 4611686018427387904", "offset 16"],
    );
    expect_err(
        &p64("n_tensors", 1 << 40),
        &["tensor count = 1099511627776", "offset 8"],
    );
    expect_err(
        &p64("n_tensors", 40),
        &["tensor count = 40", "at least 32 bytes"],
    );
    expect_err(
        &p64("arch.keylen", 1 << 60),
        &["metadata key #0", "string length 1152921504606846976"],
    );
    expect_err(
        &p64("arch.len", 1 << 60),
        &["'general.architecture'", "string length"],
    );
    expect_err(
        &p64("arch.len", u64::MAX),
        &["'general.architecture'", "string length"],
    );
    expect_err(
        &p64("ints.count", 1 << 62),
        &["array count of metadata 't.ints'", "4611686018427387904"],
    );
    expect_err(
        &p64("ints.count", 1 << 30),
        &["array count of metadata 't.ints'", "at least 4 bytes"],
    );
    expect_err(
        &p64("strs.count", u64::MAX),
        &["array count of metadata 't.strs'"],
    );
    expect_err(
        &p64("strs.1.len", 1 << 60),
        &["metadata 't.strs'[1]", "string length"],
    );
    expect_err(
        &p64("nested.0.count", 1 << 62),
        &["array count of metadata 't.nested'"],
    );
    expect_err(&p64("t0", 1 << 60), &["name of tensor #0", "string length"]);
}

#[test]
fn corrupt_types_and_values_are_rejected() {
    expect_err(
        &p32("arch.type", 99),
        &["'general.architecture'", "unknown value type id 99"],
    );
    expect_err(
        &p32("ints.elemtype", 13),
        &["'t.ints'", "unknown value type id 13"],
    );
    expect_err(
        &patched("flag.value", &[2]),
        &["'t.flag'", "bool value 2", "neither 0 nor 1"],
    );
    expect_err(
        &patched("arch.keylen", &[20, 0, 0, 0, 0, 0, 0, 0, 0xff]),
        &["metadata key #0", "UTF-8"],
    );
    // A duplicate key: rename t.flag's key to t.ints' key.
    let r = base();
    let mut b = r.b.clone();
    let p = r.pos("flag.keylen") + 8;
    b[p..p + 6].copy_from_slice(b"t.int!");
    assert!(GgufHeader::parse(&b).is_ok());
    let p = r.pos("ints.keylen") + 8;
    b[p..p + 6].copy_from_slice(b"t.int!");
    expect_err(&b, &["duplicate metadata key 't.int!'"]);
}

#[test]
fn corrupt_alignment_is_rejected() {
    expect_err(
        &p32("align.value", 3),
        &["invalid general.alignment 3", "power of two"],
    );
    expect_err(&p32("align.value", 0), &["invalid general.alignment 0"]);
    expect_err(&p32("align.type", 6), &["invalid general.alignment F32"]);
    // Any integer type holding a valid value is accepted (the spec says u32).
    assert!(GgufHeader::parse(&p32("align.type", 5)).is_ok());
    let mut b = p32("align.type", 8);
    b.truncate(base().pos("ints.keylen"));
    expect_err(&b, &[]);
    // A valid but larger alignment moves the data section: the tensors then run past the end.
    expect_err(&p32("align.value", 1 << 16), &["past the end"]);
}

#[test]
fn corrupt_tensor_infos_are_rejected() {
    expect_err(
        &p32("t1.ndims", 5),
        &["tensor 'w1'", "5 dimensions", "must be 1 to 4"],
    );
    expect_err(&p32("t0.ndims", 0), &["tensor 'w0'", "0 dimensions"]);
    expect_err(
        &p32("t0.ndims", u32::MAX),
        &["tensor 'w0'", "4294967295 dimensions"],
    );
    expect_err(&p64("t0.dim1", 0), &["tensor 'w0'", "dims[1] is 0"]);
    expect_err(&p64("t0.dim0", 1 << 40), &["tensor 'w0'", "past the end"]);
    expect_err(
        &p64("t0.dim1", u64::MAX),
        &["tensor 'w0'", "element count", "overflows"],
    );
    expect_err(
        &p64("t1.dim0", 48),
        &["tensor 'w1'", "dims[0] = 48", "Q8_0 block size 32"],
    );
    expect_err(
        &p32("t1.type", 99),
        &["tensor 'w1'", "unknown ggml type id 99"],
    );
    expect_err(
        &p32("t1.type", 4),
        &["tensor 'w1'", "unknown ggml type id 4"],
    );
    expect_err(
        &p64("t1.offset", 33),
        &["tensor 'w1'", "data offset 33", "alignment 32"],
    );
    expect_err(&p64("t1.offset", 64), &["tensor 'w1'", "past the end"]);
    expect_err(
        &p64("t1.offset", u64::MAX - 31),
        &["tensor 'w1'", "past the end"],
    );
    // Same name twice.
    let r = base();
    let mut b = r.b.clone();
    let p = r.pos("t1") + 8;
    b[p..p + 2].copy_from_slice(b"w0");
    expect_err(&b, &["duplicate tensor name 'w0'"]);
}

#[test]
fn bad_magic_and_versions_are_rejected() {
    expect_err(
        &patched("version", b"\0\0\0\0"),
        &["unsupported GGUF version 0"],
    );
    expect_err(&p32("version", 1), &["version 1", "v1"]);
    expect_err(&p32("version", 4), &["version 4", "2 and 3"]);
    expect_err(&p32("version", 3u32.swap_bytes()), &["big-endian"]);
    let mut b = base().b;
    b[0] = b'X';
    expect_err(&b, &["not a GGUF file"]);
    assert!(
        GgufHeader::parse(&p32("version", 2)).is_ok(),
        "v2 is accepted"
    );
}

#[test]
fn deep_nesting_is_rejected() {
    let build = |depth: usize| {
        let mut r = Raw::default();
        r.b.extend_from_slice(b"GGUF");
        r.u32(3).u64(0).u64(1);
        r.key("deep", "t.deep", 9);
        for _ in 1..depth {
            r.u32(9).u64(1);
        }
        r.u32(4).u64(1).u32(42);
        r.b
    };
    let ok = GgufHeader::parse(&build(hmoe_gguf::MAX_ARRAY_DEPTH)).unwrap();
    assert!(ok.metadata.get_array("t.deep").is_some());
    expect_err(
        &build(hmoe_gguf::MAX_ARRAY_DEPTH + 1),
        &["'t.deep'", "nested deeper than 8"],
    );
    // Far deeper than the limit: still an error, not a stack overflow.
    expect_err(&build(100_000), &["nested deeper"]);
}

// ---------------------------------------------------------------------------------------------
// Random mutations

/// xorshift64*: a small deterministic generator for the mutation test.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// Mutates the header region (magic to end of tensor table) with random bytes, bit flips and
/// interesting 8-byte words; every result must parse to Ok (with in-bounds tensors) or Err.
fn mutate_header(file: &str, iterations: usize, seed: u64) {
    let original = std::fs::read(fixture(file)).unwrap();
    let header_end = table_end(&original);
    let interesting = [
        0,
        1,
        0x7f,
        0x80,
        0xff,
        0xffff,
        1 << 31,
        1 << 32,
        1 << 40,
        1 << 62,
        u64::MAX,
    ];
    let mut rng = Rng(seed);
    let mut buf = original.clone();
    let (mut ok, mut err) = (0, 0);
    let t0 = Instant::now();
    for _ in 0..iterations {
        let mut touched = Vec::new();
        for _ in 0..1 + rng.below(4) {
            let p = rng.below(header_end);
            match rng.below(4) {
                0 => buf[p] = rng.next() as u8,
                1 => buf[p] ^= 1 << rng.below(8),
                _ => {
                    let p = p.min(header_end - 8);
                    let v: u64 = interesting[rng.below(interesting.len())];
                    let v = if rng.below(2) == 0 {
                        v
                    } else {
                        v.wrapping_add(rng.below(3) as u64).wrapping_sub(1)
                    };
                    buf[p..p + 8].copy_from_slice(&v.to_le_bytes());
                    touched.extend(p..p + 8);
                }
            }
            touched.push(p);
        }
        match GgufHeader::parse(&buf) {
            Ok(h) => {
                ok += 1;
                for t in &h.tensors {
                    assert!(t.offset + t.n_bytes <= buf.len() as u64, "{}", t.name);
                }
            }
            Err(e) => {
                err += 1;
                assert!(!e.to_string().is_empty());
            }
        }
        for p in touched {
            buf[p] = original[p];
        }
    }
    assert_eq!(buf, original);
    eprintln!(
        "{file}: {iterations} mutations ({ok} ok, {err} errors) in {:?}",
        t0.elapsed()
    );
}

#[test]
fn random_header_mutations_never_panic() {
    mutate_header("gpt-oss/gptoss-tiny.gguf", 4000, 0x9e37_79b9_7f4a_7c15);
    mutate_header("tokenizer/vocab-1k.gguf", 2000, 12345);
}

#[test]
fn metadata_element_limit() {
    // One u8 array with one element more than the limit: rejected before allocating values.
    let n = hmoe_gguf::MAX_META_ELEMENTS + 1;
    let mut r = Raw::default();
    r.b.extend_from_slice(b"GGUF");
    r.u32(3).u64(0).u64(1);
    r.key("big", "t.big", 9).u32(0).u64(n);
    r.b.resize(r.b.len() + n as usize, 0);
    expect_err(&r.b, &["'t.big'", "more than 67108864 elements"]);
}
