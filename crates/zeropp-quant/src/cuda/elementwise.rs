//! [`Elementwise`]: the element-wise kernels of zeropp-comm's device reductions.

/// An element-wise kernel of [`Gpu::elementwise_at`](super::Gpu::elementwise_at) (zeropp-comm's device
/// collectives): device addresses and a length in elements.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Elementwise {
    /// `acc[i] += src[i]` over `n` f32.
    AddF32 {
        /// `n` f32.
        src: u64,
        /// `n` f32, in place.
        acc: u64,
    },
    /// `acc[i] += f32(src[i])` over `n` bf16 addends.
    AddBf16 {
        /// `n` bf16.
        src: u64,
        /// `n` f32, in place.
        acc: u64,
    },
    /// `x[i] /= by` over `n` f32.
    DivF32 {
        /// `n` f32, in place.
        x: u64,
        /// Divisor.
        by: f32,
    },
    /// qgZ error feedback: `res[i] = beta·res[i] + (1 − beta)·(comp[i] − deq[i])`
    /// over `n` f32, in Rust's evaluation order.
    Feedback {
        /// `n` f32: what was quantized.
        comp: u64,
        /// `n` f32: its dequantized value.
        deq: u64,
        /// `n` f32 residual, in place.
        res: u64,
        /// The moving-average factor.
        beta: f32,
    },
    /// `out[i] = bf16(src[i])`, nearest even (as `half::bf16::from_f32`).
    ToBf16 {
        /// `n` f32.
        src: u64,
        /// `n` bf16.
        out: u64,
    },
}
