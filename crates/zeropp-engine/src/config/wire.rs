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
        match self {
            Self::Dense => "dense",
            Self::Int8 => "int8",
        }
    }
}

impl std::str::FromStr for HpzWire {
    type Err = EngineError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "dense" | "bf16" | "16bit" => Ok(Self::Dense),
            "int8" => Ok(Self::Int8),
            other => Err(EngineError::InvalidConfig(format!(
                "unknown hpZ wire `{other}` (expected dense or int8)"
            ))),
        }
    }
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
        match self {
            Self::Bf16 => "bf16",
            Self::F32 => "f32",
        }
    }
}

impl std::str::FromStr for CommDtype {
    type Err = EngineError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "bf16" | "bfloat16" => Ok(Self::Bf16),
            "f32" | "fp32" | "float32" => Ok(Self::F32),
            other => Err(EngineError::InvalidConfig(format!(
                "unknown communication dtype `{other}` (expected bf16 or f32)"
            ))),
        }
    }
}
