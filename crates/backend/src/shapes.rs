//! Shape checks of the ops that every device runs before it computes, so that the devices
//! refuse the same calls with the same errors.

use crate::{BackendError, KOnlyAttnParams, Routing};

fn check(op: &'static str, ok: bool, what: impl FnOnce() -> String) -> Result<(), BackendError> {
    crate::error::ensure(ok, op, what)
}

/// [`crate::Backend::rope_norm`]: `n_pos` tokens of `n_heads` heads of `head_dim` in `x_len`
/// values, an even number `n_dims` of rotated dims from `first`, inside each head.
pub fn rope_norm(
    x_len: usize,
    n_pos: usize,
    n_heads: usize,
    head_dim: usize,
    first: usize,
    n_dims: usize,
) -> Result<(), BackendError> {
    check(
        "rope_norm",
        n_dims > 0
            && n_dims.is_multiple_of(2)
            && first.checked_add(n_dims).is_some_and(|e| e <= head_dim)
            && n_pos
                .checked_mul(n_heads)
                .and_then(|v| v.checked_mul(head_dim))
                .is_some_and(|v| v <= x_len),
        || {
            format!(
                "{n_dims} dims from {first} of {n_pos} × {n_heads} heads of {head_dim} in {x_len}"
            )
        },
    )
}

/// [`crate::Backend::matmul_heads`]: a matrix of `rows × cols` split into `n_heads` heads,
/// `n` tokens of inputs `x_stride` apart in `x_len` values, outputs in `y_len`. Returns the
/// rows per head.
pub fn matmul_heads(
    rows: usize,
    cols: usize,
    n: usize,
    n_heads: usize,
    x_stride: usize,
    x_len: usize,
    y_len: usize,
) -> Result<usize, BackendError> {
    let fits = |per: usize, len: usize| {
        n.checked_mul(n_heads)
            .and_then(|v| v.checked_mul(per))
            .is_some_and(|v| v <= len)
    };
    check(
        "matmul_heads",
        n_heads > 0
            && rows.is_multiple_of(n_heads)
            && x_stride >= cols
            && fits(x_stride, x_len)
            && fits(rows / n_heads.max(1), y_len),
        || {
            format!(
                "{rows}×{cols} in {n_heads} heads, {n} tokens of stride {x_stride}: x {x_len}, y {y_len}"
            )
        },
    )?;
    Ok(rows / n_heads)
}

/// [`crate::Backend::swiglu`]: rows of `n` in `gate_len` values, `up` at least as long.
pub fn swiglu(gate_len: usize, up_len: usize, n: usize) -> Result<(), BackendError> {
    check(
        "swiglu",
        n > 0 && gate_len.is_multiple_of(n) && up_len >= gate_len,
        || format!("gate {gate_len} / up {up_len} in rows of {n}"),
    )
}

/// [`crate::Backend::attention_k_only`]: queries, ring and output lengths for `n_tokens`
/// from `pos0` (every position the batch sees must still be in the ring), values of whole
/// blocks (and rotation chunks) of the ring's type.
pub fn attention_k_only(
    p: &KOnlyAttnParams,
    q_len: usize,
    ring: &crate::KvLayout,
    out_len: usize,
    n_tokens: usize,
    pos0: usize,
) -> Result<(), BackendError> {
    let (nh, kd, vd) = (p.n_head, p.k_dim, p.v_dim);
    let need = |a: usize, b: usize, c: usize| a.checked_mul(b).and_then(|v| v.checked_mul(c));
    check(
        "attention_k_only",
        nh > 0
            && kd > 0
            && vd <= kd
            && vd.is_multiple_of(ring.ty.block_elems())
            && (ring.rot == 0 || vd.is_multiple_of(ring.rot))
            && ring.width == kd
            && ring.cells == p.cells
            && pos0.checked_add(n_tokens).is_some_and(|e| e <= p.cells)
            && need(n_tokens, nh, kd).is_some_and(|v| v <= q_len)
            && need(n_tokens, nh, vd).is_some_and(|v| v <= out_len),
        || {
            format!(
                "{p:?} for {n_tokens} tokens from {pos0}: q {q_len}, ring {ring:?}, out {out_len}"
            )
        },
    )
}

/// [`crate::Backend::route`]: `routing` over `n_expert` experts (groups that split them evenly
/// and hold `k`), logits of whole rows, a bias of one value per expert, and room for `k`
/// choices per row. Returns the rows.
pub fn route(
    routing: &Routing,
    n_expert: usize,
    logits_len: usize,
    bias_len: Option<usize>,
    sel_len: usize,
    w_len: usize,
) -> Result<usize, BackendError> {
    let k = routing.k;
    let groups_ok = routing.groups.is_none_or(|(g, used)| {
        g > 0
            && n_expert.is_multiple_of(g)
            && used > 0
            && used <= g
            && (g == 1 || used * (n_expert / g) >= k)
    });
    let ok = n_expert > 0
        && (1..=n_expert).contains(&k)
        && groups_ok
        && logits_len.is_multiple_of(n_expert)
        && bias_len.is_none_or(|b| b == n_expert);
    check("route", ok, || format!("{routing:?} of {n_expert} experts"))?;
    let n = logits_len / n_expert;
    check("route", n * k <= sel_len && n * k <= w_len, || {
        format!("{n} rows of {k} choices into {sel_len} / {w_len}")
    })?;
    Ok(n)
}
