//! The emulator harness of tests/emulated.rs: the kernels compiled for the host with clang++
//! around support/kernel_emulator.cpp, the raw little-endian files it reads and writes, and
//! the comparisons with REF0's results.

use std::path::PathBuf;
use std::process::Command;

use hmoe_quant::GgmlType;
use rand::rngs::StdRng;

use crate::common::random_weights;

/// A value written to or read from the emulator's files (raw little-endian arrays).
pub(crate) trait Raw: Copy {
    const SIZE: usize;
    fn put(self, out: &mut Vec<u8>);
    fn get(b: &[u8]) -> Self;
}

macro_rules! raw {
    ($($t:ty),*) => {$(
        impl Raw for $t {
            const SIZE: usize = std::mem::size_of::<$t>();
            fn put(self, out: &mut Vec<u8>) {
                out.extend_from_slice(&self.to_le_bytes());
            }
            fn get(b: &[u8]) -> Self {
                <$t>::from_le_bytes(b.try_into().unwrap())
            }
        }
    )*};
}
raw!(f32, i32, u16, u8);

/// The compiled emulator and its I/O directory.
pub(crate) struct Emulator {
    dir: PathBuf,
    exe: PathBuf,
}

impl Emulator {
    /// Builds the emulator in a temporary directory of its own (`test`: the test's name);
    /// `None` (skip) without a suitable clang++.
    pub(crate) fn build(test: &str) -> Option<Emulator> {
        let clang = std::env::var("HMOE_CLANGXX").unwrap_or_else(|_| "clang++".into());
        let dir = std::env::temp_dir().join(format!("hmoe-cuda-emu-{}-{test}", std::process::id()));
        std::fs::create_dir_all(dir.join("io")).unwrap();
        // The tensor-core wrappers of kernels/mma.cu are cut out (the harness defines them for
        // the host); the two PTX conversions become F16C calls.
        let source = hmoe_cuda::kernels::SOURCE;
        let (begin, end) = ("// BEGIN PTX WRAPPERS", "// END PTX WRAPPERS");
        let cut = source.find(begin).expect(begin)..source.find(end).expect(end) + end.len();
        let host = [&source[..cut.start], &source[cut.end..]]
            .concat()
            .replace(
                r#"asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));"#,
                "f = host_h2f(h);",
            )
            .replace(
                r#"asm("{ .reg .b16 t; cvt.rn.f16.f32 t, %1; cvt.u32.u16 %0, t; }" : "=r"(h) : "f"(f));"#,
                "h = host_f2h(f);",
            );
        assert!(
            !host.contains("asm(") && !host.contains("asm volatile"),
            "the kernels have inline PTX the emulator does not know"
        );
        std::fs::write(dir.join("k_host.cu"), host).unwrap();
        let harness = dir.join("kernel_emulator.cpp");
        std::fs::write(&harness, include_str!("kernel_emulator.cpp")).unwrap();
        let exe = dir.join("kernel_emulator");
        let flags = [
            "-std=c++20",
            "-O2",
            "-ffp-contract=off",
            "-mf16c",
            "-pthread",
            "-w",
        ];
        // Whether this clang++ builds what the harness needs (C++20 `<barrier>`, F16C): if not,
        // skip; if so, a harness or kernels that do not compile fail the test.
        let probe = dir.join("probe.cpp");
        let probe_src = "#include <barrier>\n#include <immintrin.h>\nint main() { std::barrier<> b(1); b.arrive_and_wait(); return (int)_cvtss_sh(1.0f, 0) - 0x3c00; }\n";
        std::fs::write(&probe, probe_src).unwrap();
        let probed = Command::new(&clang)
            .args(flags)
            .arg(&probe)
            .arg("-o")
            .arg(dir.join("probe"))
            .output();
        match probed {
            Ok(o) if o.status.success() => {}
            Ok(o) => {
                let why = String::from_utf8_lossy(&o.stderr);
                eprintln!("{clang} lacks C++20 <barrier> or F16C: skipped\n{why}");
                return None;
            }
            Err(e) => {
                eprintln!("{clang}: {e}: skipped");
                return None;
            }
        }
        let out = Command::new(&clang)
            .args(flags)
            .arg(&harness)
            .arg("-o")
            .arg(&exe)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "the kernels or the emulator do not compile for the host:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        Some(Emulator { dir, exe })
    }

    pub(crate) fn io(&self) -> PathBuf {
        self.dir.join("io")
    }

    pub(crate) fn write<T: Raw>(&self, name: &str, v: &[T]) {
        let mut b = Vec::with_capacity(v.len() * T::SIZE);
        v.iter().for_each(|&x| x.put(&mut b));
        std::fs::write(self.io().join(name), b).unwrap();
    }

    pub(crate) fn read<T: Raw>(&self, name: &str) -> Vec<T> {
        let b = std::fs::read(self.io().join(name)).unwrap();
        b.chunks_exact(T::SIZE).map(T::get).collect()
    }

    /// Runs `op` with `args`; a deadlock (a shuffle not every lane reaches) times out.
    pub(crate) fn run(&self, op: &str, args: &[String]) {
        let status = Command::new("timeout")
            .arg("900")
            .arg(&self.exe)
            .arg(op)
            .arg(self.io())
            .args(args)
            .status()
            .unwrap();
        assert!(status.success(), "emulated {op} {args:?}: {status}");
    }
}

impl Drop for Emulator {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

pub(crate) fn weights(rng: &mut StdRng, ty: GgmlType, rows: usize, cols: usize) -> Vec<u8> {
    random_weights(rng, ty, rows, cols)
}

/// Types whose products the kernels sum in the CPU device's order (every type but F16/BF16).
pub(crate) fn exact(ty: GgmlType) -> bool {
    !matches!(ty, GgmlType::F16 | GgmlType::BF16)
}

/// `(bit-identical values, max |difference|)`.
pub(crate) fn compare(got: &[f32], want: &[f32]) -> (usize, f32) {
    assert_eq!(got.len(), want.len());
    let same = got
        .iter()
        .zip(want)
        .filter(|(g, w)| g.to_bits() == w.to_bits())
        .count();
    let max = got
        .iter()
        .zip(want)
        .map(|(g, w)| (g - w).abs())
        .fold(0f32, f32::max);
    (same, max)
}

/// [`compare`], reported on stderr as `what`.
pub(crate) fn reported(what: &str, got: &[f32], want: &[f32]) -> (usize, f32) {
    let (same, max) = compare(got, want);
    eprintln!("{what}: {same}/{} identical, max |Δ| {max:e}", got.len());
    (same, max)
}

/// `got` must be `want` bit for bit (reported on stderr as `what`).
pub(crate) fn assert_bits(what: &str, got: &[f32], want: &[f32]) {
    let (same, _) = reported(what, got, want);
    assert_eq!(same, got.len(), "{what}");
}

pub(crate) fn s(v: impl ToString) -> String {
    v.to_string()
}
