//! What runs everywhere: the crate's behaviour without CUDA, the host-side parameter math,
//! and (when clang with CUDA support is installed) a compile check of the kernel source.

use hmoe_cuda::{driver_present, probe, CudaDevice, CudaError, RopeParams};

#[test]
fn probe_without_a_driver_is_a_clean_error() {
    if driver_present() {
        // A machine with a driver: the probe must still not fail.
        let gpus = probe().expect("probe with a driver");
        eprintln!("driver present: {} device(s)", gpus.len());
        return;
    }
    let err = probe().unwrap_err();
    assert!(matches!(err, CudaError::NoDriver), "{err:?}");
    assert_eq!(err.to_string(), "no CUDA driver (libcuda not found)");
    assert!(matches!(
        hmoe_cuda::device_count(),
        Err(CudaError::NoDriver)
    ));
    assert!(matches!(hmoe_cuda::probe_one(0), Err(CudaError::NoDriver)));
    assert!(matches!(CudaDevice::new(0), Err(CudaError::NoDriver)));
}

#[test]
fn library_checks_do_not_panic() {
    // Each only tries to dlopen its library.
    let _ = (
        hmoe_cuda::driver_present(),
        hmoe_cuda::nvrtc_present(),
        hmoe_cuda::cublas_present(),
    );
    if !hmoe_cuda::nvrtc_present() {
        assert!(matches!(
            hmoe_cuda::kernels::nvrtc_version(),
            Err(CudaError::NoNvrtc)
        ));
        assert!(hmoe_cuda::kernels::ptx_for((9, 0)).is_err());
    }
}

#[test]
fn yarn_parameters_for_gpt_oss() {
    // gpt-oss: head_dim 64, base 150000, YaRN factor 32 over 4096, beta 32/1.
    let p = RopeParams::yarn(64, 150000.0, 32.0, 4096, 1.0, 32.0, 1.0);
    assert_eq!(p.freq_scale, 1.0 / 32.0);
    assert_eq!(p.ext_factor, 1.0);
    let corr = |n_rot: f32| {
        64.0 * (4096.0f32 / (n_rot * 2.0 * std::f32::consts::PI)).ln() / (2.0 * 150000f32.ln())
    };
    assert_eq!(p.corr_dims, [corr(32.0).floor(), corr(1.0).ceil()]);
    // 8.05 floored and 17.4 ceiled.
    assert_eq!(p.corr_dims, [8.0, 18.0]);
    // Position 0: no rotation, magnitude 1 + 0.1 ln 32.
    let (c, s) = p.cos_sin(0, 5);
    assert!((c - (1.0 + 0.1 * 32f32.ln())).abs() < 1e-6, "{c}");
    assert_eq!(s, 0.0);
    // Pairs below the low correction dim extrapolate (theta = pos · base^(-2i/64)); pairs
    // above the high one interpolate (theta / 32).
    let mscale = 1.0 + 0.1 * 32f32.ln();
    let theta = |i: usize| {
        let mut t = 100.0f32;
        for _ in 0..i {
            t *= p.theta_scale;
        }
        t
    };
    let (c0, s0) = p.cos_sin(100, 2);
    assert!((c0 - theta(2).cos() * mscale).abs() < 1e-6);
    assert!((s0 - theta(2).sin() * mscale).abs() < 1e-6);
    let (c1, _) = p.cos_sin(100, 30);
    assert!((c1 - (theta(30) / 32.0).cos() * mscale).abs() < 1e-6);
    let plain = RopeParams::plain(64, 10000.0);
    assert_eq!(plain.cos_sin(1, 0), (1f32.cos(), 1f32.sin()));
}

/// Compiles the kernels (kernels/*.cu) for sm_80 and sm_70 with clang's CUDA front end when
/// clang is installed (syntax, types, inline PTX constraints); skipped otherwise. NVRTC is the
/// real compiler. The int8 tensor-core instructions and the asynchronous copies (kernels/mma.cu,
/// kernels/mma_kquants.cu) are in sm_80's PTX only: sm_70's has the entry points, empty.
#[test]
fn kernel_source_compiles_with_clang_when_available() {
    let clang = std::env::var("HMOE_CLANG").unwrap_or_else(|_| "clang".into());
    let probe = std::process::Command::new(&clang).arg("--version").output();
    if !probe.is_ok_and(|o| o.status.success()) {
        eprintln!("clang not found: skipped");
        return;
    }
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("hmoe-cuda-clang-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let src = dir.join("k.cu");
    let prelude = include_str!("support/clang_prelude.h");
    std::fs::write(&src, format!("{prelude}\n{}", hmoe_cuda::kernels::SOURCE)).unwrap();
    for arch in ["sm_80", "sm_70"] {
        let ptx_path = dir.join(format!("k_{arch}.ptx"));
        let out = std::process::Command::new(&clang)
            .args(["-x", "cuda", "--cuda-device-only"])
            .arg(format!("--cuda-gpu-arch={arch}"))
            .args(["-nocudainc", "-nocudalib", "-Wall", "-Werror", "-O1", "-S"])
            .arg(&src)
            .arg("-o")
            .arg(&ptx_path)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        if stderr.contains("cannot find CUDA installation") || stderr.contains("unknown target") {
            eprintln!("clang without CUDA support: skipped ({stderr})");
            let _ = std::fs::remove_dir_all(&dir);
            return;
        }
        assert!(out.status.success(), "clang ({arch}) failed:\n{stderr}");
        let ptx = std::fs::read_to_string(&ptx_path).unwrap();
        for name in hmoe_cuda::kernels::KERNELS {
            assert!(
                ptx.contains(&format!(".entry {name}(")),
                "{name} missing from the {arch} PTX"
            );
        }
        let tensor_cores = ptx.contains("mma.sync.aligned.m16n8k32")
            && ptx.contains("ldmatrix")
            && ptx.contains("cp.async.cg.shared.global")
            && ptx.contains("cp.async.wait_all");
        assert_eq!(tensor_cores, arch == "sm_80", "tensor-core PTX for {arch}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
