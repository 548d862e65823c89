//! qgZ's options: the quantization, error feedback ([`LocoConfig`]), the 1-D
//! exclusion and the rounding ([`QgzConfig`]).

use serde::{Deserialize, Serialize};

use zeropp_comm::quant::Bits;

use super::spec::{default_spec, spec_serde};
use super::{CommDtype, QuantSpec};

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
    #[serde(default)]
    pub residual_dtype: CommDtype,
}

impl LocoConfig {
    /// The comm crate's storage precision for [`LocoConfig::residual_dtype`].
    pub fn residual_precision(&self) -> zeropp_comm::collectives::ResidualPrecision {
        match self.residual_dtype {
            CommDtype::Bf16 => zeropp_comm::collectives::ResidualPrecision::Bf16,
            CommDtype::F32 => zeropp_comm::collectives::ResidualPrecision::F32,
        }
    }
}

impl Default for LocoConfig {
    /// DeepSpeed's defaults: `err_beta` 0.8, `reset_T` 1024; residuals in bf16.
    fn default() -> Self {
        Self { err_beta: 0.8, reset_t: 1024, residual_dtype: CommDtype::Bf16 }
    }
}

/// qgZ, the hierarchical quantized gradient reduce-scatter, and its options.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct QgzConfig {
    /// The quantization of both quantizing hops (INT4, groups of 256 by default).
    /// The intra-node reduction in between is INT8 with the same group size.
    #[serde(with = "spec_serde")]
    pub spec: QuantSpec,
    /// Error feedback, LoCo style, on both quantizing hops (`None` = off; see
    /// [`LocoConfig`] and `zeropp_comm::collectives::ErrorFeedback`).
    pub error_feedback: Option<LocoConfig>,
    /// Reduce 1-D parameters (biases, LayerNorm gains and shifts) at full
    /// precision, as DeepSpeed does, instead of through INT4: their gradients go
    /// to their owners in the baseline type (a small all-to-all-v, routed like
    /// qgZ: inside the node, then over the rail), while qgZ carries the matrices
    /// (with zeros where the 1-D parameters are).
    #[serde(default)]
    pub exclude_1d: bool,
    /// Stochastic rounding in qgZ's quantizers (both hops), seeded and
    /// deterministic: every gradient value rounds up or down with the
    /// probability that makes the rounding unbiased, so small gradient
    /// components survive INT4 in expectation instead of rounding to zero.
    /// ([`ZeroConfig::stochastic_rounding`](super::ZeroConfig::stochastic_rounding) turns it on for every quantizer,
    /// qwZ's too.)
    #[serde(default)]
    pub stochastic: bool,
    /// SDP4Bit's two levels: the intra-node hop in INT8 (same group size) and
    /// [`QgzConfig::spec`] only for the inter-node hop. Off: both hops in `spec`.
    #[serde(default)]
    pub two_level: bool,
    /// SDP4Bit's smoothing: each quantization group rotated by a seeded,
    /// randomized Hadamard transform before its first quantization and back after
    /// the last dequantization (`zeropp_comm::collectives::QgzOptions::hadamard`;
    /// the seed is drawn per call from the run's seed, the same on every rank).
    /// Needs a power-of-two group size; not with error feedback.
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

    /// qgZ with the default options of [`ZeroConfig::zeropp`](super::ZeroConfig::zeropp): the 1-D
    /// parameters at the baseline precision and stochastic rounding, no error
    /// feedback (the variant that met the fidelity rule on every corpus
    /// measured; docs/PERFORMANCE.md, "Fidelity").
    pub fn with_options(spec: QuantSpec) -> Self {
        Self {
            spec,
            error_feedback: None,
            exclude_1d: true,
            stochastic: true,
            two_level: false,
            hadamard: false,
        }
    }

    /// qgZ as DeepSpeed's LoCo-ZeRO++ configures it: LoCo error feedback (its
    /// defaults), the 1-D parameters at the baseline precision, round to nearest
    /// (this crate's default before the fidelity study; opt-in now).
    pub fn loco(spec: QuantSpec) -> Self {
        Self {
            spec,
            error_feedback: Some(LocoConfig::default()),
            exclude_1d: true,
            stochastic: false,
            two_level: false,
            hadamard: false,
        }
    }

    /// [`QgzConfig::with_options`] plus SDP4Bit's two levels and Hadamard
    /// smoothing (the qgZ of [`ZeroConfig::zeropp_delta`](super::ZeroConfig::zeropp_delta)).
    pub fn sdp4bit(spec: QuantSpec) -> Self {
        Self { two_level: true, hadamard: true, ..Self::with_options(spec) }
    }

    /// The format of the intra-node hop: INT8 with `spec`'s group size when
    /// [`QgzConfig::two_level`], else `spec`.
    pub fn intra_spec(&self) -> QuantSpec {
        if self.two_level { QuantSpec::int8(self.spec.group_size()).unwrap_or(self.spec) } else { self.spec }
    }
}

impl Default for QgzConfig {
    /// INT4, groups of [`DEFAULT_GROUP_SIZE`](super::DEFAULT_GROUP_SIZE), without the options ([`QgzConfig::plain`]).
    fn default() -> Self {
        Self::plain(default_spec(Bits::Int4))
    }
}
