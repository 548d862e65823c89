//! qwZ-Δ's options ([`DeltaConfig`]): the hpZ copy kept current across steps by
//! quantized weight differences instead of a cross-node weight gather.

use serde::{Deserialize, Serialize};
use zeropp_comm::quant::{Bits, QuantSpec};

use super::spec::{default_spec, spec_serde};

/// qwZ-Δ (SDP4Bit's weight-difference quantization on hpZ's copy): after the
/// first step, the forward gather never leaves the node. Each owner keeps `Ŵ`,
/// the reconstruction every node's hpZ copy holds of its primary shard, and at
/// the next step's forward sends `Q(W − Ŵ)` to the holders of that shard (one
/// INT4 encoding per other node); owner and holders then add the same dequantized
/// difference, rounded to the copy's element type. The copy is rebuilt by a full
/// forward gather (qwZ's INT8, or dense without qwZ) at the first step of a run,
/// every [`DeltaConfig::refresh_every`] steps, after a skipped step and at the
/// step after a checkpoint is saved (so a resumed run, which also starts with a
/// refresh, repeats the uninterrupted one bit for bit).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct DeltaConfig {
    /// The format of the differences (symmetric INT4, groups of 256, by default).
    #[serde(with = "spec_serde")]
    pub spec: QuantSpec,
    /// A full refresh every this many optimizer steps (step `k` with `k %
    /// refresh_every == 0`); 0 = only the forced ones (first step, after a skip,
    /// after a checkpoint).
    pub refresh_every: usize,
}

impl DeltaConfig {
    /// The default refresh period, in optimizer steps (see docs/PERFORMANCE.md,
    /// "Beyond ZeRO++", for the measurement behind it).
    pub const DEFAULT_REFRESH_EVERY: usize = 100;
}

impl Default for DeltaConfig {
    /// INT4 differences in groups of 256, a refresh every
    /// [`DeltaConfig::DEFAULT_REFRESH_EVERY`] steps.
    fn default() -> Self {
        Self { spec: default_spec(Bits::Int4), refresh_every: Self::DEFAULT_REFRESH_EVERY }
    }
}
