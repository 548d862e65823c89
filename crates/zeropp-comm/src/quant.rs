//! The zeropp-quant types that appear in comm's public API, re-exported so a user
//! of comm can build [`QwzOptions`](crate::collectives::QwzOptions),
//! [`QgzOptions`](crate::collectives::QgzOptions) and
//! [`RingOptions`](crate::collectives::RingOptions), match on
//! [`CommError::Quant`](crate::CommError::Quant) and compute the wire sizes of the
//! traffic formulas without depending on zeropp-quant directly.
//!
//! ```
//! use zeropp_comm::collectives::QgzOptions;
//! use zeropp_comm::quant::{Bits, Options, QuantSpec, Rounding, Scheme, encoded_len};
//!
//! let spec = QuantSpec::new(Bits::Int4, Scheme::Symmetric, 64)?;
//! let opts = QgzOptions {
//!     quant: Options::default().with_rounding(Rounding::Stochastic { seed: 7 }),
//!     ..QgzOptions::default().with_spec(spec)
//! };
//! assert_eq!(opts.inter_spec.group_size(), 64);
//! assert!(encoded_len(spec, 1000) > 500);
//! # Ok::<(), zeropp_comm::quant::QuantError>(())
//! ```

/// The `half` crate (`bf16`, `f16`): the 16-bit element types of
/// [`all_gather_bf16`](crate::collectives::all_gather_bf16) and of qwZ's inputs and outputs.
pub use zeropp_quant::half;
pub use zeropp_quant::{
    Bits, DecodeError, Element, Kernel, Options, Parallelism, QuantError, QuantSpec, Rounding, Scheme,
    encoded_len,
};
