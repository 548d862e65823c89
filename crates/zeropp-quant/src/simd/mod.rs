//! Kernel selection and the per-block primitives every kernel implements.
//!
//! Each primitive has a portable scalar reference ([`scalar`]) and SIMD
//! versions (AVX2, AVX-512 on x86-64, NEON on aarch64) that produce
//! bit-identical results:
//! they perform the same IEEE f32 operations in the same order per element
//! (no FMA contraction), and reductions (max/min) are order-independent.
//! All `unsafe` code of the crate lives in the `avx2`, `avx512` and `neon`
//! modules, and in the one dispatch point, `dispatch!`.
//!
//! Every kernel module has the same functions with the same signatures
//! (`abs_max`, `min_max`, `round_nearest`, `round_stochastic`, `dequant`,
//! `dequant_add`, `pack4`, `unpack4`, `fwht`), so [`Dispatch`] forwards each call
//! with one macro. The vector ISAs share their reduction and rounding
//! bodies (the `vector` module), AVX2 and AVX-512 also their dequantization
//! loop (the `x86` module); each supplies only its lane operations.

mod params;
pub(crate) mod scalar;

pub(crate) use params::{RoundParams, Stoch};

/// Defines `dequant` and `dequant_add` in a vector kernel module from its
/// `dequant_into::<ADD>` (one loop for both; `$feature` is the module's
/// target feature).
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
macro_rules! dequant_entry_points {
    ($feature:literal) => {
        #[target_feature(enable = $feature)]
        pub(super) fn dequant(q: &[u8], scale: f32, offset: f32, out: &mut [f32]) {
            dequant_into::<false>(q, scale, offset, out);
        }

        #[target_feature(enable = $feature)]
        pub(super) fn dequant_add(q: &[u8], scale: f32, offset: f32, acc: &mut [f32]) {
            dequant_into::<true>(q, scale, offset, acc);
        }
    };
}

/// Runs `$block` (an expression in `$i`) for `$i = 0, $step, 2·$step, …`
/// below `$n - $n % $step`, and evaluates to that bound (the elements the
/// blocks covered).
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
macro_rules! whole_blocks {
    ($n:expr, $step:expr, |$i:ident| $block:expr) => {{
        let body = $n - $n % $step;
        let mut $i = 0;
        while $i < body {
            $block;
            $i += $step;
        }
        body
    }};
}

/// Defines `pack4` and `unpack4` in a vector kernel module from its block
/// kernels: `pack_block(q, out, i)` packs the `$pack` pairs of
/// `q[2i..2i + 2·$pack]` into `out[i..i + $pack]`, `unpack_block(data, out,
/// i)` unpacks `data[i..i + $unpack]` into `out[2i..2i + 2·$unpack]`; whole
/// blocks go through them, the rest through the scalar kernels.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
macro_rules! int4_entry_points {
    ($feature:literal, pack: $pack:literal, unpack: $unpack:literal) => {
        /// INT4 packing: `out[k] = (q[2k] << 4) | (q[2k+1] & 0xF)` for every `k`
        /// of `out` (`q` holds at least `2 * out.len()` bytes).
        #[target_feature(enable = $feature)]
        pub(super) fn pack4(q: &[u8], out: &mut [u8]) {
            let n = out.len().min(q.len() / 2);
            let body = whole_blocks!(n, $pack, |i| pack_block(q, out, i));
            scalar::pack4(&q[2 * body..2 * n], &mut out[body..n]);
        }

        /// INT4 unpacking: `out[2k]` and `out[2k+1]` are the sign-extended high and
        /// low nibbles of `data[k]` (`out` holds at least `2 * data.len()` bytes).
        #[target_feature(enable = $feature)]
        pub(super) fn unpack4(data: &[u8], out: &mut [u8]) {
            let n = data.len().min(out.len() / 2);
            let body = whole_blocks!(n, $unpack, |i| unpack_block(data, out, i));
            scalar::unpack4(&data[body..n], &mut out[2 * body..2 * n]);
        }
    };
}

/// Defines `$load(c, at)` and `$store(c, at, v)`: one vector of `$lanes`
/// floats from or to `c[at..at + $lanes]`, the unaligned access behind an
/// assert that keeps it in bounds (`$feature` is the module's target feature).
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
macro_rules! float_load_store {
    ($feature:literal, $v:ty, $lanes:literal, $load:ident: $ld:path, $store:ident: $st:path) => {
        #[doc = concat!("Loads ", $lanes, " floats from `c[at..at + ", $lanes, "]`.")]
        #[inline]
        #[target_feature(enable = $feature)]
        fn $load(c: &[f32], at: usize) -> $v {
            assert!(at + $lanes <= c.len());
            // SAFETY: the assert above keeps the unaligned load in bounds.
            unsafe { $ld(c.as_ptr().add(at)) }
        }

        #[doc = concat!("Stores ", $lanes, " floats to `c[at..at + ", $lanes, "]`.")]
        #[inline]
        #[target_feature(enable = $feature)]
        fn $store(c: &mut [f32], at: usize, v: $v) {
            assert!(at + $lanes <= c.len());
            // SAFETY: the assert above keeps the unaligned store in bounds.
            unsafe { $st(c.as_mut_ptr().add(at), v) }
        }

        /// The unchecked accesses of a hot loop that proves its own bounds
        /// (the Hadamard kernel's passes).
        mod raw {
            use super::*;

            #[doc = concat!("Loads ", $lanes, " floats at `p + at`.")]
            ///
            /// # Safety
            #[doc = concat!("`p + at .. p + at + ", $lanes, "` lies in one live allocation of f32.")]
            #[inline]
            #[target_feature(enable = $feature)]
            pub(super) unsafe fn load(p: *const f32, at: usize) -> $v {
                // SAFETY: the caller keeps the range in bounds.
                unsafe { $ld(p.add(at)) }
            }

            #[doc = concat!("Stores ", $lanes, " floats at `p + at`.")]
            ///
            /// # Safety
            #[doc = concat!("`p + at .. p + at + ", $lanes, "` lies in one live, writable allocation of f32.")]
            #[inline]
            #[target_feature(enable = $feature)]
            pub(super) unsafe fn store(p: *mut f32, at: usize, v: $v) {
                // SAFETY: the caller keeps the range in bounds.
                unsafe { $st(p.add(at), v) }
            }
        }
    };
}

#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
#[macro_use]
mod vector;
#[cfg(target_arch = "x86_64")]
#[macro_use]
mod x86;

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
/// `#[target_feature]` functions in `dispatch!` sound.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Dispatch(Kernel);

/// Calls kernel function `$f` of the module that `$d` (a [`Dispatch`])
/// selects. Every kernel module defines every function, so this is the one
/// place that turns a checked [`Kernel`] into an `unsafe` call.
macro_rules! dispatch {
    ($d:expr, $f:ident($($arg:expr),* $(,)?)) => {
        match $d.0 {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `Dispatch` holds Avx2 only after `is_x86_feature_detected!("avx2")`.
            Kernel::Avx2 => unsafe { avx2::$f($($arg),*) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `Dispatch` holds Avx512 only after `is_x86_feature_detected!("avx512f")`.
            Kernel::Avx512 => unsafe { avx512::$f($($arg),*) },
            #[cfg(target_arch = "aarch64")]
            // SAFETY: `Dispatch` holds Neon only after `is_aarch64_feature_detected!("neon")`.
            Kernel::Neon => unsafe { neon::$f($($arg),*) },
            _ => scalar::$f($($arg),*),
        }
    };
}

impl Dispatch {
    /// The portable scalar kernel (always available).
    pub(crate) const fn scalar() -> Self {
        Self(Kernel::Scalar)
    }

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
        dispatch!(self, abs_max(x))
    }

    /// `(min, max)` over `x`, or `None` if any element is NaN or ±Inf.
    /// `x` must be non-empty.
    #[inline]
    pub(crate) fn min_max(self, x: &[f32]) -> Option<(f32, f32)> {
        dispatch!(self, min_max(x))
    }

    /// `out[i] = clamp(round((x[i] - p.offset) * p.s), p.qmin, p.qmax)` as
    /// two's complement bytes, rounding as `p.stochastic` says (element `i`
    /// draws the random number of index `p.stochastic.lo + i`).
    #[inline]
    pub(crate) fn round(self, x: &[f32], p: &RoundParams, out: &mut [u8]) {
        debug_assert_eq!(x.len(), out.len());
        match p.stochastic {
            None => dispatch!(self, round_nearest(x, p, out)),
            Some(st) => dispatch!(self, round_stochastic(x, p, st, out)),
        }
    }

    /// The randomized Walsh–Hadamard transform of one group `x` (a power-of-two
    /// length), in place: forward, flip the sign of `x[k]` where bit `k` of
    /// `signs` is set, then the butterfly stages `h = 1, 2, …, n/2`, then
    /// multiply by `scale`; inverse, the stages, the scale, then the flip.
    #[inline]
    pub(crate) fn fwht(self, x: &mut [f32], signs: &[u32], scale: f32, inverse: bool) {
        debug_assert!(x.len().is_power_of_two());
        debug_assert!(signs.len() * 32 >= x.len());
        dispatch!(self, fwht(x, signs, scale, inverse))
    }

    /// `out[i] = hash32(k1, k2, lo + i)` (wrapping), the sign words of the
    /// Hadamard rotation (see [`crate::rng`] for `hash32`).
    #[inline]
    pub(crate) fn hash_words(self, k1: u32, k2: u32, lo: u32, out: &mut [u32]) {
        dispatch!(self, hash_words(k1, k2, lo, out))
    }

    /// Asks the CPU to start loading `x` into the cache (a hint: no effect on
    /// results). The quantizers call it on the next group before the second pass
    /// over the current one, so the memory reads of one group overlap the
    /// rounding of the other instead of waiting behind it.
    #[inline]
    pub(crate) fn prefetch(self, x: &[f32]) {
        #[cfg(target_arch = "x86_64")]
        avx2::prefetch(x);
        #[cfg(not(target_arch = "x86_64"))]
        let _ = x;
    }

    /// `out[i] = q[i] as f32 * scale + offset`.
    #[inline]
    pub(crate) fn dequant(self, q: &[u8], scale: f32, offset: f32, out: &mut [f32]) {
        debug_assert_eq!(q.len(), out.len());
        dispatch!(self, dequant(q, scale, offset, out))
    }

    /// `acc[i] += q[i] as f32 * scale + offset`.
    #[inline]
    pub(crate) fn dequant_add(self, q: &[u8], scale: f32, offset: f32, acc: &mut [f32]) {
        debug_assert_eq!(q.len(), acc.len());
        dispatch!(self, dequant_add(q, scale, offset, acc))
    }

    /// INT4 packing of whole pairs: `out[k] = (q[2k] << 4) | (q[2k+1] & 0xF)`
    /// for `k < out.len()`; `q` holds at least `2 * out.len()` bytes.
    #[inline]
    pub(crate) fn pack4(self, q: &[u8], out: &mut [u8]) {
        debug_assert!(q.len() >= 2 * out.len());
        dispatch!(self, pack4(q, out))
    }

    /// INT4 unpacking of whole bytes: `out[2k]`, `out[2k+1]` are the
    /// sign-extended high and low nibbles of `data[k]` for `k < data.len()`;
    /// `out` holds at least `2 * data.len()` bytes.
    #[inline]
    pub(crate) fn unpack4(self, data: &[u8], out: &mut [u8]) {
        debug_assert!(out.len() >= 2 * data.len());
        dispatch!(self, unpack4(data, out))
    }
}
