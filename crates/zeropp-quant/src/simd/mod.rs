//! Kernel selection and the per-block primitives every kernel implements.
//!
//! Each primitive has a portable scalar reference ([`scalar`]) and SIMD
//! versions (AVX2, AVX-512 on x86-64, NEON on aarch64) that produce
//! bit-identical results:
//! they perform the same IEEE f32 operations in the same order per element
//! (no FMA contraction), and reductions (max/min) are order-independent.
//! All `unsafe` code of the crate lives in the `avx2`, `avx512` and `neon`
//! modules.

pub(crate) mod scalar;

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "aarch64")]
mod neon;

use crate::error::{QuantError, Result};

/// A kernel implementation level. Results are bit-identical across levels;
/// only speed differs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Kernel {
    /// Portable scalar code (the reference).
    Scalar,
    /// x86-64 AVX2 (256-bit).
    Avx2,
    /// x86-64 AVX-512F (512-bit).
    Avx512,
    /// aarch64 NEON (128-bit Advanced SIMD).
    Neon,
}

impl Kernel {
    /// Every kernel this build knows about, available or not.
    pub const ALL: [Kernel; 4] = [Kernel::Scalar, Kernel::Avx2, Kernel::Avx512, Kernel::Neon];

    /// A short lowercase name (`scalar`, `avx2`, `avx512`, `neon`).
    pub const fn name(self) -> &'static str {
        match self {
            Kernel::Scalar => "scalar",
            Kernel::Avx2 => "avx2",
            Kernel::Avx512 => "avx512",
            Kernel::Neon => "neon",
        }
    }

    /// Whether this CPU (and build) can run the kernel (runtime detection).
    pub fn is_available(self) -> bool {
        match self {
            Kernel::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2 => std::arch::is_x86_feature_detected!("avx2"),
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512 => std::arch::is_x86_feature_detected!("avx512f"),
            #[cfg(target_arch = "aarch64")]
            Kernel::Neon => std::arch::is_aarch64_feature_detected!("neon"),
            _ => false,
        }
    }

    /// The fastest available kernel.
    pub fn best() -> Kernel {
        if Kernel::Avx512.is_available() {
            Kernel::Avx512
        } else if Kernel::Avx2.is_available() {
            Kernel::Avx2
        } else if Kernel::Neon.is_available() {
            Kernel::Neon
        } else {
            Kernel::Scalar
        }
    }
}

impl std::fmt::Display for Kernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The kernels this CPU can run, slowest (scalar) first.
pub fn available_kernels() -> Vec<Kernel> {
    Kernel::ALL.into_iter().filter(|k| k.is_available()).collect()
}

/// A kernel whose availability has been checked. Only [`Dispatch::resolve`]
/// constructs it, which is what makes the `unsafe` calls into
/// `#[target_feature]` functions below sound.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Dispatch(Kernel);

/// Stochastic-rounding parameters for one block: keys and the low 32 bits
/// of the first element's global index (the block never crosses a multiple
/// of 2^32, so the high bits are folded into the keys).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Stoch {
    pub(crate) k1: u32,
    pub(crate) k2: u32,
    pub(crate) lo: u32,
}

impl Dispatch {
    /// Checks `requested` (or picks the best kernel when `None`).
    pub(crate) fn resolve(requested: Option<Kernel>) -> Result<Self> {
        match requested {
            None => Ok(Self(Kernel::best())),
            Some(k) if k.is_available() => Ok(Self(k)),
            Some(k) => Err(QuantError::KernelUnavailable(k.name())),
        }
    }

    /// `max |x|` over `x`, or `None` if any element is NaN or ±Inf.
    /// `x` must be non-empty.
    #[inline]
    pub(crate) fn abs_max(self, x: &[f32]) -> Option<f32> {
        match self.0 {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `Dispatch` holds Avx2 only after `is_x86_feature_detected!("avx2")`.
            Kernel::Avx2 => unsafe { avx2::abs_max(x) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `Dispatch` holds Avx512 only after `is_x86_feature_detected!("avx512f")`.
            Kernel::Avx512 => unsafe { avx512::abs_max(x) },
            #[cfg(target_arch = "aarch64")]
            // SAFETY: `Dispatch` holds Neon only after `is_aarch64_feature_detected!("neon")`.
            Kernel::Neon => unsafe { neon::abs_max(x) },
            _ => scalar::abs_max(x),
        }
    }

    /// `(min, max)` over `x`, or `None` if any element is NaN or ±Inf.
    /// `x` must be non-empty.
    #[inline]
    pub(crate) fn min_max(self, x: &[f32]) -> Option<(f32, f32)> {
        match self.0 {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: availability checked in `resolve` (see `abs_max`).
            Kernel::Avx2 => unsafe { avx2::min_max(x) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: availability checked in `resolve` (see `abs_max`).
            Kernel::Avx512 => unsafe { avx512::min_max(x) },
            #[cfg(target_arch = "aarch64")]
            // SAFETY: `Dispatch` holds Neon only after `is_aarch64_feature_detected!("neon")`.
            Kernel::Neon => unsafe { neon::min_max(x) },
            _ => scalar::min_max(x),
        }
    }

    /// `out[i] = clamp(round_ties_even((x[i] - offset) * s), qmin, qmax)`.
    #[inline]
    pub(crate) fn round_nearest(self, x: &[f32], s: f32, offset: f32, qmin: f32, qmax: f32, out: &mut [u8]) {
        debug_assert_eq!(x.len(), out.len());
        match self.0 {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: availability checked in `resolve` (see `abs_max`).
            Kernel::Avx2 => unsafe { avx2::round_nearest(x, s, offset, qmin, qmax, out) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: availability checked in `resolve` (see `abs_max`).
            Kernel::Avx512 => unsafe { avx512::round_nearest(x, s, offset, qmin, qmax, out) },
            #[cfg(target_arch = "aarch64")]
            // SAFETY: `Dispatch` holds Neon only after `is_aarch64_feature_detected!("neon")`.
            Kernel::Neon => unsafe { neon::round_nearest(x, s, offset, qmin, qmax, out) },
            _ => scalar::round_nearest(x, s, offset, qmin, qmax, out),
        }
    }

    /// Stochastic rounding of `(x[i] - offset) * s`, clamped.
    #[inline]
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn round_stochastic(
        self,
        x: &[f32],
        s: f32,
        offset: f32,
        qmin: f32,
        qmax: f32,
        st: Stoch,
        out: &mut [u8],
    ) {
        debug_assert_eq!(x.len(), out.len());
        match self.0 {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: availability checked in `resolve` (see `abs_max`).
            Kernel::Avx2 => unsafe { avx2::round_stochastic(x, s, offset, qmin, qmax, st, out) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: availability checked in `resolve` (see `abs_max`).
            Kernel::Avx512 => unsafe { avx512::round_stochastic(x, s, offset, qmin, qmax, st, out) },
            #[cfg(target_arch = "aarch64")]
            // SAFETY: `Dispatch` holds Neon only after `is_aarch64_feature_detected!("neon")`.
            Kernel::Neon => unsafe { neon::round_stochastic(x, s, offset, qmin, qmax, st, out) },
            _ => scalar::round_stochastic(x, s, offset, qmin, qmax, st, out),
        }
    }

    /// `out[i] = q[i] as f32 * scale + offset`.
    #[inline]
    pub(crate) fn dequant(self, q: &[u8], scale: f32, offset: f32, out: &mut [f32]) {
        debug_assert_eq!(q.len(), out.len());
        match self.0 {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: availability checked in `resolve` (see `abs_max`).
            Kernel::Avx2 => unsafe { avx2::dequant(q, scale, offset, out) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: availability checked in `resolve` (see `abs_max`).
            Kernel::Avx512 => unsafe { avx512::dequant(q, scale, offset, out) },
            #[cfg(target_arch = "aarch64")]
            // SAFETY: `Dispatch` holds Neon only after `is_aarch64_feature_detected!("neon")`.
            Kernel::Neon => unsafe { neon::dequant(q, scale, offset, out) },
            _ => scalar::dequant(q, scale, offset, out),
        }
    }

    /// `acc[i] += q[i] as f32 * scale + offset`.
    #[inline]
    pub(crate) fn dequant_add(self, q: &[u8], scale: f32, offset: f32, acc: &mut [f32]) {
        debug_assert_eq!(q.len(), acc.len());
        match self.0 {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: availability checked in `resolve` (see `abs_max`).
            Kernel::Avx2 => unsafe { avx2::dequant_add(q, scale, offset, acc) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: availability checked in `resolve` (see `abs_max`).
            Kernel::Avx512 => unsafe { avx512::dequant_add(q, scale, offset, acc) },
            #[cfg(target_arch = "aarch64")]
            // SAFETY: `Dispatch` holds Neon only after `is_aarch64_feature_detected!("neon")`.
            Kernel::Neon => unsafe { neon::dequant_add(q, scale, offset, acc) },
            _ => scalar::dequant_add(q, scale, offset, acc),
        }
    }
    /// INT4 packing of whole pairs: `out[k] = (q[2k] << 4) | (q[2k+1] & 0xF)`
    /// for `k < out.len()`; `q` holds at least `2 * out.len()` bytes.
    #[inline]
    pub(crate) fn pack4(self, q: &[u8], out: &mut [u8]) {
        debug_assert!(q.len() >= 2 * out.len());
        match self.0 {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: availability checked in `resolve` (see `abs_max`).
            Kernel::Avx2 => unsafe { avx2::pack4(q, out) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: AVX2 detected at run time (cached) just before the call.
            Kernel::Avx512 if std::arch::is_x86_feature_detected!("avx2") => unsafe { avx2::pack4(q, out) },
            #[cfg(target_arch = "aarch64")]
            // SAFETY: availability checked in `resolve` (see `abs_max`).
            Kernel::Neon => unsafe { neon::pack4(q, out) },
            _ => scalar::pack4(q, out),
        }
    }

    /// INT4 unpacking of whole bytes: `out[2k]`, `out[2k+1]` are the
    /// sign-extended high and low nibbles of `data[k]` for `k < data.len()`;
    /// `out` holds at least `2 * data.len()` bytes.
    #[inline]
    pub(crate) fn unpack4(self, data: &[u8], out: &mut [u8]) {
        debug_assert!(out.len() >= 2 * data.len());
        match self.0 {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: availability checked in `resolve` (see `abs_max`).
            Kernel::Avx2 => unsafe { avx2::unpack4(data, out) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: AVX2 detected at run time (cached) just before the call.
            Kernel::Avx512 if std::arch::is_x86_feature_detected!("avx2") => unsafe {
                avx2::unpack4(data, out)
            },
            #[cfg(target_arch = "aarch64")]
            // SAFETY: availability checked in `resolve` (see `abs_max`).
            Kernel::Neon => unsafe { neon::unpack4(data, out) },
            _ => scalar::unpack4(data, out),
        }
    }
}
