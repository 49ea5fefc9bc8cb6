//! `/props`' `build_info` as llama-server writes it, `b<number>-<hash>`: the number of commits
//! up to the one built and its short hash (`b0-unknown` outside a git checkout).

use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    let text = String::from_utf8(out.stdout).ok()?;
    (out.status.success() && !text.trim().is_empty()).then(|| text.trim().to_string())
}

fn main() {
    let number = git(&["rev-list", "--count", "HEAD"]).unwrap_or_else(|| "0".into());
    let hash = git(&["rev-parse", "--short", "HEAD"]).unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=HMOE_BUILD_INFO=b{number}-{hash}");
    // Built again when HEAD moves: HEAD itself, the branch it names, and packed refs.
    let mut watched = vec!["HEAD".to_string(), "packed-refs".to_string()];
    watched.extend(git(&["symbolic-ref", "-q", "HEAD"]));
    for name in watched {
        // A path that does not exist would rebuild every time.
        let path = git(&["rev-parse", "--git-path", &name]);
        if let Some(path) = path.filter(|p| std::path::Path::new(p).exists()) {
            println!("cargo:rerun-if-changed={path}");
        }
    }
}
