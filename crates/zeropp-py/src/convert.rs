//! The conversions every binding shares: zeropp's Python exception, Rust
//! errors into it, and the quantization arguments into zeropp-quant's types.

use pyo3::prelude::*;
use zeropp_quant::{Bits, NonFinite, Options, QuantSpec, Scheme};

pyo3::create_exception!(
    zeropp,
    ZeroppError,
    pyo3::exceptions::PyValueError,
    "An error from zeropp's Rust core (bad arguments, a corrupt encoding), with its message."
);

/// A [`ZeroppError`] with `msg`.
pub(crate) fn error(msg: impl Into<String>) -> PyErr {
    ZeroppError::new_err(msg.into())
}

/// Converts a Rust error into a [`ZeroppError`] with its message.
pub(crate) fn rust_err(e: impl std::fmt::Display) -> PyErr {
    error(e.to_string())
}

/// The spec for `(bits, group_size, symmetric)`.
pub(crate) fn spec(bits: u32, group_size: usize, symmetric: bool) -> PyResult<QuantSpec> {
    let b = Bits::from_bits(bits).map_err(rust_err)?;
    let scheme = if symmetric { Scheme::Symmetric } else { Scheme::Asymmetric };
    QuantSpec::new(b, scheme, group_size).map_err(rust_err)
}

/// Kernel options: stochastic rounding with `seed` (nearest-even when `None`);
/// with `propagate`, a group holding NaN/±Inf is encoded as poisoned (it
/// decodes to NaN) instead of failing ([`NonFinite::Propagate`]).
pub(crate) fn options(seed: Option<u64>, propagate: bool) -> Options {
    let o = match seed {
        Some(s) => Options::default().stochastic(s),
        None => Options::default(),
    };
    if propagate { o.with_non_finite(NonFinite::Propagate) } else { o }
}
