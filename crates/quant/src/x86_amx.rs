//! AMX-INT8 (Intel's tile matrix unit) for the batched MXFP4 × Q8_0 product in the block-wise
//! order of `gemm.rs`, bit-identical to the AVX-512 VNNI kernel.
//!
//! The block-wise order needs one exact integer per (row, token, 32-element block):
//! `isum = Σ value·a`, which is what one `tdpbssd` over a K of 32 bytes produces for a tile of
//! 16 rows × 16 tokens (signed × signed bytes, exact in int32 whatever the bytes, -128
//! included). Each block's tile is stored and folded into float accumulators exactly as the
//! VNNI kernel folds its sums, `acc = fma(f32(isum), scalef(d_token, e_row − 128), acc)` in
//! block order, so the results are the same bits; only the integer work moves to the tiles.
//! (Q8_0's `vec_dot` order needs a separate sum per four elements, which a tile of K = 32 would
//! only give at eight times the work, so Q8_0 stays on VNNI.)
//!
//! Tiles: `tmm0` = A, 16 weight rows × 32 signed values of one block (the table values,
//! decoded once per group of 16 rows); `tmm1` = B, the block's activation bytes of 16 tokens
//! in the VNNI layout (row `k` holds bytes `4k..4k+4` of each token); `tmm2` = C, 16 × 16
//! int32. Tokens are padded to 16 with zero bytes and scales; rows that do not fill a group of
//! 16, and batches of fewer than [`AMX_MIN_TOKENS`] tokens, go to the VNNI kernel.
//!
//! Linux hands out tile state only on request (`arch_prctl(ARCH_REQ_XCOMP_PERM,
//! XFEATURE_XTILEDATA)`), and a virtual machine may report AMX and still fault on it, so
//! [`amx_status`] asks for the permission and runs a tile multiply in a forked child first.

use core::arch::asm;
use core::arch::x86_64::*;
use std::sync::OnceLock;

use crate::gemm::{ActBlocks, GemmFn};
use crate::scalar::{KVALUES_MXFP4, MXFP4_BYTES, Q8_0_BYTES, QK};
use crate::x86_avx2::f16_at;
use crate::AmxStatus;

/// Batches from this many tokens use the tiles (a tile holds 16; below 4 most of it is
/// padding and the VNNI kernel is as fast).
pub(crate) const AMX_MIN_TOKENS: usize = 4;

/// Rows (weights) and columns (tokens) of one tile product.
const T: usize = 16;

/// AMX-TILE (CPUID.7.0:EDX[24]) and AMX-INT8 (EDX[25]).
fn cpu_reports_amx() -> bool {
    let edx = __cpuid_count(7, 0).edx;
    edx & (1 << 24) != 0 && edx & (1 << 25) != 0
}

/// Whether batched MXFP4 products can use AMX: detected, permitted and probed once per process.
pub(crate) fn amx_status() -> &'static AmxStatus {
    static STATUS: OnceLock<AmxStatus> = OnceLock::new();
    STATUS.get_or_init(|| {
        if std::env::var("HMOE_AMX").is_ok_and(|v| v == "0") {
            return AmxStatus::Disabled;
        }
        if !(crate::cpu::has_avx512_vnni() && crate::cpu::has_avx512_vbmi() && cpu_reports_amx()) {
            return AmxStatus::NotReported;
        }
        if let Err(errno) = request_tile_permission() {
            return AmxStatus::PermissionDenied(errno);
        }
        probe()
    })
}

/// `arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`: process-wide, inherited by children.
fn request_tile_permission() -> Result<(), i32> {
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: arch_prctl with these arguments only changes the process's permitted XSAVE
    // features; it reads and writes no memory of ours.
    let r = unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error().raw_os_error().unwrap_or(-1))
    }
}

/// Runs [`tile_selftest`] in a forked child, so that a faulting tile instruction (a VM that
/// reports AMX but does not pass it through) kills the child and not us.
fn probe() -> AmxStatus {
    // SAFETY: the child runs only `tile_selftest` (stack memory and the tile instructions, no
    // allocation, no locks) and `_exit`, which is what a child of a multi-threaded process may
    // do.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        // SAFETY: the permission was granted; a fault ends this child only.
        let ok = unsafe { tile_selftest() };
        // SAFETY: `_exit` ends the child without running the parent's exit handlers.
        unsafe { libc::_exit(if ok { 0 } else { 1 }) };
    }
    if pid < 0 {
        return AmxStatus::ProbeFailed("fork for the tile probe failed".into());
    }
    let mut status = 0;
    // SAFETY: waits for the child forked above; `status` is a valid out-pointer.
    let r = unsafe { libc::waitpid(pid, &mut status, 0) };
    if r != pid {
        return AmxStatus::ProbeFailed("waiting for the tile probe failed".into());
    }
    if libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0 {
        AmxStatus::Usable
    } else if libc::WIFSIGNALED(status) {
        AmxStatus::ProbeFailed(format!(
            "a tile instruction faulted: signal {}",
            libc::WTERMSIG(status)
        ))
    } else {
        AmxStatus::ProbeFailed("the tile probe computed a wrong product".into())
    }
}

/// One tile product of known bytes, checked against integer arithmetic.
///
/// # Safety
/// The tile permission must be granted; the CPU may still fault (run it in a child).
unsafe fn tile_selftest() -> bool {
    let mut a = [0u8; T * QK];
    let mut b = [0u8; QK / 4 * 64];
    for (i, x) in a.iter_mut().enumerate() {
        *x = (i as u32).wrapping_mul(37).wrapping_add(11) as u8;
    }
    for (i, x) in b.iter_mut().enumerate() {
        *x = (i as u32).wrapping_mul(53).wrapping_add(200) as u8;
    }
    let mut c = [0i32; T * T];
    let cfg = TileConfig::new();
    tile_config_load(&cfg);
    tile_product(a.as_ptr(), b.as_ptr(), c.as_mut_ptr());
    tile_release();
    (0..T * T).all(|i| {
        let (m, n) = (i / T, i % T);
        let want: i32 = (0..QK)
            .map(|k| a[m * QK + k] as i8 as i32 * b[k / 4 * 64 + n * 4 + k % 4] as i8 as i32)
            .sum();
        c[i] == want
    })
}

/// The 64-byte operand of `ldtilecfg` (palette 1).
#[repr(C, align(64))]
struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    colsb: [u16; 16],
    rows: [u8; 16],
}

impl TileConfig {
    /// `tmm0`: 16 × 32 bytes (A), `tmm1`: 8 × 64 bytes (B), `tmm2`: 16 × 64 bytes (C).
    fn new() -> TileConfig {
        let mut c = TileConfig {
            palette: 1,
            start_row: 0,
            reserved: [0; 14],
            colsb: [0; 16],
            rows: [0; 16],
        };
        (c.colsb[0], c.rows[0]) = (QK as u16, T as u8);
        (c.colsb[1], c.rows[1]) = (64, (QK / 4) as u8);
        (c.colsb[2], c.rows[2]) = (64, T as u8);
        c
    }
}

/// Loads the tile configuration.
#[inline(always)]
unsafe fn tile_config_load(cfg: &TileConfig) {
    // SAFETY: `cfg` is a valid 64-byte palette-1 configuration; the caller has the tile
    // permission.
    asm!("ldtilecfg [{}]", in(reg) cfg as *const TileConfig, options(nostack, readonly));
}

/// Returns the tile registers to their initial state.
#[inline(always)]
unsafe fn tile_release() {
    // SAFETY: no operands; ends the tile section started by `tile_config_load`.
    asm!("tilerelease", options(nostack));
}

/// `c[m][n] = Σ_k a[m][k] · b[k/4][n][k%4]` for the 16 × 32 signed bytes at `a` (rows 32
/// bytes apart), the 8 × 64 signed bytes at `b` and the 16 × 16 int32 at `c`.
#[inline(always)]
unsafe fn tile_product(a: *const u8, b: *const u8, c: *mut i32) {
    // SAFETY: `a` holds 16 rows of 32 bytes, `b` 8 rows of 64, both read through the strides
    // given; the configuration of `TileConfig::new` is loaded.
    asm!(
        "tileloadd tmm0, [{a} + {sa}*1]",
        "tileloadd tmm1, [{b} + {sb}*1]",
        a = in(reg) a,
        sa = in(reg) QK,
        b = in(reg) b,
        sb = in(reg) 64usize,
        options(nostack, readonly),
    );
    // SAFETY: tile registers only (configured above).
    asm!(
        "tilezero tmm2",
        "tdpbssd tmm2, tmm0, tmm1",
        options(nostack, nomem)
    );
    // SAFETY: `c` has room for 16 rows of 64 bytes.
    asm!(
        "tilestored [{c} + {sc}*1], tmm2",
        c = in(reg) c,
        sc = in(reg) 64usize,
        options(nostack),
    );
}

/// Decodes block `b` of the 16 rows at `w` (`stride` bytes apart) into `a` (16 × 32 signed
/// values in element order) and the rows' exponents minus 128 into `e`.
#[inline(always)]
unsafe fn decode_group(w: *const u8, stride: usize, nb: usize, a: &mut [u8], e: &mut [f32]) {
    let table = _mm_loadu_si128(KVALUES_MXFP4.as_ptr().cast());
    let low = _mm_set1_epi8(15);
    for r in 0..T {
        let row = w.add(r * stride);
        for b in 0..nb {
            let blk = row.add(b * MXFP4_BYTES);
            let q = _mm_loadu_si128(blk.add(1).cast());
            let lo = _mm_shuffle_epi8(table, _mm_and_si128(q, low));
            let hi = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(q, 4), low));
            let dst = a.as_mut_ptr().add((b * T + r) * QK);
            _mm_storeu_si128(dst.cast(), lo);
            _mm_storeu_si128(dst.add(QK / 2).cast(), hi);
            e[b * T + r] = *blk as f32 - 128.0;
        }
    }
}

/// The tiles' MXFP4 × Q8_0 GEMM ([`GemmFn`] contract), bit-identical to `fallback` (the
/// AVX-512 VNNI kernel), which takes small batches and the rows short of a group of 16.
///
/// # Safety
/// [`amx_status`] is [`AmxStatus::Usable`] (AVX-512 F/BW/VL/VNNI/VBMI, AVX2, FMA and F16C
/// included); slices as in [`GemmFn`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn mxfp4_amx(
    n: usize,
    w: &[u8],
    acts: &[u8],
    blocks: &ActBlocks,
    n_tokens: usize,
    out: &mut [f32],
    fallback: GemmFn,
) {
    let rows = out.len() / n_tokens;
    let full = rows / T * T;
    if n_tokens < AMX_MIN_TOKENS || full == 0 {
        return fallback(n, w, acts, blocks, n_tokens, out);
    }
    let nb = n / QK;
    let (stride, astride) = (nb * MXFP4_BYTES, nb * Q8_0_BYTES);
    let n_groups = n_tokens.div_ceil(T);
    // B tiles and token scales of each token group and block (`[group][block]`).
    let mut bt = vec![0u8; n_groups * nb * QK * T];
    let mut ds = vec![0f32; n_groups * nb * T];
    for t in 0..n_tokens {
        let (g, j) = (t / T, t % T);
        for b in 0..nb {
            let ab = acts.as_ptr().add(t * astride + b * Q8_0_BYTES);
            let at = (g * nb + b) * T;
            ds[at + j] = f16_at(ab);
            for k in 0..QK / 4 {
                let src = ab.add(2 + 4 * k).cast::<u32>().read_unaligned();
                bt.as_mut_ptr()
                    .add(at * QK + k * 64 + j * 4)
                    .cast::<u32>()
                    .write_unaligned(src);
            }
        }
    }
    let mut a = vec![0u8; nb * T * QK];
    let mut e = vec![0f32; nb * T];
    let mut c = [0i32; T * T];
    let cfg = TileConfig::new();
    tile_config_load(&cfg);
    for r0 in (0..full).step_by(T) {
        decode_group(w.as_ptr().add(r0 * stride), stride, nb, &mut a, &mut e);
        for g in 0..n_groups {
            let mut acc = [_mm512_setzero_ps(); T];
            for b in 0..nb {
                let at = (g * nb + b) * T;
                tile_product(
                    a.as_ptr().add(b * T * QK),
                    bt.as_ptr().add(at * QK),
                    c.as_mut_ptr(),
                );
                let d = _mm512_loadu_ps(ds.as_ptr().add(at));
                for (m, acc) in acc.iter_mut().enumerate() {
                    let scale = _mm512_scalef_ps(d, _mm512_set1_ps(e[b * T + m]));
                    let isum = _mm512_loadu_si512(c.as_ptr().add(m * T).cast());
                    *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), scale, *acc);
                }
            }
            let valid = (n_tokens - g * T).min(T);
            let mask: __mmask16 = ((1u32 << valid) - 1) as __mmask16;
            for (m, &acc) in acc.iter().enumerate() {
                let dst = out.as_mut_ptr().add((r0 + m) * n_tokens + g * T);
                _mm512_mask_storeu_ps(dst, mask, acc);
            }
        }
    }
    tile_release();
    if full < rows {
        fallback(
            n,
            &w[full * stride..],
            acts,
            blocks,
            n_tokens,
            &mut out[full * n_tokens..],
        );
    }
}

/// [`mxfp4_amx`] with the AVX-512 VNNI + VBMI kernel as its fallback.
///
/// # Safety
/// As [`mxfp4_amx`].
unsafe fn mxfp4_amx_vnni(
    n: usize,
    w: &[u8],
    acts: &[u8],
    blocks: &ActBlocks,
    n_tokens: usize,
    out: &mut [f32],
) {
    let (_, fallback) = crate::x86_gemm_avx512::gemm_fn(crate::GgmlType::MXFP4, true, true);
    mxfp4_amx(n, w, acts, blocks, n_tokens, out, fallback)
}

/// The AMX MXFP4 GEMM, where [`amx_status`] is [`AmxStatus::Usable`] (`GemmKernel::new`
/// takes it only when `crate::amx_in_use`).
pub(crate) fn gemm_fn() -> Option<(&'static str, GemmFn)> {
    (*amx_status() == AmxStatus::Usable).then_some((
        "mxfp4*q8_0 blockwise/amx-int8+avx512vnni",
        mxfp4_amx_vnni as GemmFn,
    ))
}
