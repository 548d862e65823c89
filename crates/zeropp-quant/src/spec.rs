//! Format descriptions (`Bits`, `Scheme`, `QuantSpec`) and run options.

use crate::error::{QuantError, Result};
use crate::simd::Kernel;

/// Bit width of the quantized integers.
///
/// Marked `#[non_exhaustive]` so that further widths (2-bit, 6-bit, ...) can
/// be added without breaking code that matches on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Bits {
    /// 4-bit integers in `[-8, 7]`, packed two per byte (even element in the
    /// high nibble).
    Int4,
    /// 8-bit integers in `[-128, 127]`, one per byte.
    Int8,
}

impl Bits {
    /// Number of bits per element.
    pub const fn bits(self) -> u32 {
        match self {
            Bits::Int4 => 4,
            Bits::Int8 => 8,
        }
    }

    /// The `Bits` value for a bit count, or [`QuantError::UnsupportedBits`].
    pub fn from_bits(bits: u32) -> Result<Self> {
        match bits {
            4 => Ok(Bits::Int4),
            8 => Ok(Bits::Int8),
            other => Err(QuantError::UnsupportedBits(other)),
        }
    }

    /// Smallest quantized value, `-2^(b-1)`.
    pub const fn qmin(self) -> i32 {
        -(1 << (self.bits() - 1))
    }

    /// Largest quantized value, `2^(b-1) - 1`.
    pub const fn qmax(self) -> i32 {
        (1 << (self.bits() - 1)) - 1
    }

    /// Bytes needed to store `len` packed elements (rounded up).
    pub const fn data_len(self, len: usize) -> usize {
        match self {
            Bits::Int4 => len / 2 + len % 2,
            Bits::Int8 => len,
        }
    }
}

/// How a group's real range maps onto the integer range.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Scheme {
    /// `s = 2^(b-1) / max|x|`; one scale per group (the formula of DeepSpeed's kernels).
    Symmetric,
    /// `s = 2^b / (max - min)`, `offset = (max + min) / 2`; a scale and an
    /// offset per group.
    Asymmetric,
}

impl Scheme {
    /// Whether the scheme stores a per-group offset.
    pub const fn has_offsets(self) -> bool {
        matches!(self, Scheme::Asymmetric)
    }
}

impl std::str::FromStr for Scheme {
    type Err = QuantError;

    /// Parses `sym`/`symmetric` or `asym`/`asymmetric`.
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "sym" | "symmetric" => Ok(Scheme::Symmetric),
            "asym" | "asymmetric" => Ok(Scheme::Asymmetric),
            other => Err(QuantError::UnsupportedScheme(other.to_owned())),
        }
    }
}

/// A complete quantization format: bit width, scheme and group size.
///
/// This is everything a reader needs to interpret quantized bytes; it is
/// stored in the wire header. Construct it with [`QuantSpec::new`], which
/// rejects a group size of 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct QuantSpec {
    bits: Bits,
    scheme: Scheme,
    group_size: usize,
}

impl QuantSpec {
    /// A validated spec. Errors on `group_size == 0` or a group size that
    /// does not fit in a `u32` (the wire header field).
    pub fn new(bits: Bits, scheme: Scheme, group_size: usize) -> Result<Self> {
        if group_size == 0 {
            return Err(QuantError::ZeroGroupSize);
        }
        if u32::try_from(group_size).is_err() {
            return Err(QuantError::GroupSizeTooLarge(group_size));
        }
        Ok(Self { bits, scheme, group_size })
    }

    /// Symmetric INT8 with the given group size.
    pub fn int8(group_size: usize) -> Result<Self> {
        Self::new(Bits::Int8, Scheme::Symmetric, group_size)
    }

    /// Symmetric INT4 with the given group size.
    pub fn int4(group_size: usize) -> Result<Self> {
        Self::new(Bits::Int4, Scheme::Symmetric, group_size)
    }

    /// The bit width.
    pub const fn bits(&self) -> Bits {
        self.bits
    }

    /// The scheme.
    pub const fn scheme(&self) -> Scheme {
        self.scheme
    }

    /// Elements per group (at least 1).
    pub const fn group_size(&self) -> usize {
        self.group_size
    }

    /// Number of groups for `len` elements (the last one may be partial).
    pub const fn num_groups(&self, len: usize) -> usize {
        len.div_ceil(self.group_size)
    }

    /// Bytes of packed integer data for `len` elements.
    pub const fn data_len(&self, len: usize) -> usize {
        self.bits.data_len(len)
    }
}

/// Rounding mode used when quantizing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum Rounding {
    /// Round to nearest, ties to even (DeepSpeed's `__float2int_rn`).
    #[default]
    NearestEven,
    /// Stochastic rounding: `q = floor(y) + [u < y - floor(y)]` with `u`
    /// uniform in `[0, 1)` from a counter-based hash of `(seed, element index)`.
    /// Deterministic for a seed, independent of threading and kernel, and
    /// unbiased before clamping (up to 2^-24).
    Stochastic {
        /// RNG seed.
        seed: u64,
    },
}

/// What quantizing does with a group that holds NaN or ±Inf.
///
/// The default refuses such input ([`crate::QuantError::NonFinite`], naming the
/// first bad element): a quantized value is never garbage. A caller that must
/// keep another framework's contract, where a non-finite gradient reaches its
/// owner and the user's own check skips the step (PyTorch FSDP2's
/// reduce-scatter, `GradScaler`), propagates instead: the group is encoded as
/// *poisoned* (its scale is NaN, its integers 0; [`crate::wire`]), decodes to
/// NaN in every element, and a sum that includes it (the fused
/// [`crate::dequant_reduce_quant`]) is poisoned in turn. Groups without a
/// non-finite value are encoded exactly as under [`NonFinite::Error`].
///
/// ```
/// use zeropp_quant::{dequantize, quantize, NonFinite, Options, QuantSpec};
/// let x = [1.0f32, f32::INFINITY, 3.0, 4.0];
/// let spec = QuantSpec::int8(2)?;
/// assert!(quantize(&x, spec, &Options::default()).is_err());
/// let opts = Options::default().with_non_finite(NonFinite::Propagate);
/// let y = dequantize(&quantize(&x, spec, &opts)?, &opts)?;
/// assert!(y[0].is_nan() && y[1].is_nan()); // the poisoned group
/// let clean = dequantize(&quantize(&x[2..], spec, &Options::default())?, &opts)?;
/// assert_eq!(&y[2..], &clean[..]); // the other group as ever
/// # Ok::<(), zeropp_quant::QuantError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum NonFinite {
    /// A non-finite element is an error (the default).
    #[default]
    Error,
    /// A group with a non-finite element is encoded as poisoned and decodes to NaN.
    Propagate,
}

/// Whether kernels may use several threads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum Parallelism {
    /// Use rayon's pool across groups when the input is at least
    /// [`PARALLEL_THRESHOLD_BYTES`] bytes (f32-equivalent); single thread below.
    #[default]
    Auto,
    /// Always run on the calling thread.
    SingleThread,
}

/// Inputs of at least this many bytes (counted as `len * 4`) are processed
/// in parallel under [`Parallelism::Auto`].
pub const PARALLEL_THRESHOLD_BYTES: usize = 256 * 1024;

/// Run options: rounding, kernel choice, threading and non-finite input.
///
/// `Options::default()` is nearest-even rounding, the best kernel the CPU
/// supports, automatic parallelism, and non-finite input as an error. Results never depend on the kernel
/// or the threading: they only change the speed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub struct Options {
    /// Rounding mode (only used when quantizing).
    pub rounding: Rounding,
    /// Forced kernel, or `None` for the best available one.
    pub kernel: Option<Kernel>,
    /// Threading policy.
    pub parallelism: Parallelism,
    /// What a non-finite input does (only used when quantizing).
    pub non_finite: NonFinite,
}

impl Options {
    /// Sets the rounding mode.
    #[must_use]
    pub fn with_rounding(mut self, rounding: Rounding) -> Self {
        self.rounding = rounding;
        self
    }

    /// Uses stochastic rounding with `seed`.
    #[must_use]
    pub fn stochastic(self, seed: u64) -> Self {
        self.with_rounding(Rounding::Stochastic { seed })
    }

    /// Forces a kernel (an unavailable one makes every call fail with
    /// [`QuantError::KernelUnavailable`]).
    #[must_use]
    pub fn with_kernel(mut self, kernel: Kernel) -> Self {
        self.kernel = Some(kernel);
        self
    }

    /// Sets the threading policy.
    #[must_use]
    pub fn with_parallelism(mut self, parallelism: Parallelism) -> Self {
        self.parallelism = parallelism;
        self
    }

    /// Sets what a non-finite input does ([`NonFinite`]).
    #[must_use]
    pub fn with_non_finite(mut self, non_finite: NonFinite) -> Self {
        self.non_finite = non_finite;
        self
    }

    /// Forces single-threaded execution.
    #[must_use]
    pub fn single_thread(self) -> Self {
        self.with_parallelism(Parallelism::SingleThread)
    }
}
