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
/// clang is installed (syntax, types, inline PTX constraints), and checks that no kernel
/// declares more static shared memory than a block may have (one such kernel would fail the
/// whole module's load on the GPU, and with it every kernel); skipped otherwise. NVRTC is the
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
        let smem = static_shared_bytes(&ptx);
        let mut biggest: Vec<_> = smem.iter().collect();
        biggest.sort_by_key(|&(name, bytes)| (std::cmp::Reverse(*bytes), *name));
        eprintln!(
            "{arch}: the most static shared memory per block: {:?}",
            &biggest[..5.min(biggest.len())]
        );
        for name in hmoe_cuda::kernels::KERNELS {
            let bytes = smem.get(name).copied().unwrap_or(0);
            assert!(
                bytes <= MAX_STATIC_SHARED,
                "{name} ({arch}) declares {bytes} bytes of static shared memory, over the \
                 {MAX_STATIC_SHARED} a module may declare: the whole module would fail to load"
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

/// The most static shared memory (`__shared__` arrays of fixed size) a kernel may declare:
/// 48 KiB (`ptxas`: "uses too much shared data"; more needs dynamic shared memory).
const MAX_STATIC_SHARED: usize = 48 * 1024;

/// The bytes of static shared memory each kernel (`.entry`) of `ptx` reaches: the `.shared`
/// variables named in its body and in the bodies of the functions it calls, transitively.
fn static_shared_bytes(ptx: &str) -> std::collections::HashMap<&str, usize> {
    use std::collections::{HashMap, HashSet};
    let is_ident = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == '$';
    // `name` occurs in `text` as a whole identifier.
    let names_in = |text: &str, name: &str| {
        text.match_indices(name).any(|(i, _)| {
            let before = text[..i].chars().next_back();
            let after = text[i + name.len()..].chars().next();
            !before.is_some_and(is_ident) && !after.is_some_and(is_ident)
        })
    };
    let elem_bytes = |ty: &str| match &ty[ty.len().saturating_sub(2)..] {
        "b8" | "u8" | "s8" => 1,
        "16" => 2,
        "32" => 4,
        _ => 8,
    };
    let mut shared: HashMap<&str, usize> = HashMap::new();
    // (is an entry, name) -> body
    let mut bodies: Vec<(bool, &str, String)> = Vec::new();
    let mut header: Option<(bool, &str)> = None;
    let mut open: Option<(bool, &str, String, i32)> = None;
    for line in ptx.lines() {
        let t = line.trim();
        if let Some((entry, name, body, depth)) = open.as_mut() {
            *depth += t.matches('{').count() as i32 - t.matches('}').count() as i32;
            if *depth == 0 {
                bodies.push((*entry, *name, std::mem::take(body)));
                open = None;
            } else {
                body.push_str(t);
                body.push('\n');
            }
            continue;
        }
        let words: Vec<&str> = t.split_whitespace().collect();
        if let Some(at) = words.iter().position(|w| *w == ".shared") {
            // [.visible|.weak|.global] .shared [.align N] .TYPE NAME[COUNT];
            if words.first() != Some(&".extern") {
                let rest = &words[at + 1..];
                let rest = if rest.first() == Some(&".align") {
                    &rest[2..]
                } else {
                    rest
                };
                if let [ty, decl, ..] = rest {
                    let decl = decl.trim_end_matches(';');
                    let (name, count) = match decl.split_once('[') {
                        Some((n, c)) => (n, c.trim_end_matches(']').parse().unwrap_or(1)),
                        None => (decl, 1),
                    };
                    shared.insert(name, count * elem_bytes(ty));
                }
            }
            continue;
        }
        if let Some(at) = words.iter().position(|w| *w == ".entry" || *w == ".func") {
            let entry = words[at] == ".entry";
            // The name: the first word after the return parameters that is an identifier.
            let after = t.split_once(words[at]).map_or("", |(_, r)| r).trim_start();
            let after = match after.strip_prefix('(') {
                Some(r) => r.split_once(')').map_or("", |(_, r)| r).trim_start(),
                None => after,
            };
            let end = after.find(|c: char| !is_ident(c)).unwrap_or(after.len());
            header = Some((entry, &after[..end]));
        } else if t == "{" {
            if let Some((entry, name)) = header.take() {
                open = Some((entry, name, String::new(), 1));
            }
        } else if t.ends_with(';') && !t.starts_with(".param") {
            // A declaration without a body.
            header = None;
        }
    }
    let funcs: HashSet<&str> = bodies.iter().map(|(_, n, _)| *n).collect();
    let reach: HashMap<&str, (Vec<&str>, Vec<&str>)> = bodies
        .iter()
        .map(|(_, n, b)| {
            let vars = shared.keys().copied().filter(|v| names_in(b, v)).collect();
            let calls = funcs
                .iter()
                .copied()
                .filter(|f| f != n && names_in(b, f))
                .collect();
            (*n, (vars, calls))
        })
        .collect();
    bodies
        .iter()
        .filter(|(entry, _, _)| *entry)
        .map(|(_, name, _)| {
            let (mut seen, mut vars, mut stack) = (HashSet::new(), HashSet::new(), vec![*name]);
            while let Some(f) = stack.pop() {
                if seen.insert(f) {
                    if let Some((v, c)) = reach.get(f) {
                        vars.extend(v.iter().copied());
                        stack.extend(c.iter().copied());
                    }
                }
            }
            (*name, vars.iter().map(|v| shared[v]).sum())
        })
        .collect()
}
