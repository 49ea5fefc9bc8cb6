//! Which files of a models directory are models, and their names: `NAME.gguf` files, split
//! sets (`NAME-00001-of-00003.gguf`), one-model sub-directories, and the repositories of a
//! Hugging Face hub cache (llama.cpp's `$LLAMA_CACHE`, `~/.cache/huggingface/hub`), whose GGUFs
//! are named `OWNER/NAME:QUANT` as llama-server names them (`ggml-org/tinygemma3-GGUF:Q8_0`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The folder name prefix of a hub cache repository (`models--OWNER--NAME`).
const HF_REPO_PREFIX: &str = "models--";

/// Deepest folder level looked at inside a cached snapshot.
const MAX_SNAPSHOT_DEPTH: usize = 4;

/// Most entries looked at in one cached snapshot.
const MAX_SNAPSHOT_ENTRIES: usize = 4096;

/// GGUFs that go with a model rather than being one (projectors, draft heads), by a word in
/// their path, as llama-server skips them.
const SIDECARS: &[&str] = &["mmproj", "mtp-", "eagle3-", "dflash-", "dspark-"];

/// A model's name from its file: the file name without `.gguf` and without a split suffix
/// (`-00001-of-00003`).
pub fn model_name(path: &Path) -> String {
    let file = path
        .file_name()
        .map(|f| f.to_string_lossy().into_owned())
        .unwrap_or_default();
    let stem = strip_suffix_ci(&file, ".gguf").unwrap_or(&file);
    match split_suffix(stem) {
        Some((prefix, _, _)) => prefix.to_string(),
        None => stem.to_string(),
    }
}

pub(crate) fn strip_suffix_ci<'a>(s: &'a str, suffix: &str) -> Option<&'a str> {
    let n = s.len().checked_sub(suffix.len())?;
    (s.is_char_boundary(n) && s[n..].eq_ignore_ascii_case(suffix)).then(|| &s[..n])
}

/// `NAME-00001-of-00003` → (NAME, 1, 3).
fn split_suffix(stem: &str) -> Option<(&str, u32, u32)> {
    let (rest, count) = stem.rsplit_once("-of-")?;
    let (prefix, no) = rest.rsplit_once('-')?;
    let digits = |s: &str| s.len() == 5 && s.bytes().all(|b| b.is_ascii_digit());
    if !digits(no) || !digits(count) {
        return None;
    }
    Some((prefix, no.parse().ok()?, count.parse().ok()?))
}

fn is_gguf(path: &Path) -> bool {
    let name = path
        .file_name()
        .map(|f| f.to_string_lossy().into_owned())
        .unwrap_or_default();
    strip_suffix_ci(&name, ".gguf").is_some() && !name.to_ascii_lowercase().starts_with("mmproj")
}

/// The models of a directory: `*.gguf` files (a split set counts once, by its first shard),
/// sub-directories holding one model (named after the sub-directory) and Hugging Face hub
/// cache repositories (`models--OWNER--NAME`, see [`hf_cache_models`]). Only regular files (or
/// links to them) count: a FIFO or a device named `*.gguf` would block whoever opens it.
pub fn scan_models_dir(dir: &Path) -> std::io::Result<BTreeMap<String, PathBuf>> {
    let mut out = BTreeMap::new();
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .collect();
    entries.sort();
    for path in entries {
        if is_hf_cache_repo(&path) {
            hf_cache_models(&path, &mut out);
        } else if path.is_dir() {
            let Ok(inner) = std::fs::read_dir(&path) else {
                continue;
            };
            let mut files: Vec<PathBuf> = inner
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.is_file() && is_gguf(p))
                .collect();
            files.sort();
            let firsts: Vec<&PathBuf> = files.iter().filter(|p| first_shard_or_whole(p)).collect();
            if let ([only], Some(name)) = (firsts.as_slice(), path.file_name()) {
                out.entry(name.to_string_lossy().into_owned())
                    .or_insert_with(|| (*only).clone());
            }
        } else if path.is_file() && is_gguf(&path) && first_shard_or_whole(&path) {
            out.entry(model_name(&path)).or_insert(path);
        }
    }
    Ok(out)
}

fn first_shard_or_whole(path: &Path) -> bool {
    let file = path
        .file_name()
        .map(|f| f.to_string_lossy().into_owned())
        .unwrap_or_default();
    let stem = strip_suffix_ci(&file, ".gguf").unwrap_or(&file);
    split_suffix(stem).is_none_or(|(_, no, _)| no == 1)
}

/// Whether `path` is a hub cache repository folder: `models--…` with a `snapshots` folder.
fn is_hf_cache_repo(path: &Path) -> bool {
    path.file_name()
        .is_some_and(|n| n.to_string_lossy().starts_with(HF_REPO_PREFIX))
        && path.join("snapshots").is_dir()
}

/// The repository id of a hub cache folder (`models--ggml-org--tinygemma3-GGUF` →
/// `ggml-org/tinygemma3-GGUF`), when it is a valid one.
fn hf_repo_of_folder(folder: &str) -> Option<String> {
    let id = folder.strip_prefix(HF_REPO_PREFIX)?.replace("--", "/");
    valid_repo_id(&id).then_some(id)
}

/// A Hugging Face repository id as llama.cpp accepts one: `OWNER/NAME`, at most 256
/// characters of `A-Za-z0-9_`, with `/`, `.` and `-` only between two of those.
fn valid_repo_id(id: &str) -> bool {
    if id.is_empty() || id.len() > 256 {
        return false;
    }
    let mut slashes = 0;
    let mut after_special = true;
    for c in id.chars() {
        if c.is_ascii_alphanumeric() || c == '_' {
            after_special = false;
        } else if matches!(c, '/' | '.' | '-') {
            if after_special {
                return false;
            }
            slashes += usize::from(c == '/');
            after_special = true;
        } else {
            return false;
        }
    }
    !after_special && slashes == 1
}

/// The snapshot a cached repository's refs point at: `refs/main`, else the first ref (by name)
/// holding a commit hash (40 hexadecimal digits).
fn cached_commit(repo: &Path) -> Option<String> {
    let mut refs: Vec<PathBuf> = std::fs::read_dir(repo.join("refs"))
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file())
        .collect();
    refs.sort_by_key(|p| {
        (
            p.file_name() != Some(std::ffi::OsStr::new("main")),
            p.clone(),
        )
    });
    refs.iter().find_map(|r| {
        let text = std::fs::read_to_string(r).ok()?;
        let commit = text.lines().next()?.trim();
        (commit.len() == 40 && commit.bytes().all(|b| b.is_ascii_hexdigit()))
            .then(|| commit.to_string())
    })
}

/// The quant tag of a GGUF's path in a repository, upper-cased, as llama-server reads it: the
/// last `-` or `.` separated word of the name without `.gguf` and split suffix
/// (`tinygemma3-Q8_0.gguf` → `Q8_0`). `None` for a file that is not a model's first shard, has
/// no tag, or is a sidecar (projector, draft head).
fn hf_model_tag(path: &str) -> Option<String> {
    let stem = strip_suffix_ci(path, ".gguf")?;
    let prefix = match split_suffix(stem) {
        Some((prefix, 1, _)) => prefix,
        Some(_) => return None,
        None => stem,
    };
    if SIDECARS.iter().any(|s| prefix.contains(s)) {
        return None;
    }
    let word = prefix.len()
        - prefix
            .bytes()
            .rev()
            .take_while(|b| b.is_ascii_alphanumeric() || *b == b'_')
            .count();
    let tag = &prefix[word..];
    let sep = prefix[..word].bytes().last();
    (!tag.is_empty() && matches!(sep, Some(b'-' | b'.'))).then(|| tag.to_ascii_uppercase())
}

/// The GGUF models of a hub cache repository folder, added to `out` as `OWNER/NAME:TAG` (the
/// first file of a tag, by path, when several have it).
fn hf_cache_models(repo: &Path, out: &mut BTreeMap<String, PathBuf>) {
    let Some(id) = repo
        .file_name()
        .and_then(|n| hf_repo_of_folder(&n.to_string_lossy()))
    else {
        return;
    };
    let Some(commit) = cached_commit(repo) else {
        return;
    };
    let root = repo.join("snapshots").join(commit);
    let mut files = Vec::new();
    let mut budget = MAX_SNAPSHOT_ENTRIES;
    snapshot_files(&root, &root, 0, &mut budget, &mut files);
    files.sort();
    for (rel, path) in files {
        if let Some(tag) = hf_model_tag(&rel) {
            out.entry(format!("{id}:{tag}")).or_insert(path);
        }
    }
}

/// The Hugging Face hub cache folder, looked up as llama.cpp looks it up: `$LLAMA_CACHE`,
/// `$HF_HUB_CACHE`, `$HUGGINGFACE_HUB_CACHE`, `$HF_HOME/hub`, `$XDG_CACHE_HOME/huggingface/hub`,
/// else `$HOME/.cache/huggingface/hub` (`None` without any of them).
pub fn hf_cache_dir() -> Option<PathBuf> {
    let var = |name: &str| {
        std::env::var_os(name)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    var("LLAMA_CACHE")
        .or_else(|| var("HF_HUB_CACHE"))
        .or_else(|| var("HUGGINGFACE_HUB_CACHE"))
        .or_else(|| var("HF_HOME").map(|h| h.join("hub")))
        .or_else(|| var("XDG_CACHE_HOME").map(|x| x.join("huggingface").join("hub")))
        .or_else(|| var("HOME").map(|h| h.join(".cache").join("huggingface").join("hub")))
}

/// The GGUF that `OWNER/NAME[:TAG]` names in the hub cache `cache` (hmoe downloads nothing):
/// the file of that quant tag, or without a tag llama.cpp's preference, `Q4_K_M`, then
/// `Q8_0`, then the first model by name. An error says what is missing.
pub fn resolve_hf_repo(cache: &Path, reference: &str) -> Result<PathBuf, String> {
    let (repo, tag) = match reference.split_once(':') {
        Some((repo, tag)) => (repo, Some(tag.to_ascii_uppercase())),
        None => (reference, None),
    };
    if !valid_repo_id(repo) {
        return Err(format!(
            "'{reference}' is not a Hugging Face repository (OWNER/NAME or OWNER/NAME:QUANT)"
        ));
    }
    let folder = cache.join(format!("{HF_REPO_PREFIX}{}", repo.replace('/', "--")));
    let mut models = BTreeMap::new();
    if is_hf_cache_repo(&folder) {
        hf_cache_models(&folder, &mut models);
    }
    let wanted: Vec<String> = match &tag {
        Some(t) => vec![t.clone()],
        None => vec!["Q4_K_M".into(), "Q8_0".into()],
    };
    let found = (wanted.iter())
        .find_map(|t| models.get(&format!("{repo}:{t}")))
        .or_else(|| tag.is_none().then(|| models.values().next()).flatten());
    found.cloned().ok_or_else(|| {
        format!(
            "{reference} is not in the Hugging Face cache {} (hmoe downloads nothing: fetch it \
             with llama.cpp or `hf download`, or pass -m FILE)",
            cache.display()
        )
    })
}

/// The regular files (or links to them) under `dir`, with their paths relative to `root`
/// (`/`-separated), at most [`MAX_SNAPSHOT_DEPTH`] folders deep and `budget` entries.
fn snapshot_files(
    root: &Path,
    dir: &Path,
    depth: usize,
    budget: &mut usize,
    out: &mut Vec<(String, PathBuf)>,
) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.filter_map(Result::ok) {
        if *budget == 0 {
            return;
        }
        *budget -= 1;
        let path = e.path();
        if path.is_dir() {
            if depth < MAX_SNAPSHOT_DEPTH {
                snapshot_files(root, &path, depth + 1, budget, out);
            }
        } else if path.is_file() {
            if let Ok(rel) = path.strip_prefix(root) {
                let parts: Vec<_> = rel.iter().map(|p| p.to_string_lossy()).collect();
                out.push((parts.join("/"), path));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_from_files() {
        assert_eq!(model_name(Path::new("/m/gpt-oss-20b.gguf")), "gpt-oss-20b");
        assert_eq!(
            model_name(Path::new("/m/gpt-oss-120b-mxfp4-00001-of-00003.gguf")),
            "gpt-oss-120b-mxfp4"
        );
        assert_eq!(model_name(Path::new("x-1-of-2.GGUF")), "x-1-of-2");
        assert_eq!(split_suffix("a-00002-of-00003"), Some(("a", 2, 3)));
        assert!(first_shard_or_whole(Path::new("a-00001-of-00003.gguf")));
        assert!(!first_shard_or_whole(Path::new("a-00002-of-00003.gguf")));
        assert!(!is_gguf(Path::new("mmproj-x.gguf")));
    }

    #[test]
    fn scans_directories() {
        let dir = std::env::temp_dir().join(format!("hmoe-scan-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("sub")).unwrap();
        for f in [
            "a.gguf",
            "b-00001-of-00002.gguf",
            "b-00002-of-00002.gguf",
            "notes.txt",
            "sub/model.gguf",
            "sub/mmproj-f16.gguf",
        ] {
            std::fs::write(dir.join(f), b"").unwrap();
        }
        let found = scan_models_dir(&dir).unwrap();
        assert_eq!(found.keys().collect::<Vec<_>>(), vec!["a", "b", "sub"]);
        assert!(found["b"].ends_with("b-00001-of-00002.gguf"));
        assert!(found["sub"].ends_with("sub/model.gguf"));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn hub_cache_names_and_tags() {
        assert_eq!(
            hf_model_tag("tinygemma3-Q8_0.gguf").as_deref(),
            Some("Q8_0")
        );
        assert_eq!(hf_model_tag("stories260K-f32.gguf").as_deref(), Some("F32"));
        assert_eq!(hf_model_tag("m.q4_k_m.gguf").as_deref(), Some("Q4_K_M"));
        assert_eq!(
            hf_model_tag("Q4/big-Q4_K_M-00001-of-00002.gguf").as_deref(),
            Some("Q4_K_M")
        );
        assert_eq!(hf_model_tag("big-Q4_K_M-00002-of-00002.gguf"), None);
        assert_eq!(hf_model_tag("mmproj-tinygemma3-Q8_0.gguf"), None);
        assert_eq!(hf_model_tag("stories260K.gguf"), None);
        assert_eq!(hf_model_tag("Q8_0/model.gguf"), None);
        assert_eq!(hf_model_tag("x-Q8_0.bin"), None);
        assert_eq!(
            hf_repo_of_folder("models--ggml-org--tinygemma3-GGUF").as_deref(),
            Some("ggml-org/tinygemma3-GGUF")
        );
        for bad in [
            "models--a",
            "models--a--b--c",
            "models--a--.b",
            "datasets--a--b",
            "models--a--b/",
        ] {
            assert_eq!(hf_repo_of_folder(bad), None, "{bad}");
        }
    }

    #[test]
    fn scans_a_hub_cache() {
        let dir = std::env::temp_dir().join(format!("hmoe-hub-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let commit = "0123456789abcdef0123456789abcdef01234567";
        let old = "fedcba9876543210fedcba9876543210fedcba98";
        let repo = dir.join("models--ggml-org--tinygemma3-GGUF");
        let snap = repo.join("snapshots").join(commit);
        std::fs::create_dir_all(snap.join("sub")).unwrap();
        std::fs::create_dir_all(repo.join("snapshots").join(old)).unwrap();
        std::fs::create_dir_all(repo.join("refs")).unwrap();
        std::fs::write(repo.join("refs/main"), format!("{commit}\n")).unwrap();
        std::fs::write(repo.join("refs/pr-1"), old).unwrap();
        for f in [
            "tinygemma3-Q8_0.gguf",
            "mmproj-tinygemma3-Q8_0.gguf",
            "sub/big-F16-00001-of-00002.gguf",
            "sub/big-F16-00002-of-00002.gguf",
            "README.md",
        ] {
            std::fs::write(snap.join(f), b"").unwrap();
        }
        std::fs::write(repo.join("snapshots").join(old).join("old-Q4_0.gguf"), b"").unwrap();
        // A cache folder without a valid ref lists nothing; a plain model beside it is kept.
        let stale = dir.join("models--x--y");
        std::fs::create_dir_all(stale.join("snapshots").join(commit)).unwrap();
        std::fs::write(
            stale.join("snapshots").join(commit).join("y-Q8_0.gguf"),
            b"",
        )
        .unwrap();
        std::fs::write(dir.join("plain.gguf"), b"").unwrap();
        let found = scan_models_dir(&dir).unwrap();
        assert_eq!(
            found.keys().collect::<Vec<_>>(),
            vec![
                "ggml-org/tinygemma3-GGUF:F16",
                "ggml-org/tinygemma3-GGUF:Q8_0",
                "plain"
            ]
        );
        assert_eq!(
            found["ggml-org/tinygemma3-GGUF:Q8_0"],
            snap.join("tinygemma3-Q8_0.gguf")
        );
        assert_eq!(
            found["ggml-org/tinygemma3-GGUF:F16"],
            snap.join("sub/big-F16-00001-of-00002.gguf")
        );
        let cache_dir = dir.clone();
        let resolve = |r: &str| resolve_hf_repo(&cache_dir, r);
        assert_eq!(
            resolve("ggml-org/tinygemma3-GGUF:q8_0").unwrap(),
            snap.join("tinygemma3-Q8_0.gguf")
        );
        // No tag: Q4_K_M, then Q8_0, then the first.
        assert_eq!(
            resolve("ggml-org/tinygemma3-GGUF").unwrap(),
            snap.join("tinygemma3-Q8_0.gguf")
        );
        assert!(resolve("ggml-org/tinygemma3-GGUF:Q4_0")
            .unwrap_err()
            .contains("not in the Hugging Face cache"));
        assert!(resolve("x/y").is_err());
        assert!(resolve("../etc")
            .unwrap_err()
            .contains("not a Hugging Face repository"));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
