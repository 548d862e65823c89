//! Counter-based RNG for stochastic rounding.
//!
//! The random bits for element `i` (global index in the quantized vector)
//! are a pure function of `(seed, i)`, so results do not depend on the
//! kernel, the tiling or the number of threads:
//!
//! ```text
//! z        = splitmix64(seed ^ splitmix64(i >> 32))
//! k1, k2   = low and high 32 bits of z
//! h        = lowbias32(lowbias32((i as u32) ^ k1) ^ k2)
//! u        = (h >> 8) * 2^-24                 // uniform on [0, 1), exact in f32
//! ```
//!
//! `lowbias32` is Chris Wellons' 32-bit integer hash
//! (`x ^= x >> 16; x *= 0x7feb352d; x ^= x >> 15; x *= 0x846ca68b; x ^= x >> 16`),
//! chosen because it only needs 32-bit multiplies, which AVX2 has.

/// SplitMix64 finalizer (Steele, Lea, Flood 2014): a bijective 64-bit mix.
/// The one copy in the workspace; other crates use it through this module.
///
/// ```
/// use zeropp_quant::rng::splitmix64;
/// assert_ne!(splitmix64(1), splitmix64(2));
/// ```
#[inline]
pub const fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A seed for one independent stochastic-rounding stream, derived from a base
/// `seed` and a list of keys (for example `[step, rank, hop]`): each key is
/// folded in with [`splitmix64`], so streams that differ in any key (or in the
/// position of a key) are unrelated.
///
/// ```
/// use zeropp_quant::rng::stream_seed;
/// let a = stream_seed(7, &[3, 0, 1]); // step 3, rank 0, hop 1
/// let b = stream_seed(7, &[3, 1, 1]); // step 3, rank 1, hop 1
/// assert_ne!(a, b);
/// assert_eq!(a, stream_seed(7, &[3, 0, 1]));
/// ```
pub fn stream_seed(seed: u64, keys: &[u64]) -> u64 {
    keys.iter()
        .fold(splitmix64(seed), |acc, &k| splitmix64(acc ^ splitmix64(k.wrapping_add(0xA076_1D64_78BD_642F))))
}

/// 32-bit integer hash "lowbias32".
#[inline]
pub(crate) const fn lowbias32(mut x: u32) -> u32 {
    x ^= x >> 16;
    x = x.wrapping_mul(0x7feb_352d);
    x ^= x >> 15;
    x = x.wrapping_mul(0x846c_a68b);
    x ^ (x >> 16)
}

/// The per-2^32-block keys `(k1, k2)` for `seed` and the high index bits.
#[inline]
pub(crate) const fn keys(seed: u64, hi: u32) -> (u32, u32) {
    let z = splitmix64(seed ^ splitmix64(hi as u64));
    (z as u32, (z >> 32) as u32)
}

/// The 32 random bits for low index bits `lo` under keys `(k1, k2)`.
#[inline]
pub(crate) const fn hash32(k1: u32, k2: u32, lo: u32) -> u32 {
    lowbias32(lowbias32(lo ^ k1) ^ k2)
}
