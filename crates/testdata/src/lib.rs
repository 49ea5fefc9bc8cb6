//! Where the tests find their fixtures: llama.cpp's reference outputs (goldens), the small
//! synthetic models they were computed on, tokenizer vocabularies and cases, chat templates and a
//! corpus.
//!
//! The fixtures travel with the repository as `fixtures/*.tar.xz` (about 36 MB packed, 92 MB
//! unpacked; `scripts/pack-fixtures.sh` makes them) plus a few plain files beside them. The first
//! test that asks unpacks them once into the build directory (`target/<profile>/hmoe-fixtures/`,
//! named by the archives' contents, so a changed archive unpacks afresh); every later call, in
//! any test process, reuses that folder. `$HMOE_FIXTURES` names another folder of the same layout
//! instead (a checkout of the data being regenerated, say).
//!
//! Only tests use this crate (a dev-dependency everywhere); it panics with a message that says
//! what is missing, because a test without its data cannot mean anything.

use std::fs;
use std::io::{self, BufReader};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// The repository's packed fixtures folder.
const PACKED: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../fixtures");

/// The fixtures folder: `$HMOE_FIXTURES` when set, else the repository's archives unpacked into
/// the build directory (done once; see the crate docs).
///
/// # Panics
/// When `$HMOE_FIXTURES` is unset and the archives cannot be read or unpacked.
pub fn fixtures() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| match std::env::var_os("HMOE_FIXTURES") {
        Some(dir) => PathBuf::from(dir),
        None => unpacked(Path::new(PACKED), &build_dir()).unwrap_or_else(|e| {
            panic!("cannot unpack the fixtures in {PACKED}: {e} (or set HMOE_FIXTURES)")
        }),
    })
    .clone()
}

/// A file or folder inside the fixtures folder (`rel` such as `gpt-oss/gptoss-tiny.gguf`).
pub fn fixture(rel: &str) -> PathBuf {
    fixtures().join(rel)
}

/// The build directory of the running test (`target/<profile>`: test executables live in its
/// `deps/`), else the system's temporary folder.
fn build_dir() -> PathBuf {
    std::env::current_exe()
        .ok()
        .and_then(|exe| Some(exe.parent()?.parent()?.to_path_buf()))
        .unwrap_or_else(std::env::temp_dir)
}

/// The archives (`*.tar.xz`) and plain files of `packed`, sorted by name.
fn packed_files(packed: &Path) -> io::Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    for entry in fs::read_dir(packed)? {
        let path = entry?.path();
        if path.is_file() {
            files.push(path);
        }
    }
    files.sort();
    Ok(files)
}

/// FNV-1a over the names and bytes of `files`: names the unpacked folder, so that a changed
/// archive is unpacked afresh.
fn stamp(files: &[PathBuf]) -> io::Result<u64> {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |bytes: &[u8]| {
        for &b in bytes {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    };
    for f in files {
        eat(f.file_name().map_or(&[][..], |n| n.as_encoded_bytes()));
        eat(&fs::read(f)?);
    }
    Ok(h)
}

/// Unpacks `packed` into `<build>/hmoe-fixtures/<stamp>` unless that folder exists, and returns
/// it. Safe against other test processes doing the same at once: each unpacks into a folder of
/// its own and renames it into place; the loser of the rename deletes its copy.
fn unpacked(packed: &Path, build: &Path) -> io::Result<PathBuf> {
    let files = packed_files(packed)?;
    if !files.iter().any(|f| is_archive(f)) {
        return Err(io::Error::new(
            io::ErrorKind::NotFound,
            "no *.tar.xz archive there",
        ));
    }
    let root = build.join("hmoe-fixtures");
    let dest = root.join(format!("{:016x}", stamp(&files)?));
    if dest.is_dir() {
        return Ok(dest);
    }
    let tmp = root.join(format!("tmp-{}", std::process::id()));
    let _ = fs::remove_dir_all(&tmp);
    fs::create_dir_all(&tmp)?;
    for f in &files {
        if is_archive(f) {
            unpack_archive(f, &tmp)?;
        } else if let Some(name) = f.file_name() {
            fs::copy(f, tmp.join(name))?;
        }
    }
    if fs::rename(&tmp, &dest).is_err() {
        // Another process got there first (its folder is complete: it was renamed whole).
        let _ = fs::remove_dir_all(&tmp);
        if !dest.is_dir() {
            return Err(io::Error::other(format!(
                "could not move the unpacked fixtures to {}",
                dest.display()
            )));
        }
    }
    Ok(dest)
}

/// Whether `path` is one of the packed archives.
fn is_archive(path: &Path) -> bool {
    path.to_string_lossy().ends_with(".tar.xz")
}

/// Unpacks one `.tar.xz` archive into `into`.
fn unpack_archive(archive: &Path, into: &Path) -> io::Result<()> {
    let mut input = BufReader::new(fs::File::open(archive)?);
    let mut tar_bytes = Vec::new();
    lzma_rs::xz_decompress(&mut input, &mut tar_bytes)
        .map_err(|e| io::Error::other(format!("{}: {e}", archive.display())))?;
    tar::Archive::new(&tar_bytes[..]).unpack(into)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_packed_fixtures_unpack_once_and_hold_the_models() {
        let build = std::env::temp_dir().join(format!("testdata-unpack-{}", std::process::id()));
        let _ = fs::remove_dir_all(&build);
        let a = unpacked(Path::new(PACKED), &build).unwrap();
        assert!(a.join("gpt-oss/gptoss-tiny.gguf").is_file());
        assert!(a.join("prompts-synthetic.json").is_file());
        let modified = fs::metadata(&a).unwrap().modified().unwrap();
        let b = unpacked(Path::new(PACKED), &build).unwrap();
        assert_eq!(a, b);
        assert_eq!(fs::metadata(&b).unwrap().modified().unwrap(), modified);
        fs::remove_dir_all(&build).unwrap();
    }

    #[test]
    fn a_folder_without_archives_is_an_error() {
        let empty = std::env::temp_dir().join(format!("testdata-empty-{}", std::process::id()));
        fs::create_dir_all(&empty).unwrap();
        assert!(unpacked(&empty, &empty).is_err());
        fs::remove_dir_all(&empty).unwrap();
    }

    /// Every file of `dir` below it, as relative paths, sorted.
    fn tree(dir: &Path) -> Vec<PathBuf> {
        let mut out = Vec::new();
        let mut stack = vec![dir.to_path_buf()];
        while let Some(d) = stack.pop() {
            for e in fs::read_dir(&d).unwrap() {
                let p = e.unwrap().path();
                if p.is_dir() {
                    stack.push(p);
                } else {
                    out.push(p.strip_prefix(dir).unwrap().to_path_buf());
                }
            }
        }
        out.sort();
        out
    }

    /// Where the team's fixtures are generated (`shared/fixtures` beside the repository), the
    /// packed copy must hold the same files, byte for byte: `scripts/pack-fixtures.sh` repacks.
    #[test]
    fn the_packed_fixtures_equal_the_shared_ones_where_those_exist() {
        let shared = Path::new(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../../shared/fixtures"
        ));
        if !shared.is_dir() {
            println!("SKIPPED: no shared/fixtures beside the repository to compare with");
            return;
        }
        let ours = unpacked(Path::new(PACKED), &build_dir()).unwrap();
        let (a, b) = (tree(shared), tree(&ours));
        assert_eq!(
            a,
            b,
            "the packed fixtures differ from {}: run scripts/pack-fixtures.sh",
            shared.display()
        );
        for rel in &a {
            assert!(
                fs::read(shared.join(rel)).unwrap() == fs::read(ours.join(rel)).unwrap(),
                "{} differs: run scripts/pack-fixtures.sh",
                rel.display()
            );
        }
    }
}
