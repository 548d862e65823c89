//! The rounding parameters every kernel module takes (below them all).

/// How one block of f32 values becomes integers:
/// `q = clamp(round((x - offset) * s), qmin, qmax)`, where `round` is
/// round-to-nearest-even, or stochastic rounding when `stochastic` is set.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RoundParams {
    /// The multiplier `s` (the reciprocal of the stored scale).
    pub(crate) s: f32,
    /// Subtracted before scaling (0 for symmetric groups).
    pub(crate) offset: f32,
    /// The smallest integer, as f32.
    pub(crate) qmin: f32,
    /// The largest integer, as f32.
    pub(crate) qmax: f32,
    /// Stochastic rounding with these keys; nearest-even when `None`.
    pub(crate) stochastic: Option<Stoch>,
}

/// Stochastic-rounding parameters for one block: keys and the low 32 bits
/// of the first element's global index (the block never crosses a multiple
/// of 2^32, so the high bits are folded into the keys).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Stoch {
    pub(crate) k1: u32,
    pub(crate) k2: u32,
    pub(crate) lo: u32,
}
