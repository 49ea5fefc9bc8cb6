//! The Python the client tests run: `$HMOE_PYTHON` (the virtual environment `.ci/run` makes)
//! or `python3`. Nothing is installed from here.

use std::process::Command;

/// The interpreter, when it imports every module of `modules`; otherwise why not.
pub fn python_or_why(modules: &[&str]) -> Result<String, String> {
    let py = std::env::var("HMOE_PYTHON").unwrap_or_else(|_| "python3".into());
    let imports = modules.join(", ");
    let ok = Command::new(&py)
        .args(["-c", &format!("import {imports}")])
        .output()
        .is_ok_and(|o| o.status.success());
    if ok {
        Ok(py)
    } else {
        Err(format!(
            "{py} cannot import {imports} (run .ci/run, or set HMOE_PYTHON)"
        ))
    }
}

/// The interpreter as [`python_or_why`] finds it; without it, a `SKIPPED:` line on stderr.
pub fn python_with(modules: &[&str]) -> Option<String> {
    python_or_why(modules)
        .map_err(|why| eprintln!("SKIPPED: {why}"))
        .ok()
}

/// Runs a client check script (it prints `N passed, M failed` and exits non-zero on failures);
/// panics with its output unless it passed every check. Returns its stdout and stderr.
pub fn run_checks(cmd: &mut Command) -> String {
    let out = cmd.output().expect("python runs");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success() && text.contains(" passed, 0 failed"),
        "client checks failed:\n{text}"
    );
    text
}
