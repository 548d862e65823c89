//! The crate's single error type.

/// Everything that can go wrong in `zeropp-quant`.
///
/// Every fallible function of the crate returns this error; none of them
/// panics on bad input.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum QuantError {
    /// A group size of 0 was requested.
    #[error("invalid group size 0: group_size must be at least 1")]
    ZeroGroupSize,
    /// The group size does not fit the wire format (it must fit in a `u32`).
    #[error("group size {0} is too large (at most {max})", max = u32::MAX)]
    GroupSizeTooLarge(usize),
    /// A bit width the crate does not implement.
    #[error("unsupported bit width {0} (supported: 4, 8)")]
    UnsupportedBits(u32),
    /// A scheme name or code the crate does not know.
    #[error("unsupported quantization scheme {0:?}")]
    UnsupportedScheme(String),
    /// The input holds NaN or ±Inf; `index` is the first such element.
    #[error("non-finite input value {value} at index {index}")]
    NonFinite {
        /// Index of the first non-finite element.
        index: usize,
        /// The offending value (as f32).
        value: f32,
    },
    /// Two buffers that must agree in length do not.
    #[error("length mismatch for {what}: expected {expected}, got {actual}")]
    LengthMismatch {
        /// Which buffer.
        what: &'static str,
        /// The length required.
        expected: usize,
        /// The length given.
        actual: usize,
    },
    /// An output buffer is too small.
    #[error("buffer too small for {what}: need {needed} bytes, got {actual}")]
    BufferTooSmall {
        /// Which buffer.
        what: &'static str,
        /// Bytes needed.
        needed: usize,
        /// Bytes available.
        actual: usize,
    },
    /// `dequant_reduce_quant` was given no inputs.
    #[error("dequant_reduce_quant needs at least one input")]
    NoInputs,
    /// A kernel was forced that this CPU (or build) cannot run.
    #[error("kernel {0} is not available on this CPU")]
    KernelUnavailable(&'static str),
    /// The size of a quantized buffer overflows `usize`.
    #[error("length {0} is too large to quantize on this platform")]
    TooLarge(u64),
    /// A Hadamard rotation needs a power-of-two group of at most
    /// [`crate::hadamard::MAX_GROUP`] elements.
    #[error("a Hadamard rotation needs a power-of-two group size of at most {max}, got {got}")]
    HadamardGroupSize {
        /// The group size asked for.
        got: usize,
        /// The largest group a rotation supports.
        max: usize,
    },
    /// A Hadamard rotation's groups differ from the quantization groups it is
    /// used with.
    #[error(
        "the Hadamard rotation's groups ({rotation} elements) differ from the quantization groups ({spec})"
    )]
    HadamardMismatch {
        /// The rotation's group size.
        rotation: usize,
        /// The spec's group size.
        spec: usize,
    },
    /// An option this implementation does not offer (the GPU kernels do not
    /// propagate non-finite input: [`crate::NonFinite::Propagate`]).
    #[error("not supported here: {0}")]
    Unsupported(&'static str),
    /// Wire decoding failed: the buffer is not a valid encoding.
    #[error("invalid quantized encoding: {0}")]
    Decode(#[from] DecodeError),
    /// A CUDA driver call failed (feature `cuda`): no driver or device
    /// (`NoDevice`), out of device memory, a failed launch, ...
    #[cfg(feature = "cuda")]
    #[error("CUDA: {0}")]
    Cuda(#[from] cust::error::CudaError),
    /// Opening the GPU failed at the named driver call (feature `cuda`):
    /// `cuInit` (no driver, or the stub `libcuda` found first), the device,
    /// the context, or loading the kernels (cubin load, PTX JIT). A GPU check
    /// reports this call, so "no device" and "a device that fails" differ.
    #[cfg(feature = "cuda")]
    #[error("CUDA {call} failed: {source}")]
    CudaCall {
        /// The driver call (and what it was for).
        call: &'static str,
        /// The driver's error.
        source: cust::error::CudaError,
    },
}

/// Why a wire buffer (or a set of parts) is not a valid quantized value.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// Fewer bytes than the fixed header.
    #[error("truncated header: {0} bytes, need {HEADER}", HEADER = crate::wire_header::HEADER_LEN)]
    TruncatedHeader(usize),
    /// The magic bytes are wrong (not a zeropp-quant buffer).
    #[error("bad magic {0:02x?}")]
    BadMagic([u8; 4]),
    /// A format version this build cannot read.
    #[error("unsupported wire version {0} (this build reads version {v})", v = crate::wire_header::VERSION)]
    UnsupportedVersion(u16),
    /// The header checksum does not match.
    #[error("header checksum mismatch: stored {stored:#010x}, computed {computed:#010x}")]
    HeaderChecksum {
        /// Checksum stored in the buffer.
        stored: u32,
        /// Checksum of the header bytes.
        computed: u32,
    },
    /// A header field has an invalid value.
    #[error("invalid header field {field}: {value}")]
    BadField {
        /// Field name.
        field: &'static str,
        /// The value found.
        value: u64,
    },
    /// The buffer length does not match the header (truncated or oversized).
    #[error("buffer is {actual} bytes but the header describes {expected}")]
    LengthMismatch {
        /// Length implied by the header.
        expected: u64,
        /// Length of the buffer.
        actual: usize,
    },
    /// A stored scale is not finite and positive.
    #[error("invalid scale {value} in group {group}")]
    BadScale {
        /// Group index.
        group: usize,
        /// The stored value.
        value: f32,
    },
    /// A stored offset is not finite.
    #[error("invalid offset {value} in group {group}")]
    BadOffset {
        /// Group index.
        group: usize,
        /// The stored value.
        value: f32,
    },
    /// The padding nibble after an odd number of INT4 elements is not zero.
    #[error("nonzero INT4 padding nibble")]
    BadPadding,
    /// Parts given to `Quantized::from_parts` are inconsistent.
    #[error("inconsistent parts: {0}")]
    Inconsistent(&'static str),
}

/// Shorthand for `Result<T, QuantError>`.
pub type Result<T, E = QuantError> = std::result::Result<T, E>;
