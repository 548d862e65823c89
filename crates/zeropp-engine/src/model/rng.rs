//! Small deterministic random-number helpers (SplitMix64 stream and a
//! counter-based hash), shared by parameter init and data sampling.
//!
//! The SplitMix64 mix itself is [`zeropp_quant::rng::splitmix64`], the one
//! copy in the workspace.

use zeropp_quant::rng::splitmix64;

/// The SplitMix64 stream increment (the golden-ratio constant).
const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// Counter-based hash of a key tuple: the same keys always give the same word.
pub(crate) fn hash_keys(keys: &[u64]) -> u64 {
    let mut h = 0x243F_6A88_85A3_08D3_u64;
    for &k in keys {
        h = splitmix64(h ^ splitmix64(k));
    }
    h
}

/// Uniform integer in `0..n` (`n > 0`) from a 64-bit word (Lemire's multiply-high).
pub(crate) fn below(word: u64, n: usize) -> usize {
    ((u128::from(word) * n as u128) >> 64) as usize
}

/// A sequential SplitMix64 generator.
#[derive(Debug, Clone)]
pub(crate) struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    /// A generator whose stream is fixed by `keys`.
    pub(crate) fn from_keys(keys: &[u64]) -> Self {
        Self { state: hash_keys(keys) }
    }

    /// The next 64-bit word: the mix of the current state (`splitmix64` adds
    /// the increment itself), then the state advances by the increment.
    pub(crate) fn next_u64(&mut self) -> u64 {
        let z = splitmix64(self.state);
        self.state = self.state.wrapping_add(GOLDEN);
        z
    }

    /// Uniform in `[0, 1)` with 53 bits of precision.
    pub(crate) fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform integer in `0..n` (`n > 0`).
    pub(crate) fn below(&mut self, n: usize) -> usize {
        below(self.next_u64(), n)
    }

    /// A standard normal sample (Box-Muller, one value per call).
    pub(crate) fn normal(&mut self) -> f64 {
        // 1 - u is in (0, 1], so the logarithm is finite.
        let u1 = 1.0 - self.next_f64();
        let u2 = self.next_f64();
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Words pinned from the engine's former private SplitMix64 copies: parameter
    /// init and data sampling must not change now that the mix is shared.
    #[test]
    fn outputs_unchanged() {
        assert_eq!(hash_keys(&[]), 0x243f_6a88_85a3_08d3);
        assert_eq!(hash_keys(&[1, 2, 3]), 0xe234_b8e7_6620_09c0);
        assert_eq!(hash_keys(&[7, 0x1417, 5, 9]), 0x8323_b949_fdb1_6343);
        let mut r = SplitMix64::from_keys(&[42, 7]);
        let words: Vec<u64> = (0..4).map(|_| r.next_u64()).collect();
        assert_eq!(
            words,
            [0xe508_d8b6_6d53_eb41, 0x23fe_6396_137b_4842, 0xba84_5fe9_c10b_cbb5, 0xb748_6188_db02_8f67]
        );
    }
}
