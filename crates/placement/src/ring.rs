//! The op-offload ring: the device buffers that the routed experts of CPU layers stream
//! through when a large micro-batch runs them on a GPU (op offload), [`RING_SLOTS`] slices of
//! a layer's experts, one in use by the device's `moe` while the next is copied up. Its size is
//! part of the plan ([`crate::DeviceUsage::ring`]) and elastic: `--fit` shrinks it, down to one
//! expert per slice, before anything else.

/// Slots of the op-offload ring: one slice of a layer's experts in use by the device's `moe`,
/// the next one being copied up meanwhile.
pub const RING_SLOTS: u64 = 2;

/// The most experts in one slice of the op-offload ring.
pub const RING_MAX_SLICE_EXPERTS: u64 = 32;

/// The experts per slice the op-offload ring takes at most for layers of `n_expert` experts:
/// [`RING_MAX_SLICE_EXPERTS`], and never more than half a layer (rounded up), so that the ring
/// never holds more than one layer's experts.
pub fn ring_max_slice(n_expert: u64) -> u64 {
    n_expert
        .div_ceil(RING_SLOTS)
        .clamp(1, RING_MAX_SLICE_EXPERTS)
}

/// Bytes of an op-offload ring of `slice` experts per slice, for layers of `n_expert` experts
/// of `expert_bytes` each: [`RING_SLOTS`] slices, never more than a layer (two slices of a
/// layer of fewer experts are the whole layer).
pub fn ring_bytes(slice: u64, n_expert: u64, expert_bytes: u64) -> u64 {
    (RING_SLOTS * slice).min(n_expert) * expert_bytes
}

/// The experts per slice of a ring of `ring` bytes for layers of `n_expert` experts of
/// `expert_bytes` each: the most, up to [`ring_max_slice`], whose [`ring_bytes`] fit in `ring`;
/// at least 1 (one expert per slice is the smallest ring there is).
pub fn ring_slice_for(ring: u64, n_expert: u64, expert_bytes: u64) -> u64 {
    (1..=ring_max_slice(n_expert))
        .rev()
        .find(|&s| ring_bytes(s, n_expert, expert_bytes) <= ring)
        .unwrap_or(1)
}

/// The largest `x` in `lo..=hi` for which `ok(x)`, where `ok` holds up to some value and not
/// beyond; `None` when it does not hold at `lo`.
pub(crate) fn largest(lo: u64, hi: u64, ok: impl Fn(u64) -> bool) -> Option<u64> {
    if hi < lo || !ok(lo) {
        return None;
    }
    if ok(hi) {
        return Some(hi);
    }
    // ok(lo) and not ok(hi).
    let (mut lo, mut hi) = (lo, hi);
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if ok(mid) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    Some(lo)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_sizes() {
        // gpt-oss-120b: 128 experts, 32 a slice at most; 20b: 32 experts, 16 a slice.
        assert_eq!(ring_max_slice(128), 32);
        assert_eq!(ring_max_slice(32), 16);
        assert_eq!(ring_max_slice(5), 3);
        assert_eq!(ring_max_slice(1), 1);
        assert_eq!(ring_bytes(32, 128, 10), 640);
        // Never more than a layer.
        assert_eq!(ring_bytes(3, 5, 10), 50);
        assert_eq!(ring_bytes(1, 1, 10), 10);
        // The slice a ring of so many bytes holds, the largest one that fits.
        assert_eq!(ring_slice_for(640, 128, 10), 32);
        assert_eq!(ring_slice_for(10_000, 128, 10), 32);
        assert_eq!(ring_slice_for(639, 128, 10), 31);
        assert_eq!(ring_slice_for(20, 128, 10), 1);
        assert_eq!(ring_slice_for(0, 128, 10), 1);
        assert_eq!(ring_slice_for(50, 5, 10), 3);
        for (n, eb, ring) in [(128, 7, 3000), (32, 13, 100), (5, 10, 45), (256, 3, 1)] {
            let s = ring_slice_for(ring, n, eb);
            assert!(s == 1 || ring_bytes(s, n, eb) <= ring, "{n} {eb} {ring}");
            assert!(s == ring_max_slice(n) || ring_bytes(s + 1, n, eb) > ring);
        }
    }

    #[test]
    fn largest_finds_the_last_value_that_holds() {
        assert_eq!(largest(1, 32, |x| x <= 7), Some(7));
        assert_eq!(largest(1, 32, |x| x <= 40), Some(32));
        assert_eq!(largest(1, 32, |_| false), None);
        assert_eq!(largest(0, 0, |x| x == 0), Some(0));
        assert_eq!(largest(5, 4, |_| true), None);
    }
}
