//! [`ZeroConfig`]: the ZeRO stage, the ZeRO++ techniques switched one by one,
//! and DeepSpeed's stage-3 bucket knobs ([`BucketKnobs`]).

use serde::{Deserialize, Serialize};
use zeropp_comm::collectives::Routing;
use zeropp_comm::quant::{Bits, QuantSpec};

use super::spec::{check_spec, default_spec, spec_serde};
use super::wire::routing_serde;
use super::{CommDtype, DEFAULT_GROUP_SIZE, DeltaConfig, HpzWire, LocoConfig, QgzConfig};
use crate::EngineError;

/// The ZeRO stage and the ZeRO++ techniques, each switchable on its own; a
/// technique that is off carries no parameters.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ZeroConfig {
    /// ZeRO stage; only 3 is supported.
    pub stage: u8,
    /// qwZ, the quantized weight all-gather of the forward pass, with its spec
    /// (INT8, groups of 256 by default); `None` = off.
    #[serde(default, with = "spec_serde::option")]
    pub qwz: Option<QuantSpec>,
    /// hpZ partition size: ranks per secondary-shard group (1 = hpZ off).
    /// Must divide the node size.
    pub hpz_size: usize,
    /// qgZ and its options; `None` = off.
    #[serde(default)]
    pub qgz: Option<QgzConfig>,
    /// qwZ-Δ: the hpZ copy kept current across steps by quantized weight
    /// differences, so the forward gather stays inside the node too (see
    /// [`DeltaConfig`]); `None` = off. Needs hpZ (dense wire).
    #[serde(default)]
    pub qwz_delta: Option<DeltaConfig>,
    /// Element type of the baseline collectives.
    pub comm_dtype: CommDtype,
    /// Routing of every world collective (the dense ZeRO-3 gathers and
    /// reduce-scatters, and ZeRO++'s qwZ gathers): hierarchical (inter-node hop
    /// over the rail, then intra-node, as NCCL and torch HSDP route; the default)
    /// or flat (every rank with every rank). qgZ is hierarchical by construction.
    #[serde(default, with = "routing_serde")]
    pub routing: Routing,
    /// How hpZ holds and gathers its secondary shard (see [`HpzWire`]).
    #[serde(default)]
    pub hpz_wire: HpzWire,
    /// Stochastic rounding in the quantizers (seeded, deterministic).
    pub stochastic_rounding: bool,
    /// Prefetch the next layer's forward gather while the current layer computes.
    pub prefetch: bool,
    /// Quantization groups never straddle two parameters: each parameter starts
    /// at a multiple of the group size inside its layer's flat buffer (zero
    /// padding in between), so each tensor gets its own scales, as in DeepSpeed.
    /// Off, a group can hold the tail of one tensor and the head of the next
    /// (e.g. a LayerNorm gain of 1.0 next to weights of 0.02, whose INT8 step then
    /// becomes 1/127). Applies to every mode, so all modes pad the model alike.
    #[serde(default = "yes")]
    pub per_tensor_groups: bool,
    /// DeepSpeed's stage-3 bucket knobs (all off by default).
    #[serde(default)]
    pub buckets: BucketKnobs,
}

/// DeepSpeed's stage-3 bucket and prefetch knobs, in elements, mapped onto this
/// engine's schedule (`zero_optimization.*` in a DeepSpeed file, or flags).
///
/// | knob | effect here |
/// |---|---|
/// | `param_persistence_threshold` | parameters of at most this many elements leave their layer's bucket for one `persistent` bucket: gathered once per step (`persist_gather`, after the update) and kept whole on every rank, never gathered per layer; their gradients are reduced together once per micro-batch |
/// | `prefetch_bucket_size` | a layer's gather is prefetched only when its padded size is at most this (`Some(0)`: no prefetch) |
/// | `max_live_parameters` | a prefetch is issued only when the gathered layer in use plus the prefetched one stay within this many elements |
/// | `reduce_bucket_size` | a layer's gradient is reduced in calls of at most this many padded elements (each call its own collective, headers and scales) |
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct BucketKnobs {
    /// `reduce_bucket_size`: most padded elements per gradient reduce call
    /// (`None`: one call per layer).
    #[serde(default)]
    pub reduce_bucket_size: Option<usize>,
    /// `stage3_prefetch_bucket_size`: largest layer (padded elements) that is
    /// prefetched (`None`: any; `Some(0)`: none).
    #[serde(default)]
    pub prefetch_bucket_size: Option<usize>,
    /// `stage3_param_persistence_threshold`: parameters with at most this many
    /// elements are persistent (0: none; DeepSpeed's default is 100000).
    #[serde(default)]
    pub param_persistence_threshold: usize,
    /// `stage3_max_live_parameters`: most gathered elements alive at once when
    /// deciding a prefetch (`None`: unlimited).
    #[serde(default)]
    pub max_live_parameters: Option<usize>,
}

fn yes() -> bool {
    true
}

impl ZeroConfig {
    /// Plain ZeRO-3: every ZeRO++ technique off, 16-bit (bf16) communication.
    pub fn zero3() -> Self {
        Self {
            stage: 3,
            qwz: None,
            hpz_size: 1,
            qgz: None,
            qwz_delta: None,
            comm_dtype: CommDtype::Bf16,
            routing: Routing::Hierarchical,
            hpz_wire: HpzWire::Dense,
            stochastic_rounding: false,
            prefetch: true,
            per_tensor_groups: true,
            buckets: BucketKnobs::default(),
        }
    }

    /// Full ZeRO++ with its default options: qwZ INT8, hpZ over the node
    /// (`local_size` ranks), and qgZ INT4 with **stochastic rounding**, **no
    /// error feedback** and the 1-D parameters reduced at the baseline precision
    /// ([`QgzConfig::with_options`]).
    ///
    /// These options met the fidelity rule on all three corpora of
    /// `cargo xtask bench fidelity` at the default lr 3e-3 (8 seeds, mean
    /// validation-loss ratio to ZeRO-3: 0.980, 0.995 and 1.001, worst seed 1.025;
    /// docs/PERFORMANCE.md, "Fidelity"). LoCo error feedback
    /// ([`QgzConfig::loco`]) is opt-in: it trained up to 10% worse at lr 1e-2 and
    /// at parity (0.999-1.001) at 3e-3, for 2.5 bytes of residuals per parameter.
    pub fn zeropp(local_size: usize) -> Self {
        Self {
            qwz: Some(Self::default_qwz_spec()),
            hpz_size: local_size.max(1),
            qgz: Some(QgzConfig::with_options(Self::default_qgz_spec())),
            ..Self::zero3()
        }
    }

    /// [`ZeroConfig::zeropp`] as the ZeRO++ paper describes it: the three
    /// techniques alone: round to nearest, no 1-D exclusion, no error feedback
    /// ([`QgzConfig::plain`]).
    pub fn zeropp_plain(local_size: usize) -> Self {
        Self { qgz: Some(QgzConfig::default()), ..Self::zeropp(local_size) }
    }

    /// ZeRO++ with SDP4Bit's techniques on top (the `zeropp-delta` mode): the
    /// defaults of [`ZeroConfig::zeropp`], plus qwZ-Δ (INT4 weight differences
    /// into the hpZ copy, [`DeltaConfig::default`]), and qgZ in two levels (INT8
    /// inside the node, INT4 across) with Hadamard smoothing
    /// ([`QgzConfig::sdp4bit`]). Across nodes a step then sends INT4 weight
    /// differences and INT4 gradients (docs/PERFORMANCE.md, "Beyond ZeRO++").
    pub fn zeropp_delta(local_size: usize) -> Self {
        Self {
            qgz: Some(QgzConfig::sdp4bit(Self::default_qgz_spec())),
            qwz_delta: Some(DeltaConfig::default()),
            ..Self::zeropp(local_size)
        }
    }

    /// qwZ's default spec: symmetric INT8, groups of [`DEFAULT_GROUP_SIZE`].
    pub fn default_qwz_spec() -> QuantSpec {
        default_spec(Bits::Int8)
    }

    /// qgZ's default spec: symmetric INT4, groups of [`DEFAULT_GROUP_SIZE`].
    pub fn default_qgz_spec() -> QuantSpec {
        default_spec(Bits::Int4)
    }

    /// This config with qwZ on at `spec`.
    pub fn with_qwz(self, spec: QuantSpec) -> Self {
        Self { qwz: Some(spec), ..self }
    }

    /// This config with qgZ on as `qgz`.
    pub fn with_qgz(self, qgz: QgzConfig) -> Self {
        Self { qgz: Some(qgz), ..self }
    }

    /// This config with hpZ groups of `hpz_size` ranks (1 = off).
    pub fn with_hpz(self, hpz_size: usize) -> Self {
        Self { hpz_size, ..self }
    }

    /// True when hpZ is on (`hpz_size > 1`).
    pub fn hpz(&self) -> bool {
        self.hpz_size > 1
    }

    /// qgZ's error feedback (`None` when qgZ or the feedback is off).
    pub fn error_feedback(&self) -> Option<LocoConfig> {
        self.qgz.and_then(|q| q.error_feedback)
    }

    /// True when qgZ is on and reduces the 1-D parameters at the baseline precision.
    pub fn exclude_1d(&self) -> bool {
        self.qgz.is_some_and(|q| q.exclude_1d)
    }

    /// True when qgZ is on and rounds stochastically (its own option or
    /// [`ZeroConfig::stochastic_rounding`]).
    pub fn qgz_stochastic(&self) -> bool {
        self.qgz.is_some_and(|q| q.stochastic || self.stochastic_rounding)
    }

    /// The group sizes the shards are aligned to: qwZ's and qgZ's, or
    /// [`DEFAULT_GROUP_SIZE`] for a technique that is off (qwZ-Δ's differences
    /// are weights too: the least common multiple of its group and qwZ's).
    pub fn group_sizes(&self) -> (usize, usize) {
        fn gcd(a: usize, b: usize) -> usize {
            if b == 0 { a } else { gcd(b, a % b) }
        }
        let qwz = self.qwz.map_or(DEFAULT_GROUP_SIZE, |s| s.group_size());
        (
            self.qwz_delta.map_or(qwz, |d| {
                let g = d.spec.group_size();
                qwz / gcd(qwz, g).max(1) * g
            }),
            self.qgz.map_or(DEFAULT_GROUP_SIZE, |q| q.spec.group_size()),
        )
    }

    /// A short label: `zero3`, `zeropp`, `zeropp-delta`, or the enabled
    /// techniques (`qwz+hpz`, `zeropp+delta`).
    pub fn label(&self) -> String {
        if self.qwz_delta.is_some()
            && self.qwz.is_some()
            && self.hpz()
            && self.qgz.is_some_and(|q| q.two_level && q.hadamard)
        {
            return "zeropp-delta".to_string();
        }
        let mut parts = Vec::new();
        if self.qwz.is_some() {
            parts.push("qwz");
        }
        if self.hpz() {
            parts.push("hpz");
        }
        if self.qgz.is_some() {
            parts.push("qgz");
        }
        let mut label = match parts.len() {
            0 => "zero3".to_string(),
            3 => "zeropp".to_string(),
            _ => parts.join("+"),
        };
        if self.qwz_delta.is_some() {
            label.push_str("+delta");
        }
        label
    }

    /// Checks the switches against a cluster of `world` ranks, `local_size` per node.
    pub fn validate(&self, world: usize, local_size: usize) -> Result<(), EngineError> {
        if self.stage != 3 {
            return Err(EngineError::InvalidConfig(format!(
                "ZeRO stage {} is not supported: this engine implements stage 3 (with ZeRO++)",
                self.stage
            )));
        }
        if world == 0 || local_size == 0 || !world.is_multiple_of(local_size) {
            return Err(EngineError::InvalidConfig(format!(
                "world {world} is not divisible into nodes of {local_size} ranks (set `world` to a \
                 multiple of `local_size`)"
            )));
        }
        if self.hpz_size == 0 || !local_size.is_multiple_of(self.hpz_size) {
            return Err(EngineError::InvalidConfig(format!(
                "hpZ partition size {} must be >= 1 and divide the node size {local_size}: set \
                 `engine.zero.hpz_size` (`--hpz`) to a divisor of {local_size}, e.g. with \
                 ZeroConfig::zeropp({local_size}) or RunConfig::on(world, {local_size})",
                self.hpz_size
            )));
        }
        if let Some(s) = &self.qwz {
            check_spec("qwZ", s)?;
        }
        if let Some(q) = &self.qgz {
            check_spec("qgZ", &q.spec)?;
            q.validate().map_err(|e| match e {
                zeropp_comm::CommError::InvalidConfig(m) => EngineError::InvalidConfig(m),
                e => EngineError::Comm(e),
            })?;
        }
        if let Some(d) = &self.qwz_delta {
            check_spec("qwZ-delta", &d.spec)?;
            if !self.hpz() {
                return Err(EngineError::InvalidConfig(format!(
                    "qwZ-delta keeps the hpZ copy current across steps, so it needs hpZ: set the hpZ size \
                     (--hpz) to a divisor of the node size {local_size} above 1, or turn qwZ-delta off"
                )));
            }
            if self.hpz_wire != HpzWire::Dense {
                return Err(EngineError::InvalidConfig(
                    "qwZ-delta updates the hpZ copy in place: it needs the dense hpZ wire (--hpz-wire dense), \
                     not the INT8 encodings"
                        .into(),
                ));
            }
        }
        if let Some(r) = self.buckets.reduce_bucket_size {
            let (a, b) = self.group_sizes();
            let min = world * a.max(b);
            if r < min {
                return Err(EngineError::InvalidConfig(format!(
                    "reduce_bucket_size {r} is below one quantization group per rank ({world} ranks x {} = {min} elements)",
                    a.max(b)
                )));
            }
        }
        Ok(())
    }
}

impl Default for ZeroConfig {
    fn default() -> Self {
        Self::zero3()
    }
}
