//! qgZ's settings as a run configures them ([`QgzConfig`], [`LocoConfig`]):
//! the one vocabulary of qgZ's options, serializable, that the engine's
//! configuration carries as it is and the CLI flags, the DeepSpeed reader and
//! zeropp.torch's keywords map onto (docs/ARCHITECTURE.md, "qgZ's options").
//!
//! [`QgzConfig::options`] is the one translation into the options of one call
//! ([`QgzOptions`]): the engine's collectives and its byte model both take
//! their options from it, so a new option is added here and in the stages that
//! act on it, and nowhere in between.

use serde::{Deserialize, Serialize};

use zeropp_quant::{Bits, Options, QuantSpec};

use super::{ErrorFeedback, QgzOptions, Reduce, ResidualPrecision};
use crate::CommError;
use crate::quant::spec_serde;

/// LoCo error feedback for qgZ (DeepSpeed's `zeropp_loco_param`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LocoConfig {
    /// Moving-average factor of the residual: `e ← β·e + (1 − β)·(new error)`
    /// (`err_beta`; 0 = plain error feedback). In `[0, 1)`.
    pub err_beta: f32,
    /// Every `reset_t` optimizer steps the residuals are reset to zero (`reset_T`;
    /// 0 = never). DeepSpeed counts this in calls of its reduce (one per parameter
    /// per step); here it counts optimizer steps.
    pub reset_t: usize,
    /// How the residuals are stored: bf16 (the default; half the memory, as
    /// DeepSpeed keeps its error buffers in the 16-bit dtype) or f32.
    #[serde(default = "bf16_residuals", with = "residual_serde")]
    pub residual_dtype: ResidualPrecision,
}

fn bf16_residuals() -> ResidualPrecision {
    ResidualPrecision::Bf16
}

/// `residual_dtype` as the lower-case names `bf16` and `f32`.
mod residual_serde {
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    use super::ResidualPrecision;

    pub(super) fn serialize<S: Serializer>(p: &ResidualPrecision, s: S) -> Result<S::Ok, S::Error> {
        match p {
            ResidualPrecision::Bf16 => "bf16",
            ResidualPrecision::F32 => "f32",
        }
        .serialize(s)
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<ResidualPrecision, D::Error> {
        match String::deserialize(d)?.as_str() {
            "bf16" => Ok(ResidualPrecision::Bf16),
            "f32" => Ok(ResidualPrecision::F32),
            other => {
                Err(serde::de::Error::custom(format!("residual_dtype must be bf16 or f32, got {other:?}")))
            }
        }
    }
}

impl LocoConfig {
    /// The residual state of one reduce call with these settings.
    pub fn feedback(&self) -> ErrorFeedback {
        ErrorFeedback::loco(self.err_beta).with_precision(self.residual_dtype)
    }
}

impl Default for LocoConfig {
    /// DeepSpeed's defaults: `err_beta` 0.8, `reset_T` 1024; residuals in bf16.
    fn default() -> Self {
        Self { err_beta: 0.8, reset_t: 1024, residual_dtype: ResidualPrecision::Bf16 }
    }
}

/// The per-call randomness of one qgZ call, drawn by the caller from its own
/// streams (the same on every rank for the rotation, per call for both).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct QgzSeeds {
    /// The stochastic-rounding seed of this call, or `None` to round to
    /// nearest. The caller draws one when [`QgzConfig::stochastic`] (or a
    /// switch of its own, such as stochastic rounding everywhere) asks.
    pub rounding: Option<u64>,
    /// The Hadamard sign-stream seed of this call (used when
    /// [`QgzConfig::hadamard`]); every rank must pass the same one.
    pub rotation: u64,
}

/// qgZ, the hierarchical quantized gradient reduce-scatter, as a run
/// configures it.
///
/// ```
/// use zeropp_comm::collectives::{QgzConfig, QgzSeeds};
/// use zeropp_comm::quant::{Bits, QuantSpec};
/// let q = QgzConfig::sdp4bit(QuantSpec::int4(256)?);
/// let o = q.options(QgzSeeds { rounding: Some(1), rotation: 7 })?;
/// assert_eq!((o.intra_spec.bits(), o.inter_spec.bits()), (Bits::Int8, Bits::Int4));
/// assert_eq!(o.hadamard, Some(7));
/// # Ok::<(), zeropp_comm::CommError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct QgzConfig {
    /// The quantization of both quantizing hops (INT4, groups of 256 by default).
    /// The intra-node reduction in between is INT8 with the same group size.
    #[serde(with = "spec_serde")]
    pub spec: QuantSpec,
    /// Error feedback, LoCo style, on both quantizing hops (`None` = off; see
    /// [`LocoConfig`] and [`ErrorFeedback`]).
    pub error_feedback: Option<LocoConfig>,
    /// Reduce 1-D parameters (biases, LayerNorm gains and shifts) at full
    /// precision, as DeepSpeed does, instead of through INT4: their gradients go
    /// to their owners in the baseline type (a small all-to-all-v, routed like
    /// qgZ: inside the node, then over the rail), while qgZ carries the matrices
    /// (with zeros where the 1-D parameters are). The caller, which knows the
    /// parameters, acts on it.
    #[serde(default)]
    pub exclude_1d: bool,
    /// Stochastic rounding in qgZ's quantizers (both hops), seeded and
    /// deterministic: every gradient value rounds up or down with the
    /// probability that makes the rounding unbiased, so small gradient
    /// components survive INT4 in expectation instead of rounding to zero.
    #[serde(default)]
    pub stochastic: bool,
    /// SDP4Bit's two levels: the intra-node hop in INT8 (same group size) and
    /// [`QgzConfig::spec`] only for the inter-node hop. Off: both hops in `spec`.
    #[serde(default)]
    pub two_level: bool,
    /// SDP4Bit's smoothing: each quantization group rotated by a seeded,
    /// randomized Hadamard transform before its first quantization and back after
    /// the last dequantization ([`QgzOptions::hadamard`]; the seed is
    /// [`QgzSeeds::rotation`]). Needs a power-of-two group size; not with error
    /// feedback.
    #[serde(default)]
    pub hadamard: bool,
}

impl QgzConfig {
    /// qgZ as the ZeRO++ paper describes it: `spec` alone, no error feedback,
    /// the 1-D parameters quantized like the matrices, round to nearest.
    pub fn plain(spec: QuantSpec) -> Self {
        Self {
            spec,
            error_feedback: None,
            exclude_1d: false,
            stochastic: false,
            two_level: false,
            hadamard: false,
        }
    }

    /// qgZ with zeropp's default options: the 1-D parameters at the baseline
    /// precision and stochastic rounding, no error feedback (the variant that
    /// met the fidelity rule on every corpus measured; docs/PERFORMANCE.md,
    /// "Fidelity").
    pub fn with_options(spec: QuantSpec) -> Self {
        Self { exclude_1d: true, stochastic: true, ..Self::plain(spec) }
    }

    /// qgZ as DeepSpeed's LoCo-ZeRO++ configures it: LoCo error feedback (its
    /// defaults), the 1-D parameters at the baseline precision, round to nearest.
    pub fn loco(spec: QuantSpec) -> Self {
        Self { error_feedback: Some(LocoConfig::default()), exclude_1d: true, ..Self::plain(spec) }
    }

    /// [`QgzConfig::with_options`] plus SDP4Bit's two levels and Hadamard
    /// smoothing (the qgZ of zeropp's `zeropp-delta` mode).
    pub fn sdp4bit(spec: QuantSpec) -> Self {
        Self { two_level: true, hadamard: true, ..Self::with_options(spec) }
    }

    /// The format of the intra-node hop: INT8 with `spec`'s group size when
    /// [`QgzConfig::two_level`], else `spec`.
    pub fn intra_spec(&self) -> QuantSpec {
        if self.two_level { QuantSpec::int8(self.spec.group_size()).unwrap_or(self.spec) } else { self.spec }
    }

    /// The options of one call (the mean over the ranks), with `seeds` for its
    /// randomness: the one place these settings become [`QgzOptions`].
    pub fn options(&self, seeds: QgzSeeds) -> Result<QgzOptions, CommError> {
        Ok(QgzOptions {
            intra_spec: self.intra_spec(),
            inter_spec: self.spec,
            local_spec: QuantSpec::int8(self.spec.group_size())?,
            reduce: Reduce::Mean,
            quant: match seeds.rounding {
                Some(seed) => Options::default().stochastic(seed),
                None => Options::default(),
            },
            hadamard: self.hadamard.then_some(seeds.rotation),
        })
    }

    /// Checks the settings against each other: a 4- or 8-bit spec with an even
    /// group size; Hadamard smoothing only on power-of-two groups
    /// and without error feedback; LoCo's `err_beta` in `[0, 1)`.
    ///
    /// ```
    /// use zeropp_comm::collectives::{LocoConfig, QgzConfig};
    /// use zeropp_comm::quant::QuantSpec;
    /// let mut q = QgzConfig::sdp4bit(QuantSpec::int4(256)?);
    /// assert!(q.validate().is_ok());
    /// q.error_feedback = Some(LocoConfig::default());
    /// assert!(q.validate().is_err());
    /// # Ok::<(), zeropp_comm::CommError>(())
    /// ```
    pub fn validate(&self) -> Result<(), CommError> {
        let bad = |m: String| Err(CommError::InvalidConfig(m));
        let (bits, g) = (self.spec.bits(), self.spec.group_size());
        if !matches!(bits, Bits::Int4 | Bits::Int8) {
            return bad(format!("qgZ bits must be 4 or 8, got {}", bits.bits()));
        }
        if g == 0 || !g.is_multiple_of(2) {
            return bad(format!("qgZ group size must be a positive even number, got {g}"));
        }
        let max = zeropp_quant::hadamard::MAX_GROUP;
        if self.hadamard && !(g.is_power_of_two() && g <= max) {
            return bad(format!(
                "qgZ's Hadamard smoothing rotates whole groups: the group size must be a power of two of at \
                 most {max}, got {g} (set --qgz-group-size to 256, say)"
            ));
        }
        if self.hadamard && self.error_feedback.is_some() {
            return bad(
                "qgZ's Hadamard smoothing and error feedback do not go together (the rotation changes \
                        every step, the residuals would be in last step's basis): turn one of them off"
                    .into(),
            );
        }
        if let Some(l) = self.error_feedback
            && !(l.err_beta.is_finite() && (0.0..1.0).contains(&l.err_beta))
        {
            return bad(format!("LoCo err_beta must be in [0, 1), got {}", l.err_beta));
        }
        Ok(())
    }
}

impl Default for QgzConfig {
    /// INT4, groups of [`QgzOptions::DEFAULT_GROUP_SIZE`], without the options
    /// ([`QgzConfig::plain`]).
    fn default() -> Self {
        let spec = QuantSpec::int4(QgzOptions::DEFAULT_GROUP_SIZE)
            .unwrap_or_else(|_| unreachable!("a non-zero group size is valid"));
        Self::plain(spec)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The settings survive JSON, and a file without the optional keys reads
    /// with the defaults (bf16 residuals, every switch off).
    #[test]
    fn settings_round_trip_and_old_files_read() {
        let mut q = QgzConfig::sdp4bit(QuantSpec::int4(128).unwrap_or_else(|_| unreachable!()));
        q.hadamard = false;
        q.error_feedback =
            Some(LocoConfig { residual_dtype: ResidualPrecision::F32, ..LocoConfig::default() });
        let json = serde_json::to_string(&q).unwrap_or_default();
        assert_eq!(serde_json::from_str::<QgzConfig>(&json).ok(), Some(q));
        let old = r#"{"spec":{"bits":4,"scheme":"sym","group_size":256},
                      "error_feedback":{"err_beta":0.5,"reset_t":3}}"#;
        let read: Option<QgzConfig> = serde_json::from_str(old).ok();
        assert_eq!(
            read.and_then(|q| q.error_feedback).map(|l| l.residual_dtype),
            Some(ResidualPrecision::Bf16)
        );
        assert_eq!(read.map(|q| (q.two_level, q.hadamard, q.stochastic)), Some((false, false, false)));
        assert!(
            serde_json::from_str::<LocoConfig>(r#"{"err_beta":0.5,"reset_t":3,"residual_dtype":"fp8"}"#)
                .is_err()
        );
    }

    /// Every setting reaches the options of a call, and the options of the
    /// byte model's call (no seeds) differ from a run's only in the randomness.
    #[test]
    fn options_carry_every_setting() -> Result<(), CommError> {
        let spec = QuantSpec::int4(64)?;
        let plain = QgzConfig::plain(spec).options(QgzSeeds::default())?;
        assert_eq!((plain.intra_spec, plain.inter_spec, plain.hadamard), (spec, spec, None));
        assert_eq!(plain.local_spec, QuantSpec::int8(64)?);
        let s = QgzSeeds { rounding: Some(3), rotation: 9 };
        let d = QgzConfig::sdp4bit(spec).options(s)?;
        assert_eq!((d.intra_spec, d.inter_spec, d.hadamard), (QuantSpec::int8(64)?, spec, Some(9)));
        assert_eq!(d.quant, Options::default().stochastic(3));
        assert_eq!(d.reduce, Reduce::Mean);
        Ok(())
    }
}
