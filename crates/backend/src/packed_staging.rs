//! The packed layout of an expert-boundary round trip's inputs: the normed hidden state, the
//! expert weights and the chosen experts' ids (as their bits) side by side in one buffer of
//! 32-bit words, so that one copy brings all three down ([`crate::Backend::stage_down`]).

use std::ops::Range;

use crate::BackendError;

/// Where each input of a round trip of `n_d` hidden values and `n_k` expert slots lies in
/// the packed buffer: `h` (`n_d` values), then `w` (`n_k`), then `sel` (`n_k` ids, each
/// stored as the `f32` with the id's bits).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PackedDown {
    /// Hidden values.
    pub n_d: usize,
    /// Expert slots.
    pub n_k: usize,
}

impl PackedDown {
    /// Words of the packed buffer.
    pub fn words(&self) -> usize {
        self.n_d + 2 * self.n_k
    }

    /// The hidden state's words.
    pub fn h(&self) -> Range<usize> {
        0..self.n_d
    }

    /// The weights' words.
    pub fn w(&self) -> Range<usize> {
        self.n_d..self.n_d + self.n_k
    }

    /// The ids' words.
    pub fn sel(&self) -> Range<usize> {
        self.n_d + self.n_k..self.words()
    }

    /// Checks that the inputs have the lengths the layout was made for.
    pub fn check(&self, h: usize, sel: usize, w: usize) -> Result<(), BackendError> {
        crate::error::ensure(
            h == self.n_d && sel == self.n_k && w == self.n_k,
            "stage_down",
            || {
                format!(
                    "h {h}, sel {sel}, w {w} for staging of {} and {}",
                    self.n_d, self.n_k
                )
            },
        )
    }

    /// Packs the inputs into `packed` (what a device on the host does in place of a copy
    /// kernel).
    pub fn pack(
        &self,
        packed: &mut [f32],
        h: &[f32],
        sel: &[i32],
        w: &[f32],
    ) -> Result<(), BackendError> {
        self.check(h.len(), sel.len(), w.len())?;
        crate::error::ensure(packed.len() == self.words(), "stage_down", || {
            format!("a packed buffer of {} for {}", packed.len(), self.words())
        })?;
        packed[self.h()].copy_from_slice(h);
        packed[self.w()].copy_from_slice(w);
        for (p, &s) in packed[self.sel()].iter_mut().zip(sel) {
            *p = f32::from_bits(s as u32);
        }
        Ok(())
    }

    /// The ids of a packed buffer that came down, into `sel`.
    pub fn unpack_sel(&self, packed: &[f32], sel: &mut [i32]) {
        for (s, p) in sel.iter_mut().zip(&packed[self.sel()]) {
            *s = p.to_bits() as i32;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packing_keeps_every_bit_of_the_three_inputs() {
        let l = PackedDown { n_d: 6, n_k: 4 };
        let h = [1.5, -0.0, f32::MIN_POSITIVE, 3.0, f32::NAN, -7.25];
        let sel = [3, -1, i32::MAX, 0];
        let w = [0.25, -0.0, 1e-30, 2.0];
        let mut packed = vec![0.0; l.words()];
        l.pack(&mut packed, &h, &sel, &w).unwrap();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&packed[l.h()]), bits(&h));
        assert_eq!(bits(&packed[l.w()]), bits(&w));
        let mut back = [7; 4];
        l.unpack_sel(&packed, &mut back);
        assert_eq!(back, sel);
        assert!(l.pack(&mut packed, &h[..5], &sel, &w).is_err());
    }
}
