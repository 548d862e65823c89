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
    Bits, DecodeError, Element, Kernel, NonFinite, Options, Parallelism, QuantError, QuantSpec, Rounding,
    Scheme, encoded_len,
};

/// Serde for [`QuantSpec`] (zeropp-quant has no serde): `{bits, scheme,
/// group_size}`, `scheme` being `sym` or `asym`. Use it as
/// `#[serde(with = "zeropp_comm::quant::spec_serde")]` on a spec, and its
/// [`option`](spec_serde::option) module on an optional one (`null` = off).
///
/// ```
/// use zeropp_comm::quant::QuantSpec;
/// #[derive(serde::Serialize, serde::Deserialize, PartialEq, Debug)]
/// struct S(#[serde(with = "zeropp_comm::quant::spec_serde")] QuantSpec);
/// let s = S(QuantSpec::int4(128)?);
/// let json = serde_json::to_string(&s).unwrap_or_default();
/// assert_eq!(json, r#"{"bits":4,"scheme":"sym","group_size":128}"#);
/// assert_eq!(serde_json::from_str::<S>(&json).ok(), Some(s));
/// # Ok::<(), zeropp_comm::quant::QuantError>(())
/// ```
pub mod spec_serde {
    use serde::{Deserialize, Deserializer, Serialize, Serializer};
    use zeropp_quant::{Bits, QuantSpec, Scheme};

    #[derive(Serialize, Deserialize)]
    struct Repr {
        bits: u32,
        scheme: String,
        group_size: usize,
    }

    fn repr(s: &QuantSpec) -> Repr {
        let scheme = if s.scheme().has_offsets() { "asym" } else { "sym" };
        Repr { bits: s.bits().bits(), scheme: scheme.to_string(), group_size: s.group_size() }
    }

    fn spec<E: serde::de::Error>(r: Repr) -> Result<QuantSpec, E> {
        let bits = Bits::from_bits(r.bits).map_err(E::custom)?;
        let scheme: Scheme = r.scheme.parse().map_err(E::custom)?;
        QuantSpec::new(bits, scheme, r.group_size).map_err(E::custom)
    }

    /// Writes `s` as `{bits, scheme, group_size}`.
    pub fn serialize<S: Serializer>(s: &QuantSpec, ser: S) -> Result<S::Ok, S::Error> {
        repr(s).serialize(ser)
    }

    /// Reads a spec, checked as [`QuantSpec::new`] checks it.
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<QuantSpec, D::Error> {
        spec(Repr::deserialize(d)?)
    }

    /// The same for an optional spec (`null` = off).
    pub mod option {
        use super::*;

        /// Writes `s`, or `null`.
        pub fn serialize<S: Serializer>(s: &Option<QuantSpec>, ser: S) -> Result<S::Ok, S::Error> {
            s.as_ref().map(repr).serialize(ser)
        }

        /// Reads a spec or `null`.
        pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<QuantSpec>, D::Error> {
            Option::<Repr>::deserialize(d)?.map(spec).transpose()
        }
    }
}
