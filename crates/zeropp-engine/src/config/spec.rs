//! Quantization specs as ZeRO++ uses them: built and checked from bits and a
//! group size ([`quant_spec`]), the defaults, and their serde.

use zeropp_comm::quant::{Bits, QuantSpec, Scheme};

use crate::EngineError;

/// Elements per quantization group of the default qwZ and qgZ specs (and the
/// shard alignment of a technique that is off).
pub const DEFAULT_GROUP_SIZE: usize = 256;

/// The symmetric quantization spec of `bits` (4 or 8) with `group_size`
/// elements per scale, checked as ZeRO++ needs it: `name` (`qwZ`, `qgZ`) names
/// the technique in the errors. This is where specs from flags and files are built.
///
/// ```
/// use zeropp_engine::config::quant_spec;
/// assert_eq!(quant_spec("qgZ", 4, 128).unwrap().group_size(), 128);
/// assert!(quant_spec("qgZ", 3, 128).is_err());
/// assert!(quant_spec("qwZ", 8, 7).is_err());
/// ```
pub fn quant_spec(name: &str, bits: u8, group_size: usize) -> Result<QuantSpec, EngineError> {
    let b = match bits {
        4 => Bits::Int4,
        8 => Bits::Int8,
        _ => return Err(EngineError::InvalidConfig(format!("{name} bits must be 4 or 8, got {bits}"))),
    };
    check_group(name, group_size)?;
    QuantSpec::new(b, Scheme::Symmetric, group_size).map_err(EngineError::InvalidQuantSpec)
}

fn check_group(name: &str, group: usize) -> Result<(), EngineError> {
    if group == 0 || !group.is_multiple_of(2) {
        return Err(EngineError::InvalidConfig(format!(
            "{name} group size must be a positive even number, got {group}"
        )));
    }
    Ok(())
}

/// A spec built by hand ([`QuantSpec::new`]) can still have an odd group size
/// (or, one day, another width): the same checks as [`quant_spec`].
pub(super) fn check_spec(name: &str, spec: &QuantSpec) -> Result<(), EngineError> {
    let bits = spec.bits().bits();
    if !matches!(bits, 4 | 8) {
        return Err(EngineError::InvalidConfig(format!("{name} bits must be 4 or 8, got {bits}")));
    }
    check_group(name, spec.group_size())
}

/// A default spec (symmetric, [`DEFAULT_GROUP_SIZE`]), infallible.
pub(super) fn default_spec(bits: Bits) -> QuantSpec {
    match QuantSpec::new(bits, Scheme::Symmetric, DEFAULT_GROUP_SIZE) {
        Ok(s) => s,
        Err(_) => unreachable!("the default group size is valid"),
    }
}

/// Serde for [`QuantSpec`]: comm's (`{bits, scheme, group_size}`).
pub(super) use zeropp_comm::quant::spec_serde;
