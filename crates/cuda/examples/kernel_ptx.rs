//! Compiles the kernels with NVRTC, as a device would at start, for each compute capability
//! given (`8.6 9.0 …`) and writes `<dir>/sm_XY.ptx`: no GPU and no driver needed, only
//! libnvrtc on the library path. `scripts/ptx-check.sh` then assembles each with `ptxas`, the
//! step where a GPU's driver would reject the module (too much shared memory, bad PTX).
//!
//! `cargo run -p hmoe-cuda --example kernel_ptx -- DIR 8.0 9.0`

use std::process::ExitCode;

fn main() -> ExitCode {
    let mut args = std::env::args().skip(1);
    let Some(dir) = args.next() else {
        eprintln!("usage: kernel_ptx DIR MAJOR.MINOR...");
        return ExitCode::from(2);
    };
    match hmoe_cuda::kernels::nvrtc_version() {
        Ok((major, minor)) => println!("NVRTC {major}.{minor}"),
        Err(e) => {
            eprintln!("kernel_ptx: {e}");
            return ExitCode::from(3);
        }
    }
    let mut failed = false;
    for cc in args {
        let parsed = cc
            .split_once('.')
            .and_then(|(a, b)| Some((a.parse().ok()?, b.parse().ok()?)));
        let Some((major, minor)) = parsed else {
            eprintln!("kernel_ptx: {cc:?} is not MAJOR.MINOR");
            return ExitCode::from(2);
        };
        match hmoe_cuda::kernels::ptx_for((major, minor)) {
            Ok((ptx, _)) => {
                let path = format!("{dir}/sm_{major}{minor}.ptx");
                if let Err(e) = std::fs::write(&path, ptx) {
                    eprintln!("kernel_ptx: {path}: {e}");
                    return ExitCode::from(1);
                }
                println!("sm_{major}{minor}: {path}");
            }
            Err(e) => {
                eprintln!("kernel_ptx: sm_{major}{minor}: {e}");
                failed = true;
            }
        }
    }
    if failed {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    }
}
