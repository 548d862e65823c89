//! # zeropp-quant
//!
//! Block quantization for ZeRO++ communication (qwZ weights, qgZ gradients):
//! formats, a versioned wire encoding and fast CPU kernels.
//!
//! ## Formats
//!
//! A vector of `len` elements is cut into contiguous groups of
//! `group_size` elements (the last group may be partial). Each group gets
//! its own parameters, computed in f32 with the formulas of DeepSpeed's
//! kernels (as read from their source; the crate's fixed test vectors come
//! from our own Python emulation of those formulas, not from DeepSpeed):
//!
//! * **Symmetric** ([`Scheme::Symmetric`]), `b` bits: `amax = max|x|`,
//!   `s = 2^(b-1) / amax` (`s = 1` when `amax = 0`),
//!   `q = clamp(round_ties_even(x·s), -2^(b-1), 2^(b-1)-1)`. The stored scale
//!   is `1/s`; dequantization is `x̂ = q · (1/s)`.
//! * **Asymmetric** ([`Scheme::Asymmetric`]): `s = 2^b / (max - min)`
//!   (`s = 1` when `max == min`), `offset = (max + min) / 2`,
//!   `q = clamp(round_ties_even((x - offset)·s), ...)`. Stored: `1/s` and
//!   `offset`; `x̂ = q · (1/s) + offset`.
//!
//! The group maximum maps to `2^(b-1)`, one step past the largest integer, so
//! it is clipped to `2^(b-1)-1` (error up to one scale step); every other
//! element is within half a step. Only for inputs so extreme that `s` would
//! overflow (`amax` below ~1e-37, or an asymmetric range above `f32::MAX`)
//! is `s` kept finite, a case DeepSpeed leaves to inf/NaN arithmetic.
//!
//! * **INT8** ([`Bits::Int8`]): one two's-complement byte per element.
//! * **INT4** ([`Bits::Int4`]): two per byte over the whole vector, even
//!   element in the high nibble: `byte_k = (q_2k & 0xF) << 4 | (q_2k+1 & 0xF)`.
//!
//! Rounding is round-to-nearest-even by default, or stochastic
//! ([`Rounding::Stochastic`]) with a counter-based RNG keyed by
//! `(seed, element index)`: deterministic for a seed, independent of threads
//! and kernels, unbiased before clamping.
//!
//! Inputs may be `f32`, [`half::bf16`] or [`half::f16`]; NaN/±Inf input is
//! an error naming the first bad index, unless [`Options::non_finite`] asks
//! to propagate it ([`NonFinite::Propagate`]: the group is encoded as
//! poisoned and decodes to NaN). Outputs dequantize to any of them.
//!
//! ## Operations
//!
//! [`quantize`], [`dequantize`], [`dequantize_add`] (accumulate into f32)
//! and the fused qgZ kernel [`dequant_reduce_quant`], each with variants
//! that write into caller buffers without allocating ([`quantize_into`],
//! [`quantize_to_wire`], [`dequantize_into`], [`dequant_reduce_quant_into`],
//! [`dequant_reduce_quant_to_wire`]). Dequantizing functions accept an owned
//! [`Quantized`] or a zero-copy [`QuantizedRef`] parsed from received wire
//! bytes. The wire layout is documented byte by byte in [`wire`].
//!
//! ## Hadamard smoothing
//!
//! [`hadamard`] rotates each group by a seeded, randomized Walsh–Hadamard
//! transform before quantizing ([`hadamard::quantize_hadamard_to_wire`]) and
//! back after dequantizing, which spreads an outlier's mass over its group
//! (SDP4Bit's gradient smoothing). It is linear, so encodings of the same
//! positions are summed in the rotated domain by the ordinary fused kernel.
//!
//! ## GPU
//!
//! With the `cuda` feature, `zeropp_quant::cuda` runs the same operations on an NVIDIA GPU,
//! bit-identical to the CPU kernels, on device buffers in the wire layout.
//!
//! ## Kernels and threads
//!
//! Kernels are chosen at run time ([`Kernel::best`]): AVX-512F or AVX2 on
//! x86-64, NEON on aarch64, portable scalar code elsewhere. All levels give bit-identical
//! results; [`Options::with_kernel`] forces one (tests compare each against
//! the scalar reference). Inputs of at least [`PARALLEL_THRESHOLD_BYTES`]
//! are split across rayon's pool at group boundaries, unless
//! [`Options::single_thread`] is set. Results never depend on either choice.
//!
//! ```
//! use zeropp_quant::{dequantize, quantize, Options, QuantSpec};
//! let x: Vec<f32> = (0..4096).map(|i| (i as f32).cos()).collect();
//! let q = quantize(&x, QuantSpec::int4(128)?, &Options::default())?;
//! assert_eq!(q.data().len(), 2048);
//! let y = dequantize(&q, &Options::default())?;
//! assert!(x.iter().zip(&y).all(|(a, b)| (a - b).abs() <= 1.0 / 8.0 + 1e-6));
//! # Ok::<(), zeropp_quant::QuantError>(())
//! ```

mod core;
#[cfg(feature = "cuda")]
pub mod cuda;
mod element;
mod error;
pub mod hadamard;
mod ops;
mod quantized;
pub mod rng;
mod simd;
mod spec;
#[cfg(feature = "tools")]
pub mod tools;
pub mod wire;
mod wire_header;

pub use element::Element;
pub use error::{DecodeError, QuantError, Result};
pub use hadamard::Hadamard;
pub use ops::{
    dequant_reduce_quant, dequant_reduce_quant_into, dequant_reduce_quant_to_wire, dequantize,
    dequantize_add, dequantize_into, quantize, quantize_into, quantize_to_wire,
};
pub use quantized::{AsQuantizedRef, Quantized, QuantizedRef};
pub use simd::{Kernel, available_kernels};
pub use spec::{
    Bits, NonFinite, Options, PARALLEL_THRESHOLD_BYTES, Parallelism, QuantSpec, Rounding, Scheme,
};
pub use wire::encoded_len;

/// Re-export of the `half` crate, for the `bf16` / `f16` element types.
pub use half;

/// The README's examples, run as doc tests, so the page a registry shows stays true.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
