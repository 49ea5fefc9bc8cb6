//! AMX-INT8 (Intel's tile matrix unit) for the batched MXFP4 × Q8_0 product in the block-wise
//! order of `scalar/gemm.rs`, bit-identical to the AVX-512 VNNI kernel.
//!
//! The block-wise order needs one exact integer per (row, token, 32-element block):
//! `isum = Σ value·a`, which is what one `tdpbssd` over a K of 32 bytes produces for a tile of
//! 16 tokens × 16 rows (signed × signed bytes, exact in int32 whatever the bytes, -128
//! included). Each block's tile is stored and folded into float accumulators exactly as the
//! VNNI kernel folds its sums, `acc = fma(f32(isum), scalef(d_token, e_row − 128), acc)` in
//! block order, so the results are the same bits; only the integer work moves to the tiles.
//! (Q8_0's `vec_dot` order needs a separate sum per four elements, which a tile of K = 32 would
//! only give at eight times the work, so Q8_0 stays on VNNI.)
//!
//! The roles follow the VNNI kernel's registers: A is 16 tokens' activation bytes of one
//! block, loaded straight from the Q8_0 rows with their stride; B is one block of 16 weight
//! rows as [`decode16`] leaves it (vector `k` holds in lane `r` the table values of elements
//! `4k..4k+4` of row `r`, which is the VNNI layout B wants), stored once per row group and
//! block and reused by every token group; C's row `m` is token `m`'s sums over the 16 rows, one
//! zmm, folded as the VNNI kernel folds its per-token vector. Two tile sets alternate by block
//! and each block is folded after the next one's tiles are issued, so the tile unit runs
//! while the vector units fold. Rows may be in the file's layout or interleaved
//! (`GemmKernel::interleave_into`), as the VNNI kernels read them. A call's last group short
//! of 16 tokens is the call's last 16 tokens, so no tile reads past the activations and
//! nothing is copied. The tokens' scales come as f32 from `GemmKernel::prepare`
//! (`ActBlocks::block_scales`). Rows that do not fill a group of 16, and batches of fewer than
//! [`AMX_MIN_TOKENS`] tokens, go to the VNNI kernel of the same layout.
//!
//! Linux hands out tile state only on request (`arch_prctl(ARCH_REQ_XCOMP_PERM,
//! XFEATURE_XTILEDATA)`), and a virtual machine may report AMX and still fault on it, so
//! [`amx_status`] asks for the permission and runs the kernel's tile blocks in a forked child
//! first.

use core::arch::asm;
use core::arch::x86_64::*;
use core::ops::Range;
use std::sync::OnceLock;

use crate::gemm_layout::{ActBlocks, GemmFn, AMX_MIN_TOKENS, AMX_TILE_TOKENS};
use crate::scalar::shared::{KVALUES_MXFP4, MXFP4_BYTES, Q8_0_BYTES, QK};
use crate::x86::avx512::gemm::{decode16, nibble_table, prefetch_group};
use crate::AmxStatus;

/// Weight rows and tokens of one tile product (the tokens are also the padding `prepare` gives
/// the scales).
const T: usize = AMX_TILE_TOKENS;

/// AMX-TILE (CPUID.7.0:EDX\[24\]) and AMX-INT8 (EDX\[25\]).
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
        if !(crate::x86::features::has_avx512_vnni()
            && crate::x86::features::has_avx512_vbmi()
            && cpu_reports_amx())
        {
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
    let r = loop {
        // SAFETY: waits for the child forked above; `status` is a valid out-pointer.
        let r = unsafe { libc::waitpid(pid, &mut status, 0) };
        let interrupted =
            r < 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::EINTR);
        if !interrupted {
            break r;
        }
    };
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

/// One tile block in each tile set, over known bytes, checked against integer arithmetic.
///
/// # Safety
/// The tile permission must be granted; the CPU may still fault (run it in a child).
unsafe fn tile_selftest() -> bool {
    let mut a = [0u8; T * QK];
    let mut b = BTile([0u8; B_TILE_BYTES]);
    for (i, x) in a.iter_mut().enumerate() {
        *x = (i as u32).wrapping_mul(37).wrapping_add(11) as u8;
    }
    for (i, x) in b.0.iter_mut().enumerate() {
        *x = (i as u32).wrapping_mul(53).wrapping_add(200) as u8;
    }
    let mut c = CTiles([[0i32; T * T]; 2]);
    let cfg = TileConfig::new();
    tile_config_load(&cfg);
    tile_block::<0>(a.as_ptr(), QK, b.0.as_ptr(), c.0[0].as_mut_ptr());
    tile_block::<1>(a.as_ptr(), QK, b.0.as_ptr(), c.0[1].as_mut_ptr());
    tile_release();
    (0..T * T).all(|i| {
        let (m, n) = (i / T, i % T);
        let want: i32 = (0..QK)
            .map(|k| a[m * QK + k] as i8 as i32 * b.0[k / 4 * 64 + n * 4 + k % 4] as i8 as i32)
            .sum();
        c.0[0][i] == want && c.0[1][i] == want
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
    /// Two tile sets `s` = 0, 1: `tmm{s}` = A, 16 × 32 bytes (16 tokens × one block's
    /// activation bytes); `tmm{2+s}` = B, 8 × 64 bytes (one block of 16 weight rows, VNNI
    /// layout); `tmm{4+s}` = C, 16 × 64 bytes (int32, tokens × rows).
    fn new() -> TileConfig {
        let mut c = TileConfig {
            palette: 1,
            start_row: 0,
            reserved: [0; 14],
            colsb: [0; 16],
            rows: [0; 16],
        };
        let tokens = T as u8;
        for s in 0..2 {
            (c.colsb[s], c.rows[s]) = (QK as u16, tokens);
            (c.colsb[2 + s], c.rows[2 + s]) = (64, (QK / 4) as u8);
            (c.colsb[4 + s], c.rows[4 + s]) = (64, tokens);
        }
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

/// Bytes of one B tile: 8 rows of 64.
const B_TILE_BYTES: usize = QK / 4 * 64;

/// One decoded block of 16 weight rows as a B tile: row `k` holds, at bytes `4r..4r+4`,
/// the table values of elements `4k..4k+4` of weight row `r` (what [`decode16`]'s `u[k]`
/// holds in lane `r`).
#[repr(C, align(64))]
struct BTile([u8; B_TILE_BYTES]);

/// The two C tiles' stores (one per tile set), `[token][row]`.
#[repr(C, align(64))]
struct CTiles([[i32; T * T]; 2]);

/// One block's exact integer sums on tile set `S` (0 or 1: A = `tmm{S}`, B = `tmm{2+S}`,
/// C = `tmm{4+S}`): `c[m][r] = Σ_k a[m][k] · b[k/4][4r + k%4]` for the 16 rows of 32 signed
/// bytes at `a` (`astride` bytes apart), the B tile at `b` and the int32
/// rows at `c` (64 bytes apart). Alternating sets lets one block's loads run while the
/// previous block's product is still reading its tiles.
#[inline(always)]
unsafe fn tile_block<const S: u8>(a: *const u8, astride: usize, b: *const u8, c: *mut i32) {
    // SAFETY: `a` holds 16 rows of 32 bytes `astride` apart, `b` 8 rows of 64 and
    // `c` room for 16 rows of 64 (the caller's contract); a configuration of `TileConfig::new`
    // is loaded, which gives the three tiles of set `S` these shapes.
    asm!(
        "tileloadd tmm{ta}, [{a} + {sa}*1]",
        "tileloadd tmm{tb}, [{b} + {sb}*1]",
        "tilezero tmm{tc}",
        "tdpbssd tmm{tc}, tmm{ta}, tmm{tb}",
        "tilestored [{c} + {sc}*1], tmm{tc}",
        ta = const S,
        tb = const S + 2,
        tc = const S + 4,
        a = in(reg) a,
        sa = in(reg) astride,
        b = in(reg) b,
        sb = in(reg) 64usize,
        c = in(reg) c,
        sc = in(reg) 64usize,
        options(nostack),
    );
}

/// Blocks of a row group decoded at a time: their B tiles (8 KB) and exponents stay in L1
/// while every token group of the pass runs over them.
const DEC_BLOCKS: usize = 16;
/// Tokens whose accumulators one pass over a row group carries from run to run.
const TOK_CHUNK: usize = 64;

/// `acc[m] = fma(f32(c[m][r]), scalef(d[m], ef[r]), acc[m])` for the 16 tokens `m` (lanes: the
/// rows `r`): the VNNI kernel's `block_fma`, so the same bits.
#[inline(always)]
unsafe fn fold(c: &[i32; T * T], ef: __m512, d: *const f32, acc: &mut [__m512; T]) {
    for (m, acc) in acc.iter_mut().enumerate() {
        let scale = _mm512_scalef_ps(_mm512_set1_ps(*d.add(m)), ef);
        let isum = _mm512_load_si512(c.as_ptr().add(m * T).cast());
        *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), scale, *acc);
    }
}

/// One token group (the tile's activation rows from `a`, `astride` bytes apart, at the run's
/// first block's bytes; their scales at `d`, `[block][token]` with `tp` tokens a block) over the
/// `nbc` decoded blocks, carrying its accumulators in `acc`. Block `i`'s tiles run on set
/// `i % 2` and are folded after block `i + 1`'s are issued, so the tile unit and the vector
/// units overlap.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn run_group(
    bt: &[BTile; DEC_BLOCKS],
    ef: &[__m512; DEC_BLOCKS],
    nbc: usize,
    (a, astride): (*const u8, usize),
    (d, tp): (*const f32, usize),
    c: &mut CTiles,
    acc: &mut [__m512; T],
) {
    let mut r = *acc;
    for (i, bt) in bt.iter().enumerate().take(nbc) {
        let (ai, bi) = (a.add(i * Q8_0_BYTES), bt.0.as_ptr());
        if i % 2 == 0 {
            tile_block::<0>(ai, astride, bi, c.0[0].as_mut_ptr());
        } else {
            tile_block::<1>(ai, astride, bi, c.0[1].as_mut_ptr());
        }
        if let Some(j) = i.checked_sub(1) {
            fold(&c.0[j % 2], ef[j], d.add(j * tp), &mut r);
        }
    }
    let j = nbc - 1;
    fold(&c.0[j % 2], ef[j], d.add(j * tp), &mut r);
    *acc = r;
}

/// Stores the accumulators of tokens `m` in `keep` (lanes: 16 rows) to `out` at token `m`
/// (`[row][token]`, rows `n_tokens` apart).
#[inline(always)]
unsafe fn store_tokens(acc: &[__m512; T], keep: Range<usize>, out: *mut f32, n_tokens: usize) {
    let mut tmp = [[0f32; T]; T];
    for (t, a) in tmp.iter_mut().zip(acc) {
        _mm512_storeu_ps(t.as_mut_ptr(), *a);
    }
    for (m, t) in tmp.iter().enumerate().take(keep.end).skip(keep.start) {
        for (r, &x) in t.iter().enumerate() {
            *out.add(r * n_tokens + m) = x;
        }
    }
}

/// The tiles' MXFP4 × Q8_0 GEMM ([`GemmFn`] contract) over rows in the file's layout or,
/// with `X16`, interleaved; bit-identical to `fallback` (the AVX-512 VNNI + VBMI kernel of
/// the same layout), which takes small batches and the rows short of a group of 16.
///
/// # Safety
/// [`amx_status`] is [`AmxStatus::Usable`] (AVX-512 F/BW/VL/VNNI/VBMI, AVX2, FMA and F16C
/// included); slices as in [`GemmFn`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx2,fma,f16c")]
unsafe fn mxfp4_amx<const X16: bool>(
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
    // The activations' block scales as f32, `[block][token]`, zero-padded to whole tiles.
    let tp = n_tokens.next_multiple_of(T);
    if blocks.block_scales.len() != nb * tp {
        // Not prepared for this kernel (`GemmKernel::gemm` refuses that before it gets here).
        return fallback(n, w, acts, blocks, n_tokens, out);
    }
    let ds = blocks.block_scales.as_ptr();
    // The signed table values: the tiles multiply signed by signed, so no bias.
    let table = nibble_table(KVALUES_MXFP4.as_ptr().cast());
    let mut bt: [BTile; DEC_BLOCKS] = core::array::from_fn(|_| BTile([0; B_TILE_BYTES]));
    let mut ef = [_mm512_setzero_ps(); DEC_BLOCKS];
    let mut c = CTiles([[0; T * T]; 2]);
    let mut acc = [[_mm512_setzero_ps(); T]; TOK_CHUNK / T];
    // A last group short of 16 is the last 16 tokens, of which it keeps the ones no earlier
    // group had: a tile never reads past the activations.
    let cfg = TileConfig::new();
    tile_config_load(&cfg);
    for tc in (0..n_tokens).step_by(TOK_CHUNK) {
        let groups = (n_tokens - tc).min(TOK_CHUNK).div_ceil(T);
        let group = |g: usize| {
            let t0 = tc + g * T;
            let first = t0.min(n_tokens.saturating_sub(T));
            (first, t0 - first..(n_tokens - first).min(T))
        };
        for r0 in (0..full).step_by(T) {
            let base = w.as_ptr().add(r0 * stride);
            let next = base.wrapping_add(T * stride);
            acc[..groups].fill([_mm512_setzero_ps(); T]);
            for b0 in (0..nb).step_by(DEC_BLOCKS) {
                let nbc = (nb - b0).min(DEC_BLOCKS);
                for (i, (bt, ef)) in bt.iter_mut().zip(&mut ef).take(nbc).enumerate() {
                    prefetch_group(next, b0 + i);
                    let (u, e) = decode16::<true, X16>(base, stride, nb, b0 + i, table);
                    for (k, u) in u.iter().enumerate() {
                        _mm512_store_si512(bt.0.as_mut_ptr().add(64 * k).cast(), *u);
                    }
                    *ef = e;
                }
                for (g, acc) in acc[..groups].iter_mut().enumerate() {
                    let (first, _) = group(g);
                    let at = (
                        acts.as_ptr().add(first * astride + b0 * Q8_0_BYTES + 2),
                        astride,
                    );
                    run_group(
                        &bt,
                        &ef,
                        nbc,
                        at,
                        (ds.add(b0 * tp + first), tp),
                        &mut c,
                        acc,
                    );
                }
            }
            for (g, acc) in acc[..groups].iter().enumerate() {
                let (first, keep) = group(g);
                store_tokens(
                    acc,
                    keep,
                    out.as_mut_ptr().add(r0 * n_tokens + first),
                    n_tokens,
                );
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

/// [`mxfp4_amx`] over the file's layout (`X16 = false`) or interleaved rows, with the AVX-512
/// VNNI + VBMI kernel of that layout as its fallback.
///
/// # Safety
/// As [`mxfp4_amx`].
unsafe fn mxfp4_amx_vnni<const X16: bool>(
    n: usize,
    w: &[u8],
    acts: &[u8],
    blocks: &ActBlocks,
    n_tokens: usize,
    out: &mut [f32],
) {
    let (_, fallback) = if X16 {
        crate::x86::avx512::gemm::gemm_fn_x16(true, true)
    } else {
        crate::x86::avx512::gemm::gemm_fn(crate::GgmlType::MXFP4, true, true)
    };
    mxfp4_amx::<X16>(n, w, acts, blocks, n_tokens, out, fallback)
}

/// The AMX MXFP4 GEMM over the file's layout (`interleaved = false`) or interleaved rows,
/// where [`amx_status`] is [`AmxStatus::Usable`] (`GemmKernel` takes it only when
/// `crate::amx_in_use`).
pub(crate) fn gemm_fn(interleaved: bool) -> Option<(&'static str, GemmFn)> {
    let f: (&'static str, GemmFn) = if interleaved {
        (
            "mxfp4*q8_0 blockwise x16/amx-int8+avx512vnni",
            mxfp4_amx_vnni::<true>,
        )
    } else {
        (
            "mxfp4*q8_0 blockwise/amx-int8+avx512vnni",
            mxfp4_amx_vnni::<false>,
        )
    };
    (*amx_status() == AmxStatus::Usable).then_some(f)
}
