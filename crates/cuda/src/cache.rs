//! On-disk cache of the PTX NVRTC makes from the kernel source.
//!
//! A file `<dir>/<key>.ptx` where the key hashes everything the PTX depends on: the kernel
//! source, the target architecture, the NVRTC version and the compile options. The directory
//! is `$HMOE_CUDA_CACHE` if set (`off` or empty disables the cache), else
//! `$XDG_CACHE_HOME/hmoe/cuda`, else `$HOME/.cache/hmoe/cuda`. A cache that cannot be read or
//! written only costs a recompile.

use std::path::{Path, PathBuf};

/// 64-bit FNV-1a over `parts`, each followed by a 0xff separator (which no UTF-8 text holds,
/// so `["ab", "c"]` and `["a", "bc"]` differ).
fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for part in parts {
        for &b in part.iter().chain(std::iter::once(&0xffu8)) {
            h ^= b as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}

/// The cache key (16 hex digits) of PTX compiled from `source` for `arch` (e.g.
/// `compute_90`) by NVRTC `nvrtc_version` (major, minor) with `options`.
pub fn cache_key(
    source: &str,
    arch: &str,
    nvrtc_version: (i32, i32),
    options: &[String],
) -> String {
    let version = format!("{}.{}", nvrtc_version.0, nvrtc_version.1);
    let opts = options.join("\u{1}");
    let h = fnv1a(&[
        source.as_bytes(),
        arch.as_bytes(),
        version.as_bytes(),
        opts.as_bytes(),
    ]);
    format!("{h:016x}")
}

/// The cache directory for the given environment lookup (see the module docs); `None`
/// disables caching.
pub fn cache_dir_from(env: impl Fn(&str) -> Option<String>) -> Option<PathBuf> {
    if let Some(dir) = env("HMOE_CUDA_CACHE") {
        return match dir.as_str() {
            "" | "off" | "0" => None,
            _ => Some(PathBuf::from(dir)),
        };
    }
    let nonempty = |k: &str| env(k).filter(|v| !v.is_empty());
    if let Some(xdg) = nonempty("XDG_CACHE_HOME") {
        return Some(Path::new(&xdg).join("hmoe").join("cuda"));
    }
    nonempty("HOME").map(|home| Path::new(&home).join(".cache").join("hmoe").join("cuda"))
}

/// The cache directory of this process's environment.
pub fn cache_dir() -> Option<PathBuf> {
    cache_dir_from(|k| std::env::var(k).ok())
}

/// The cached PTX for `key` in `dir`, if present and plausible (PTX text with a `.version`
/// directive and an entry point, and no NUL byte: the driver takes it as a C string).
pub fn load(dir: &Path, key: &str) -> Option<String> {
    let text = std::fs::read_to_string(dir.join(format!("{key}.ptx"))).ok()?;
    (text.contains(".version") && text.contains(".entry") && !text.contains('\0')).then_some(text)
}

/// Stores `ptx` under `key` in `dir` (created if missing), atomically: a temporary file
/// renamed into place, so a concurrent reader sees the old file or the whole new one.
pub fn store(dir: &Path, key: &str, ptx: &str) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let tmp = dir.join(format!("{key}.ptx.tmp{}", std::process::id()));
    std::fs::write(&tmp, ptx)?;
    std::fs::rename(&tmp, dir.join(format!("{key}.ptx"))).inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |k| {
            vars.iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        }
    }

    #[test]
    fn key_depends_on_every_input() {
        let opts = vec!["--fmad=false".to_string()];
        let k = cache_key("src", "compute_90", (13, 0), &opts);
        assert_eq!(k.len(), 16);
        assert!(k.chars().all(|c| c.is_ascii_hexdigit()));
        assert_eq!(k, cache_key("src", "compute_90", (13, 0), &opts), "stable");
        let others = [
            cache_key("src2", "compute_90", (13, 0), &opts),
            cache_key("src", "compute_80", (13, 0), &opts),
            cache_key("src", "compute_90", (13, 1), &opts),
            cache_key("src", "compute_90", (12, 0), &opts),
            cache_key("src", "compute_90", (13, 0), &[]),
            // Moving a byte between fields changes the key.
            cache_key("srcc", "ompute_90", (13, 0), &opts),
        ];
        for o in &others {
            assert_ne!(&k, o);
        }
    }

    #[test]
    fn fnv1a_matches_the_published_vectors() {
        // FNV-1a 64 of "a" is af63dc4c8601ec8c; our separator byte follows each part.
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        h ^= b'a' as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
        assert_eq!(h, 0xaf63_dc4c_8601_ec8c);
        h ^= 0xff;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
        assert_eq!(fnv1a(&[b"a"]), h);
    }

    #[test]
    fn directory_resolution() {
        assert_eq!(
            cache_dir_from(env(&[("HMOE_CUDA_CACHE", "/c"), ("HOME", "/h")])),
            Some(PathBuf::from("/c"))
        );
        assert_eq!(
            cache_dir_from(env(&[("HMOE_CUDA_CACHE", "off"), ("HOME", "/h")])),
            None
        );
        assert_eq!(cache_dir_from(env(&[("HMOE_CUDA_CACHE", "")])), None);
        assert_eq!(
            cache_dir_from(env(&[("XDG_CACHE_HOME", "/x"), ("HOME", "/h")])),
            Some(PathBuf::from("/x/hmoe/cuda"))
        );
        assert_eq!(
            cache_dir_from(env(&[("XDG_CACHE_HOME", ""), ("HOME", "/h")])),
            Some(PathBuf::from("/h/.cache/hmoe/cuda"))
        );
        assert_eq!(cache_dir_from(env(&[])), None);
    }

    #[test]
    fn store_then_load_round_trips() {
        let dir = std::env::temp_dir().join(format!("hmoe-cuda-cache-test-{}", std::process::id()));
        let ptx = "//\n.version 8.0\n.target sm_90\n.visible .entry k()\n{\n}\n";
        assert_eq!(load(&dir, "0123"), None, "missing");
        store(&dir, "0123", ptx).unwrap();
        assert_eq!(load(&dir, "0123").as_deref(), Some(ptx));
        store(&dir, "0123", ptx).unwrap();
        assert_eq!(load(&dir, "0123").as_deref(), Some(ptx), "overwrite");
        std::fs::write(dir.join("bad.ptx"), "garbage").unwrap();
        assert_eq!(load(&dir, "bad"), None, "implausible files are ignored");
        std::fs::write(dir.join("nul.ptx"), format!("{ptx}\0")).unwrap();
        assert_eq!(
            load(&dir, "nul"),
            None,
            "a NUL byte would not pass to the driver"
        );
        let leftovers = std::fs::read_dir(&dir)
            .unwrap()
            .filter(|e| {
                e.as_ref()
                    .unwrap()
                    .file_name()
                    .to_string_lossy()
                    .contains(".tmp")
            })
            .count();
        assert_eq!(leftovers, 0);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
