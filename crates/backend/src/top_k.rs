//! The best logits of a row ([`crate::Backend::top_k`]): the order they are ranked in
//! ([`top_k_key`]), the most a device returns ([`TOP_K_MAX`]), and the op over host slices
//! ([`top_k_rows`], REF0's and the CPU device's).
//!
//! The order is the host sampler's (`hmoe-engine`'s candidates: by value with
//! `f32::total_cmp`, largest first, ties to the lower id), except that every NaN ranks before
//! every number: a row that holds a NaN shows one in its first pair, so that a caller can
//! tell such a row from its best pair alone.

use crate::BackendError;

/// The most pairs [`crate::Backend::top_k`] returns per row.
pub const TOP_K_MAX: usize = 256;

/// `v`'s rank as an unsigned integer (larger ranks first): `f32::total_cmp`'s order with
/// every NaN at the top. Never 0 (no float maps there), so 0 can stand for "no value".
pub fn top_k_rank(v: f32) -> u32 {
    if v.is_nan() {
        return u32::MAX;
    }
    let b = v.to_bits();
    if b & 0x8000_0000 != 0 {
        !b
    } else {
        b | 0x8000_0000
    }
}

/// The key of `(id, v)` in [`crate::Backend::top_k`]'s order: larger keys rank first (by
/// [`top_k_rank`], then the lower id). Distinct ids give distinct keys, none of them 0.
pub fn top_k_key(v: f32, id: u32) -> u64 {
    (u64::from(top_k_rank(v)) << 32) | u64::from(u32::MAX - id)
}

/// The id a [`top_k_key`] was made from.
pub fn top_k_key_id(key: u64) -> u32 {
    u32::MAX - key as u32
}

/// The shape checks of [`crate::Backend::top_k`]: `logits` whole rows of `n_vocab`, `1 ≤ k ≤
/// min(n_vocab, TOP_K_MAX)`, `values` and `ids` holding `k` per row. Returns the rows.
pub fn top_k_shape(
    logits: usize,
    n_vocab: usize,
    k: usize,
    values: usize,
    ids: usize,
) -> Result<usize, BackendError> {
    const OP: &str = "top_k";
    crate::error::ensure(n_vocab > 0 && logits.is_multiple_of(n_vocab), OP, || {
        format!("{logits} logits are not whole rows of {n_vocab}")
    })?;
    crate::error::ensure(k >= 1 && k <= n_vocab.min(TOP_K_MAX), OP, || {
        format!("k = {k} for rows of {n_vocab} (at most {TOP_K_MAX})")
    })?;
    let n = logits / n_vocab;
    crate::error::ensure(values == n * k && ids == n * k, OP, || {
        format!("values {values} / ids {ids} for {n} rows of {k}")
    })?;
    Ok(n)
}

/// [`crate::Backend::top_k`] over host slices. One pass per row keeps at most `2k` keys that
/// rank before the `k`-th best seen so far, cut back to `k` whenever they fill.
pub fn top_k_rows(
    logits: &[f32],
    n_vocab: usize,
    k: usize,
    values: &mut [f32],
    ids: &mut [i32],
) -> Result<(), BackendError> {
    top_k_shape(logits.len(), n_vocab, k, values.len(), ids.len())?;
    let mut buf: Vec<u64> = Vec::with_capacity(2 * k);
    for (r, row) in logits.chunks_exact(n_vocab).enumerate() {
        buf.clear();
        let mut kth = 0u64;
        for (i, &v) in row.iter().enumerate() {
            let key = top_k_key(v, i as u32);
            if key <= kth {
                continue;
            }
            buf.push(key);
            if buf.len() == 2 * k {
                buf.select_nth_unstable_by(k - 1, |a, b| b.cmp(a));
                buf.truncate(k);
                kth = buf[k - 1];
            }
        }
        buf.sort_unstable_by(|a, b| b.cmp(a));
        for (j, &key) in buf[..k].iter().enumerate() {
            let id = top_k_key_id(key);
            values[r * k + j] = row[id as usize];
            ids[r * k + j] = id as i32;
        }
    }
    Ok(())
}

/// The logits one block of a device's first pass ranks (CUDA's `TK_CHUNK`; see
/// [`top_k_chunked`]).
pub const TOP_K_CHUNK: usize = 8192;

/// The scratch (i32 elements) of [`top_k_chunked`] for `n_rows` rows: every chunk's `k` best
/// keys, two i32 each.
pub fn top_k_chunked_scratch(n_rows: usize, n_vocab: usize, k: usize) -> usize {
    2 * n_rows * n_vocab.div_ceil(TOP_K_CHUNK) * k
}

/// [`crate::Backend::top_k`] in the two passes a GPU runs it in, over host slices (REF0's):
/// each chunk of [`TOP_K_CHUNK`] logits of a row ranked alone, its `k` best keys
/// ([`top_k_key`], low word first; 0 past the chunk's end) written to `scratch` (at least
/// [`top_k_chunked_scratch`] elements, whatever they held), then the row's `k` best of
/// those read back.
pub fn top_k_chunked(
    logits: &[f32],
    n_vocab: usize,
    k: usize,
    scratch: &mut [i32],
    values: &mut [f32],
    ids: &mut [i32],
) -> Result<(), BackendError> {
    let n = top_k_shape(logits.len(), n_vocab, k, values.len(), ids.len())?;
    let need = top_k_chunked_scratch(n, n_vocab, k);
    crate::error::ensure(scratch.len() >= need, "top_k", || {
        format!("scratch {} of {need}", scratch.len())
    })?;
    let n_chunks = n_vocab.div_ceil(TOP_K_CHUNK);
    let mut keys: Vec<u64> = Vec::new();
    for (r, row) in logits.chunks_exact(n_vocab).enumerate() {
        let part = &mut scratch[2 * r * n_chunks * k..][..2 * n_chunks * k];
        for (c, chunk) in row.chunks(TOP_K_CHUNK).enumerate() {
            keys.clear();
            let first = c * TOP_K_CHUNK;
            keys.extend((chunk.iter().enumerate()).map(|(i, &v)| top_k_key(v, (first + i) as u32)));
            keys.sort_unstable_by(|a, b| b.cmp(a));
            for (j, pair) in part[2 * c * k..][..2 * k].chunks_exact_mut(2).enumerate() {
                let key = keys.get(j).copied().unwrap_or(0);
                pair[0] = key as u32 as i32;
                pair[1] = (key >> 32) as u32 as i32;
            }
        }
        keys.clear();
        let pairs = part.chunks_exact(2);
        keys.extend(pairs.map(|p| u64::from(p[0] as u32) | (u64::from(p[1] as u32) << 32)));
        keys.retain(|&key| key != 0);
        keys.sort_unstable_by(|a, b| b.cmp(a));
        for (j, &key) in keys[..k].iter().enumerate() {
            let id = top_k_key_id(key);
            values[r * k + j] = row[id as usize];
            ids[r * k + j] = id as i32;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The sampler's order, NaNs first: what every device's `top_k` must give.
    fn by_sort(row: &[f32], k: usize) -> Vec<(i32, u32)> {
        let mut idx: Vec<usize> = (0..row.len()).collect();
        idx.sort_by(|&a, &b| {
            (row[b].is_nan().cmp(&row[a].is_nan()))
                .then(match row[a].is_nan() {
                    true => std::cmp::Ordering::Equal,
                    false => row[b].total_cmp(&row[a]),
                })
                .then(a.cmp(&b))
        });
        idx[..k]
            .iter()
            .map(|&i| (i as i32, row[i].to_bits()))
            .collect()
    }

    #[test]
    fn keys_follow_total_cmp_with_nans_first() {
        let vals = [
            f32::NEG_INFINITY,
            f32::MIN,
            -1.0,
            -f32::MIN_POSITIVE,
            -1e-45,
            -0.0,
            0.0,
            1e-45,
            1.0,
            f32::MAX,
            f32::INFINITY,
        ];
        for w in vals.windows(2) {
            assert!(top_k_rank(w[0]) < top_k_rank(w[1]), "{w:?}");
        }
        assert_eq!(top_k_rank(f32::NAN), u32::MAX);
        assert_eq!(top_k_rank(-f32::NAN), u32::MAX);
        assert!(top_k_key(1.0, 3) > top_k_key(1.0, 4));
        assert_eq!(top_k_key_id(top_k_key(-0.0, 77)), 77);
    }

    #[test]
    fn rows_equal_a_full_sort() {
        let mut x = 0x2545_F491_4F6C_DD1Du64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let special = [
            f32::NAN,
            -f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            0.0,
            -0.0,
            f32::MAX,
            1e-45,
        ];
        for n_vocab in [1, 2, 7, 64, 513, 3000, TOP_K_CHUNK + 1, 2 * TOP_K_CHUNK + 5] {
            for k in [1, 2, 5, 40, 256].into_iter().filter(|&k| k <= n_vocab) {
                let rows = 3;
                let logits: Vec<f32> = (0..rows * n_vocab)
                    .map(|_| match next() % 16 {
                        0 => special[(next() % 8) as usize],
                        // Few levels: many ties.
                        1..=8 => (next() % 5) as f32,
                        _ => (next() % 1000) as f32 / 7.0 - 60.0,
                    })
                    .collect();
                let (mut v, mut ids) = (vec![0f32; rows * k], vec![0i32; rows * k]);
                top_k_rows(&logits, n_vocab, k, &mut v, &mut ids).unwrap();
                // The two-pass form, over poisoned scratch, gives the same bits.
                let mut scratch = vec![-1i32; top_k_chunked_scratch(rows, n_vocab, k)];
                let (mut v2, mut ids2) = (vec![0f32; rows * k], vec![0i32; rows * k]);
                top_k_chunked(&logits, n_vocab, k, &mut scratch, &mut v2, &mut ids2).unwrap();
                assert_eq!(ids, ids2);
                assert!(v.iter().zip(&v2).all(|(a, b)| a.to_bits() == b.to_bits()));
                for r in 0..rows {
                    let got: Vec<(i32, u32)> = (0..k)
                        .map(|j| (ids[r * k + j], v[r * k + j].to_bits()))
                        .collect();
                    let row = &logits[r * n_vocab..][..n_vocab];
                    assert_eq!(got, by_sort(row, k), "{n_vocab} k={k} row {r}");
                }
            }
        }
        assert!(top_k_rows(&[0.0; 6], 3, 4, &mut [0.0; 8], &mut [0; 8]).is_err());
        assert!(top_k_rows(&[0.0; 6], 4, 1, &mut [0.0; 2], &mut [0; 2]).is_err());
        assert!(top_k_rows(&[0.0; 6], 3, 1, &mut [0.0; 1], &mut [0; 2]).is_err());
    }
}
