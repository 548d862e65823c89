//! Small deterministic random-number helpers (SplitMix64 stream and a
//! counter-based hash), shared by parameter init and data sampling.

/// The SplitMix64 finaliser: a bijective, well-mixing map on `u64`.
pub(crate) fn mix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Counter-based hash of a key tuple: the same keys always give the same word.
pub(crate) fn hash_keys(keys: &[u64]) -> u64 {
    let mut h = 0x243F_6A88_85A3_08D3_u64;
    for &k in keys {
        h = mix64(h ^ mix64(k));
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

    /// The next 64-bit word.
    pub(crate) fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
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
