//! The element types on the wire: the baseline collectives' ([`CommDtype`]) and
//! the hpZ secondary shard's ([`HpzWire`]), and the serde of [`Routing`](super::Routing).

use serde::{Deserialize, Serialize};

use crate::EngineError;

/// How the hpZ secondary shard is held and gathered in the backward pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum HpzWire {
    /// In the baseline element type ([`CommDtype`], bf16 by default): the
    /// gathered weights as the forward pass used them. `2·Ψ/hpz` bytes held.
    #[default]
    Dense,
    /// As the qwZ INT8 encodings the forward gather received (DeepSpeed's choice
    /// when qwZ is on): about half the bytes held and sent, the same weights (they
    /// are the same bytes). Needs qwZ; without it the dense wire is used.
    Int8,
}

impl HpzWire {
    /// The lower-case name (`dense`, `int8`).
    pub fn name(self) -> &'static str {
        spelled(self, Self::SPELLINGS)
    }

    /// Each value's name, then the other spellings `from_str` accepts.
    const SPELLINGS: &'static [(Self, &'static [&'static str])] =
        &[(Self::Dense, &["dense", "bf16", "16bit"]), (Self::Int8, &["int8"])];
}

impl std::str::FromStr for HpzWire {
    type Err = EngineError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        parse_spelled(s, "hpZ wire", Self::SPELLINGS)
    }
}

/// The first spelling of `v` in `table` (its name).
fn spelled<T: PartialEq>(v: T, table: &[(T, &'static [&'static str])]) -> &'static str {
    table.iter().find(|(t, _)| *t == v).and_then(|(_, names)| names.first()).copied().unwrap_or("?")
}

/// The value `s` spells (case-insensitively) in `table`, or an error listing
/// the names of `what`.
fn parse_spelled<T: Copy>(
    s: &str,
    what: &str,
    table: &[(T, &'static [&'static str])],
) -> Result<T, EngineError> {
    let lower = s.to_ascii_lowercase();
    if let Some((v, _)) = table.iter().find(|(_, names)| names.contains(&lower.as_str())) {
        return Ok(*v);
    }
    let names: Vec<&str> = table.iter().filter_map(|(_, names)| names.first().copied()).collect();
    Err(EngineError::InvalidConfig(format!("unknown {what} `{lower}` (expected {})", names.join(" or "))))
}

/// Serde for [`Routing`] (a comm type) as its name.
pub(super) mod routing_serde {
    use serde::{Deserialize, Deserializer, Serializer};
    use zeropp_comm::collectives::Routing;

    pub(in crate::config) fn serialize<S: Serializer>(r: &Routing, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(r.name())
    }

    pub(in crate::config) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Routing, D::Error> {
        let name = String::deserialize(d)?;
        name.parse().map_err(serde::de::Error::custom)
    }
}

/// The element type the baseline (non-quantized) collectives put on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum CommDtype {
    /// bfloat16: what ZeRO-3 sends with `bf16.enabled` (the default).
    #[default]
    Bf16,
    /// f32: exact communication, used by the equivalence tests.
    F32,
}

impl From<CommDtype> for zeropp_comm::collectives::ResidualPrecision {
    /// The residual storage of the same element type (the CLI's
    /// `--loco-residuals` takes [`CommDtype`]'s spellings).
    fn from(d: CommDtype) -> Self {
        match d {
            CommDtype::Bf16 => Self::Bf16,
            CommDtype::F32 => Self::F32,
        }
    }
}

impl CommDtype {
    /// The comm crate's name for this wire type.
    pub fn wire(self) -> zeropp_comm::collectives::DenseWire {
        match self {
            Self::Bf16 => zeropp_comm::collectives::DenseWire::Bf16,
            Self::F32 => zeropp_comm::collectives::DenseWire::F32,
        }
    }

    /// Bytes per element on the wire.
    pub fn bytes(self) -> usize {
        match self {
            Self::Bf16 => 2,
            Self::F32 => 4,
        }
    }

    /// The lower-case name (`bf16`, `f32`).
    pub fn name(self) -> &'static str {
        spelled(self, Self::SPELLINGS)
    }

    /// Each value's name, then the other spellings `from_str` accepts.
    const SPELLINGS: &'static [(Self, &'static [&'static str])] =
        &[(Self::Bf16, &["bf16", "bfloat16"]), (Self::F32, &["f32", "fp32", "float32"])];
}

impl std::str::FromStr for CommDtype {
    type Err = EngineError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        parse_spelled(s, "communication dtype", Self::SPELLINGS)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every value's name parses back to it, the aliases parse in any case, and
    /// an unknown spelling is an error listing the names.
    #[test]
    fn names_round_trip_and_unknown_names_are_listed() {
        for v in [HpzWire::Dense, HpzWire::Int8] {
            assert_eq!(v.name().parse::<HpzWire>().ok(), Some(v));
        }
        for v in [CommDtype::Bf16, CommDtype::F32] {
            assert_eq!(v.name().parse::<CommDtype>().ok(), Some(v));
        }
        assert_eq!(["dense", "int8"], [HpzWire::Dense.name(), HpzWire::Int8.name()]);
        assert_eq!("BFloat16".parse::<CommDtype>().ok(), Some(CommDtype::Bf16));
        assert_eq!("16BIT".parse::<HpzWire>().ok(), Some(HpzWire::Dense));
        let e = "fp8".parse::<CommDtype>().err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("unknown communication dtype `fp8` (expected bf16 or f32)"), "{e}");
    }
}
